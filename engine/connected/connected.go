// Package connected is an engine.Engine for a real engine on the node that
// attached its paged KV pool to the instance agent (package attach,
// docs/engine-attach.md): the agent loads prefetched and resumed blocks
// straight into pages the engine lent it, and the engine claims them; the
// engine reports its load. The engine runs its own requests: Generate is
// not the agent's to serve.
package connected

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/engine/attach"
	"github.com/kvsp/kvsp/tier"
)

// ErrNotAttached: no engine is attached (or none lent pages).
var ErrNotAttached = errors.New("connected: no engine is attached")

// Engine is the agent's view of an attached engine; it is also the
// handler of the agent's attach socket (attach.Handler and attach.Loader).
type Engine struct {
	desc   kvsp.Descriptor
	compat kvsp.CompatID
	g      container.Geometry
	row    int64
	dev    *tier.Device

	// mu guards the fields below, and every call of blocks: its callbacks
	// (which take and give back free pages, and copy through buf) run
	// with mu held.
	mu   sync.Mutex
	sess *attach.Session
	pool attach.Pool
	buf  tier.DeviceBuffer
	free []int // lent pages holding nothing yet
	// blocks are the blocks being loaded, or loaded and not claimed, each
	// the pages it takes; one the loader checked whole (Has) the engine
	// may claim.
	blocks *engine.Blocks[[]int]
	stats  engine.Stats
}

// New returns the engine of the model d, whose pools dev imports.
func New(d kvsp.Descriptor, g container.Geometry, dev *tier.Device) (*Engine, error) {
	compat, err := d.CompatID()
	if err != nil {
		return nil, err
	}
	e := &Engine{desc: d, compat: compat, g: g, row: int64(g.RawSectionLen()) / int64(g.BlockTokens), dev: dev}
	e.blocks = engine.NewBlocks(int(g.Layers), 0, e.allocLocked, e.releaseLocked)
	return e, nil
}

// allocLocked takes the pages of a new block from the free ones (lent, not
// lent to a block yet).
func (e *Engine) allocLocked(kvsp.BlockKey) ([]int, error) {
	n := (*kv)(e).pagesPerBlock()
	if len(e.free) < n {
		return nil, engine.ErrKVFull // no lent page left: the engine lends more
	}
	pages := append([]int(nil), e.free[:n]...)
	e.free = e.free[n:]
	return pages, nil
}

// releaseLocked gives a dropped block's pages back: lent still, empty
// again.
func (e *Engine) releaseLocked(pages []int) { e.free = append(e.free, pages...) }

// Descriptor implements engine.Engine.
func (e *Engine) Descriptor() kvsp.Descriptor { return e.desc }

// Geometry implements engine.Engine.
func (e *Engine) Geometry() container.Geometry { return e.g }

// Stats implements engine.Engine: the engine's last report.
func (e *Engine) Stats() engine.Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

// KV implements engine.Engine: the pages the engine lent.
func (e *Engine) KV() engine.KV { return (*kv)(e) }

// Generate implements engine.Engine: an attached engine serves its own
// requests, through its own API.
func (e *Engine) Generate(context.Context, engine.Request, func(engine.Token) error) (kvsp.FinishReason, error) {
	return "", fmt.Errorf("%w: the attached engine runs its requests itself", kvsp.ErrInvalidState)
}

// External implements engine.External: the agent refuses generate
// requests before it answers anything.
func (e *Engine) External() bool { return true }

// Attach implements attach.Handler: one engine at a time.
func (e *Engine) Attach(s *attach.Session, h *attach.Hello, fd int) error {
	closeFD := func() {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	if h.CompatID != e.compat {
		closeFD()
		return fmt.Errorf("connected: this instance serves compat_id %s", e.compat)
	}
	if err := h.Pool.Check(int(e.g.Layers), e.row); err != nil {
		closeFD()
		return err
	}
	if kind := e.dev.IPCKind(); h.Pool.Memory != kind {
		closeFD()
		return fmt.Errorf("connected: this instance's device takes %s memory, not %s", kind, h.Pool.Memory)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sess != nil {
		closeFD()
		return errors.New("connected: an engine is attached already")
	}
	buf, err := e.dev.Import(h.Pool.Handle, fd, h.Pool.Offset, h.Pool.Size)
	if err != nil {
		closeFD()
		return err
	}
	e.sess, e.pool, e.buf = s, h.Pool, buf
	return nil
}

// Publish implements attach.Handler: blocks are published at the holder's
// socket, not the agent's.
func (e *Engine) Publish(*attach.Session, kvsp.ScopeID, []attach.Placement) error {
	return errors.New("connected: publish blocks at the holder's attach socket")
}

// Unpublish implements attach.Handler.
func (e *Engine) Unpublish(*attach.Session, []kvsp.BlockKey) error {
	return errors.New("connected: unpublish blocks at the holder's attach socket")
}

// Detach implements attach.Handler: everything lent is forgotten.
func (e *Engine) Detach(s *attach.Session) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sess != s {
		return
	}
	e.buf.Free()
	e.blocks.Clear()
	e.sess, e.buf, e.free, e.stats = nil, nil, nil, engine.Stats{}
}

// Lend implements attach.Loader.
func (e *Engine) Lend(s *attach.Session, pages []int) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	inUse := map[int]bool{}
	for _, p := range e.free {
		inUse[p] = true
	}
	e.blocks.Each(func(_ kvsp.BlockKey, pages []int) {
		for _, p := range pages {
			inUse[p] = true
		}
	})
	for _, p := range pages {
		if p < 0 || p >= e.pool.Pages || inUse[p] {
			return fmt.Errorf("connected: page %d is outside the pool or lent already", p)
		}
		inUse[p] = true
	}
	e.free = append(e.free, pages...)
	return nil
}

// Claim implements attach.Loader: the blocks loaded whole, checked by the
// loader and not pinned go to the engine with their pages. (A block a
// reshard pins stays the agent's while the map holds it: sequence-sharded
// contexts on a connected engine are the next step.)
func (e *Engine) Claim(s *attach.Session) ([]attach.Placement, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := []attach.Placement{}
	e.blocks.Claim(func(k kvsp.BlockKey, pages []int) {
		out = append(out, attach.Placement{BlockKey: k, Page: pages[0], Pages: pages})
	})
	return out, nil
}

// Report implements attach.Loader: figures the status record could not
// carry are refused (they would make every status record invalid).
func (e *Engine) Report(s *attach.Session, st attach.Stats) error {
	finite := func(f float64) bool { return f >= 0 && !math.IsInf(f, 0) }
	switch {
	case !(st.KVUtilization >= 0 && st.KVUtilization <= 1):
		return errors.New("connected: kv_utilization must be in [0, 1]")
	case !finite(st.PrefillTokensPerS) || !finite(st.DecodeTokensPerS):
		return errors.New("connected: prefill_tokens_per_s and decode_tokens_per_s must be finite, non-negative numbers")
	case st.Running > kvsp.MaxJSONInt || st.Queued > kvsp.MaxJSONInt || st.BatchSize > kvsp.MaxJSONInt:
		return fmt.Errorf("connected: running, queued and batch_size are at most %d", uint64(kvsp.MaxJSONInt))
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stats = engine.Stats{Running: st.Running, Queued: st.Queued, BatchSize: st.BatchSize, KVUtilization: st.KVUtilization,
		PrefillTokensPerS: st.PrefillTokensPerS, DecodeTokensPerS: st.DecodeTokensPerS}
	return nil
}

// kv is the engine's lent pages as engine.KV.
type kv Engine

// pagesPerBlock is how many pages a block takes, from a page's first row.
func (m *kv) pagesPerBlock() int {
	return (int(m.g.BlockTokens) + m.pool.PageTokens - 1) / m.pool.PageTokens
}

// rows calls fn with each run of rows of one section (K or V) of layer in
// the block's pages: the pool offset, the offset in the section, octets.
func (m *kv) rows(pages []int, layer uint32, v bool, fn func(poolOff, secOff, n int64) error) error {
	pt := m.pool.PageTokens
	for t := 0; t < int(m.g.BlockTokens); t += pt {
		n := min(pt, int(m.g.BlockTokens)-t)
		k, vo := m.pool.Section(int(layer), pages[t/pt])
		off := k
		if v {
			off = vo
		}
		if err := fn(off, int64(t)*m.row, int64(n)*m.row); err != nil {
			return err
		}
	}
	return nil
}

func (m *kv) Has(key kvsp.BlockKey) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.blocks.Has(key) // the loader's check after its last layer: the block is done
}

func (m *kv) WriteLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error {
	sec := int64(m.g.RawSectionLen())
	if layer >= m.g.Layers || int64(len(k)) != sec || int64(len(v)) != sec {
		return fmt.Errorf("connected: layer %d with sections of %d and %d octets", layer, len(k), len(v))
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sess == nil {
		return ErrNotAttached
	}
	return m.blocks.Write(key, layer, func(pages []int) error {
		for i, sec := range [][]byte{k, v} {
			err := m.rows(pages, layer, i == 1, func(poolOff, secOff, n int64) error {
				return m.buf.CopyIn(poolOff, sec[secOff:secOff+n])
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
}

func (m *kv) ReadLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.blocks.Read(key, layer, func(pages []int) error {
		for i, sec := range [][]byte{k, v} {
			err := m.rows(pages, layer, i == 1, func(poolOff, secOff, n int64) error {
				return m.buf.CopyOut(sec[secOff:secOff+n], poolOff)
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
}

func (m *kv) Drop(key kvsp.BlockKey) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.blocks.Drop(key) // its pages: lent still, empty again
}

func (m *kv) Pin(key kvsp.BlockKey) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.blocks.Pin(key)
}

func (m *kv) Unpin(key kvsp.BlockKey) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.blocks.Unpin(key)
}

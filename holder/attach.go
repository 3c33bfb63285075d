package holder

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine/attach"
	"github.com/kvsp/kvsp/tier"
)

// Serving an attached engine's memory (package attach, docs/engine-attach.md):
// an engine on the node hands the holder its paged KV pool (a CUDA IPC
// handle, or the stand-in's memfd) and says which pages hold which
// blocks; the holder reads each published block once for its digests,
// publishes its replica (all layers on the device tier) and serves GETs
// straight out of the engine's pages through the device's pinned staging.
// Unpublish returns once no GET reads the pages any more.

// attachment is one engine session: its pool, mapped into this process.
type attachment struct {
	h      *Holder
	pool   attach.Pool
	buf    tier.DeviceBuffer
	compat kvsp.CompatID
	g      container.Geometry

	mu     sync.Mutex
	blocks map[blockID]*entry
}

// attached is where an entry's octets are: when pages are blocks, 2
// regions (K, V) per layer of the pool; otherwise the block's pages and
// the row of its first token, gathered on the device for each read.
type attached struct {
	a       *attachment
	regions []tier.Region
	table   []int32
	first   int
}

// source returns the buffer and the 2 regions per layer a read copies
// from: the pool itself, or the block gathered into device memory (freed
// by release).
func (at *attached) source() (tier.DeviceBuffer, []tier.Region, func(), error) {
	if at.regions != nil {
		return at.a.buf, at.regions, func() {}, nil
	}
	a := at.a
	d := a.h.store.dev.d
	g := a.g
	p := tier.Paged{Layers: int(g.Layers), PageTokens: a.pool.PageTokens, RowBytes: int(g.RawSectionLen()) / int(g.BlockTokens),
		LayerStride: a.pool.LayerStride, VOffset: a.pool.VOffset, PageStride: a.pool.PageStride}
	sections, err := d.Alloc(p.SectionsLen(int(g.BlockTokens)))
	if err != nil {
		return nil, nil, nil, err
	}
	if err := d.Gather(sections, a.buf, p, at.table, at.first, int(g.BlockTokens)); err != nil {
		sections.Free()
		return nil, nil, nil, err
	}
	sec := int64(g.RawSectionLen())
	regions := make([]tier.Region, 2*g.Layers)
	for i := range regions {
		regions[i] = tier.Region{Off: int64(i) * sec, Len: sec}
	}
	return sections, regions, sections.Free, nil
}

// AttachHandler is the holder's side of the engine attach protocol; serve
// it with attach.Server on a Unix socket.
func (h *Holder) AttachHandler() attach.Handler { return attachHandler{h} }

type attachHandler struct{ h *Holder }

// Attach maps the engine's pool (the device tier's device imports it).
func (x attachHandler) Attach(s *attach.Session, hello *attach.Hello, fd int) error {
	h := x.h
	fail := func(err error) error {
		if fd >= 0 {
			unix.Close(fd)
		}
		return err
	}
	if h.store.dev == nil {
		return fail(errors.New("this holder has no device tier to serve an engine's memory from"))
	}
	g, ok := h.cfg.Geometries[hello.CompatID]
	if !ok {
		return fail(fmt.Errorf("this holder serves no model of compat_id %s", hello.CompatID))
	}
	if err := hello.Pool.Check(int(g.Layers), int64(g.RawSectionLen())/int64(g.BlockTokens)); err != nil {
		return fail(err)
	}
	if kind := h.store.dev.d.IPCKind(); hello.Pool.Memory != kind {
		return fail(fmt.Errorf("this holder's device takes %s memory, not %s", kind, hello.Pool.Memory))
	}
	buf, err := h.store.dev.d.Import(hello.Pool.Handle, fd, hello.Pool.Offset, hello.Pool.Size)
	if err != nil {
		return fail(err) // Import owns fd only once it succeeded
	}
	s.Value = &attachment{h: h, pool: hello.Pool, buf: buf, compat: hello.CompatID, g: g, blocks: map[blockID]*entry{}}
	h.log.Info("engine attached", "engine", hello.Engine, "pages", hello.Pool.Pages, "memory", hello.Pool.Memory)
	return nil
}

// Publish serves blocks out of the engine's pages: each is read once (its
// layer and container digests), then published.
func (x attachHandler) Publish(s *attach.Session, scope kvsp.ScopeID, blocks []attach.Placement) error {
	a := s.Value.(*attachment)
	bt := int(a.g.BlockTokens)
	tables := make([][]int32, len(blocks))
	firsts := make([]int, len(blocks))
	for i, b := range blocks {
		var err error
		if tables[i], firsts[i], err = b.Table(a.pool.Pages, a.pool.PageTokens, bt); err != nil {
			return err
		}
	}
	var added []*entry
	for i, b := range blocks {
		id := blockID{compat: a.compat, scope: scope, key: b.BlockKey}
		at := &attached{a: a}
		if a.pool.PageTokens == bt { // a page is the block's sections
			sec := int64(a.g.RawSectionLen())
			at.regions = make([]tier.Region, 0, 2*a.g.Layers)
			for l := range int(a.g.Layers) {
				k, v := a.pool.Section(l, int(tables[i][0]))
				at.regions = append(at.regions, tier.Region{Off: k, Len: sec}, tier.Region{Off: v, Len: sec})
			}
		} else {
			at.table, at.first = tables[i], firsts[i]
		}
		blk, err := a.read(at)
		if err != nil {
			x.rollback(a, added) // all of the frame or none: the engine may reuse its pages on an error
			return err
		}
		e := newEntry(id, blk, a.g)
		e.blk, e.size, e.att = nil, 0, at
		if !x.h.store.addAttached(e) {
			continue // stored already (a PUT of the same block, or this session's): that copy serves
		}
		a.mu.Lock()
		a.blocks[id] = e
		a.mu.Unlock()
		added = append(added, e)
		x.h.enqueue(e, false)
	}
	return nil
}

// rollback unpublishes the blocks a failed publish frame added.
func (x attachHandler) rollback(a *attachment, added []*entry) {
	a.mu.Lock()
	for _, e := range added {
		delete(a.blocks, e.id)
	}
	a.mu.Unlock()
	x.remove(added)
}

// read copies a block out of the pool, in front of its header.
func (a *attachment) read(at *attached) (*container.Block, error) {
	hdr, err := container.NewHeader(container.CodecRaw, 0, a.g.Layers, a.g)
	if err != nil {
		return nil, err
	}
	src, regions, release, err := at.source()
	if err != nil {
		return nil, fmt.Errorf("gathering the engine's pages: %w", err)
	}
	defer release()
	var buf bytes.Buffer
	buf.Write(hdr.Append(nil))
	if _, err := a.h.store.dev.d.WriteRegions(&buf, src, regions); err != nil {
		return nil, fmt.Errorf("reading the engine's pages: %w", err)
	}
	return container.OpenBlock(buf.Bytes(), a.g)
}

// Unpublish stops serving blocks, waiting for the GETs that read them.
func (x attachHandler) Unpublish(s *attach.Session, keys []kvsp.BlockKey) error {
	a := s.Value.(*attachment)
	want := make(map[kvsp.BlockKey]bool, len(keys))
	for _, k := range keys {
		want[k] = true
	}
	var gone []*entry
	a.mu.Lock()
	for id, e := range a.blocks {
		if want[id.key] {
			gone = append(gone, e)
			delete(a.blocks, id)
		}
	}
	a.mu.Unlock()
	x.remove(gone)
	return nil
}

func (x attachHandler) remove(gone []*entry) {
	for _, e := range gone {
		if idle := x.h.store.removeAttached(e); idle != nil {
			<-idle // the last GET reading the page finished
		}
		x.h.enqueue(e, true)
	}
}

// Detach stops serving everything the session published and unmaps its
// pool.
func (x attachHandler) Detach(s *attach.Session) {
	a := s.Value.(*attachment)
	a.mu.Lock()
	var gone []*entry
	for id, e := range a.blocks {
		gone = append(gone, e)
		delete(a.blocks, id)
	}
	a.mu.Unlock()
	x.remove(gone)
	a.buf.Free()
	x.h.log.Info("engine detached", "engine", s.Hello.Engine)
}

// addAttached stores an entry served from an engine's memory (outside the
// tiers' LRUs and capacities: the engine owns that memory); false when the
// block is stored already.
func (s *store) addAttached(e *entry) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m[e.id] != nil {
		return false
	}
	s.m[e.id] = e
	return true
}

// removeAttached removes an attached entry; while GETs still read it, it
// returns a channel closed when the last one finishes.
func (s *store) removeAttached(e *entry) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m[e.id] == e {
		delete(s.m, e.id)
	}
	if e.refs == 0 {
		return nil
	}
	e.idle = make(chan struct{})
	return e.idle
}

// attachedRange is a range of a block in an engine's pages.
type attachedRange struct {
	layerSpan
	d  *tier.Device
	at *attached
}

// WriteTo writes the range's container: its header, then its layers
// straight from the engine's pages through the pinned staging.
func (r attachedRange) WriteTo(w io.Writer) (int64, error) {
	src, regions, release, err := r.at.source()
	if err != nil {
		return 0, err
	}
	defer release()
	n, err := w.Write(r.headerBytes())
	if err != nil {
		return int64(n), err
	}
	m, err := r.d.WriteRegions(w, src, regions[2*r.i:2*r.j])
	return int64(n) + m, err
}

// Digest returns the range's container digest.
func (r attachedRange) Digest() (container.Digest, error) { return digestOf(r) }

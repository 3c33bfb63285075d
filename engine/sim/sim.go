// Package sim is a simulated inference engine: it derives every KV block
// deterministically from its Block Key, a function of the tokens up to the
// block's end (so a block fetched from a holder is byte-identical to one
// recomputed here, and correctness is checkable), charges prefill time at
// its configured tokens/s and decode time per token, and decodes with
// seeded samplers (greedy and top-p) over a synthetic next-token
// distribution of the context: the prompt's block keys and tail, then each
// token output. A session resumed from a checkpoint (block keys, tail,
// tokens generated, sampler step) continues with exactly the tokens an
// uninterrupted run would have produced.
package sim

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine"
)

// Config configures a simulated engine.
type Config struct {
	Descriptor        kvsp.Descriptor
	PrefillTokensPerS float64
	DecodeTokensPerS  float64 // shared by the running batch
	BatchSize         int     // requests running at once; default 8
	KVBlocks          int     // KV capacity in blocks; default 1024
	Vocab             uint32  // default 32000
	// NoPrefixCache: no resident block is reused at prefill (an engine
	// run without prefix caching); every prompt token is computed.
	NoPrefixCache bool
	// AnswerTokens, when set ([min, max]), makes the simulated model end
	// each answer with its end-of-generation token: after a number of
	// output tokens in [min, max] drawn from the prompt (the same prompt
	// always gets the same length, across resumption too), unless
	// max_tokens comes first. Zero: answers run to max_tokens.
	AnswerTokens [2]int
	// ContextTokens, when set, is a session's context window: its prompt
	// and max_tokens together (Check refuses a request beyond it, and the
	// instance's status reports it, so the PC refuses it before placing:
	// RELIABILITY B14). Zero: no window, as before.
	ContextTokens uint64
}

// Engine is a simulated engine.
type Engine struct {
	cfg  Config
	g    container.Geometry
	slot chan struct{}

	// blocks holds each block's layers, K then V of each (nil until
	// written).
	blocks *engine.Blocks[[][]byte]
	freeMu sync.Mutex
	free   [][][]byte // layers of evicted blocks, for the next ones

	mu      sync.Mutex
	running uint64
	queued  uint64
	pins    int // blocks pinned by running requests
	// prefilled and prefillTime: the prompt tokens computed and their
	// simulated time (Stats; the rate reached is the configured one).
	prefilled   uint64
	prefillTime time.Duration
}

// pin keeps key resident for a running request, within half the KV, and
// adds it to the request's pinned.
func (e *Engine) pin(pinned []kvsp.BlockKey, key kvsp.BlockKey) []kvsp.BlockKey {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pins >= e.cfg.KVBlocks/2 || !e.blocks.Pin(key) {
		return pinned
	}
	e.pins++
	return append(pinned, key)
}

// unpin releases a request's pins.
func (e *Engine) unpin(pinned []kvsp.BlockKey) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, k := range pinned {
		e.blocks.Unpin(k)
	}
	e.pins -= len(pinned)
}

// New returns a simulated engine.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Descriptor.Validate(); err != nil {
		return nil, err
	}
	et, ok := container.ParseElemType(string(cfg.Descriptor.KVDType))
	if !ok {
		return nil, fmt.Errorf("sim: kv_dtype %q has no container element type", cfg.Descriptor.KVDType)
	}
	if cfg.PrefillTokensPerS <= 0 || cfg.DecodeTokensPerS <= 0 {
		return nil, errors.New("sim: prefill and decode rates required")
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = 8
	}
	if cfg.KVBlocks == 0 {
		cfg.KVBlocks = 1024
	}
	if cfg.Vocab == 0 {
		cfg.Vocab = 32000
	}
	d := cfg.Descriptor
	g := container.Geometry{Layers: uint32(d.Layers), BlockTokens: uint32(d.BlockTokens), KVHeads: uint32(d.KVHeads), HeadDim: uint32(d.HeadDim), Elem: et}
	e := &Engine{cfg: cfg, g: g, slot: make(chan struct{}, cfg.BatchSize)}
	// An evicted block's layers are the next block's (a KV pool of fixed
	// pages, as an engine's), up to 64 kept free.
	alloc := func(kvsp.BlockKey) ([][]byte, error) {
		e.freeMu.Lock()
		defer e.freeMu.Unlock()
		if n := len(e.free); n > 0 {
			p := e.free[n-1]
			e.free = e.free[:n-1]
			return p, nil
		}
		return make([][]byte, g.Layers), nil
	}
	release := func(p [][]byte) {
		e.freeMu.Lock()
		defer e.freeMu.Unlock()
		if len(e.free) < 64 {
			e.free = append(e.free, p)
		}
	}
	e.blocks = engine.NewBlocks(int(g.Layers), cfg.KVBlocks, alloc, release)
	return e, nil
}

// Descriptor implements engine.Engine.
func (e *Engine) Descriptor() kvsp.Descriptor { return e.cfg.Descriptor }

// Geometry implements engine.Engine.
func (e *Engine) Geometry() container.Geometry { return e.g }

// KV implements engine.Engine.
func (e *Engine) KV() engine.KV { return (*kv)(e) }

// Stats implements engine.Engine.
func (e *Engine) Stats() engine.Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return engine.Stats{Running: e.running, Queued: e.queued, BatchSize: uint64(e.cfg.BatchSize),
		KVUtilization: float64(e.blocks.Resident()) / float64(e.cfg.KVBlocks), KVBlocks: e.cfg.KVBlocks, PrefillTokensPerS: e.cfg.PrefillTokensPerS, DecodeTokensPerS: e.cfg.DecodeTokensPerS,
		Prefilled: e.prefilled, PrefillTime: e.prefillTime}
}

// BlockContent writes the KV of one block's layer, derived from its Block
// Key: K into k and V into v (each RawSectionLen octets). Values are
// finite (the second-highest bit of each element is clear: no exponent of
// all ones). The octets come from a SplitMix64 stream seeded by SHA-256 of
// key, layer and section: distinct per block and layer, and cheap (the
// simulated engine stands for an accelerator: its KV should not cost the
// CPU that kvsp's own work is measured on).
func BlockContent(g container.Geometry, key kvsp.BlockKey, layer uint32, k, v []byte) {
	s := g.Elem.Size()
	var mask uint64 // the second-highest bit of every element's last octet
	for j := s - 1; j < 8; j += s {
		mask |= 0x40 << (8 * j)
	}
	for i, dst := range [][]byte{k, v} {
		var in [len(kvsp.BlockKey{}) + 5]byte
		copy(in[:], key[:])
		binary.LittleEndian.PutUint32(in[len(key):], layer)
		in[len(key)+4] = byte(i)
		seed := sha256.Sum256(in[:])
		x := binary.LittleEndian.Uint64(seed[:])
		j := 0
		for ; j+8 <= len(dst); j += 8 {
			x += 0x9e3779b97f4a7c15
			z := x
			z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
			z = (z ^ z>>27) * 0x94d049bb133111eb
			binary.LittleEndian.PutUint64(dst[j:], (z^z>>31)&^mask)
		}
		for ; j < len(dst); j++ { // a section not a multiple of 8 octets
			x += 0x9e3779b97f4a7c15
			dst[j] = byte(x >> 56)
			if j%s == s-1 {
				dst[j] &^= 0x40
			}
		}
	}
}

// Generate implements engine.Engine.
func (e *Engine) Generate(ctx context.Context, req engine.Request, emit func(engine.Token) error) (kvsp.FinishReason, error) {
	if err := e.generate(ctx, req, emit); err != nil {
		return "", err
	}
	if n := e.answerLen(req); n < req.MaxTokens {
		return kvsp.FinishStop, nil
	}
	return kvsp.FinishLength, nil
}

// answerLen is the number of output tokens before the simulated model's
// end-of-generation token (AnswerTokens): a function of the prompt alone.
func (e *Engine) answerLen(req engine.Request) int {
	lo, hi := e.cfg.AnswerTokens[0], e.cfg.AnswerTokens[1]
	if hi <= 0 || hi < lo {
		return req.MaxTokens
	}
	h := sha256.New()
	for _, key := range req.Keys {
		h.Write(key[:])
	}
	h.Write(u32s(req.PromptTail(int(e.g.BlockTokens))))
	sum := h.Sum(nil)
	return lo + int(binary.BigEndian.Uint64(sum)%uint64(hi-lo+1))
}

func (e *Engine) generate(ctx context.Context, req engine.Request, emit func(engine.Token) error) error {
	bt := int(e.g.BlockTokens)
	if req.Tokens != nil && len(req.Keys) != len(req.Tokens)/bt {
		return fmt.Errorf("sim: %d block keys for %d complete blocks", len(req.Keys), len(req.Tokens)/bt)
	}
	e.mu.Lock()
	e.queued++
	e.mu.Unlock()
	select {
	case e.slot <- struct{}{}:
	case <-ctx.Done():
		e.mu.Lock()
		e.queued--
		e.mu.Unlock()
		return ctx.Err()
	}
	e.mu.Lock()
	e.queued--
	e.running++
	e.mu.Unlock()
	defer func() {
		<-e.slot
		e.mu.Lock()
		e.running--
		e.mu.Unlock()
	}()

	// Prefill: the leading resident blocks are reused; everything after
	// the first missing one is computed (which needs the prompt). A
	// running request's blocks stay resident until it ends, as a real
	// engine's do (they are its attention context), up to half the KV for
	// all running requests together, so that new blocks always have room.
	var pinned []kvsp.BlockKey
	defer func() { e.unpin(pinned) }()
	cached := 0
	for !e.cfg.NoPrefixCache && cached < len(req.Keys) && e.KV().Has(req.Keys[cached]) {
		pinned = e.pin(pinned, req.Keys[cached])
		cached++
	}
	if cached < len(req.Keys) && req.Tokens == nil {
		return fmt.Errorf("%w: block %d of a resumed prompt (its tokens are not known)", engine.ErrNotResident, cached)
	}
	// The rest is computed block by block, in order, as a chunked
	// prefill is: a block that became resident before the prefill reached
	// it (a prefetch that landed after the request started) is used, not
	// computed.
	k, v := make([]byte, e.g.RawSectionLen()), make([]byte, e.g.RawSectionLen())
	p := pacer{start: time.Now()}
	defer p.flush(ctx)
	rate := e.cfg.PrefillTokensPerS
	recompute, took := 0, time.Duration(0)
	var joined []int
	for i := cached; i < len(req.Keys); i++ {
		if !e.cfg.NoPrefixCache && e.KV().Has(req.Keys[i]) {
			pinned = e.pin(pinned, req.Keys[i])
			joined = append(joined, i)
			continue
		}
		d := time.Duration(float64(bt) / rate * float64(time.Second))
		if err := p.charge(ctx, d); err != nil {
			return err
		}
		recompute, took = recompute+bt, took+d
		for l := uint32(0); l < e.g.Layers; l++ {
			BlockContent(e.g, req.Keys[i], l, k, v)
			if err := e.KV().WriteLayer(req.Keys[i], l, k, v); err != nil {
				return err
			}
		}
		pinned = e.pin(pinned, req.Keys[i])
	}
	tail := req.PromptTail(bt)
	rest := len(tail) + len(req.Generated)
	d := time.Duration(float64(rest) / rate * float64(time.Second))
	if err := p.charge(ctx, d); err != nil {
		return err
	}
	recompute, took = recompute+rest, took+d
	e.mu.Lock()
	e.prefilled += uint64(recompute)
	e.prefillTime += took
	e.mu.Unlock()
	if req.OnPrefill != nil {
		req.OnPrefill(engine.PrefillStats{CachedTokens: (cached + len(joined)) * bt, ComputedTokens: recompute, Joined: joined})
	}

	// Decode, from the context: block keys, tail, tokens so far.
	h := sha256.New()
	for _, key := range req.Keys {
		h.Write(key[:])
	}
	h.Write(u32s(tail))
	var state [32]byte
	h.Sum(state[:0])
	for _, id := range req.Generated {
		state = sha256.Sum256(append(state[:], u32s([]uint32{id})...))
	}
	for i, end := len(req.Generated), min(req.MaxTokens, e.answerLen(req)); i < end; i++ {
		id := e.sample(state, i, req.Sampler)
		if req.Chain != nil && req.Chain.Push(id) { // a block of generated tokens
			key, _ := req.Chain.Last()
			for l := uint32(0); l < e.g.Layers; l++ {
				BlockContent(e.g, key, l, k, v)
				if err := e.KV().WriteLayer(key, l, k, v); err != nil {
					return err
				}
			}
			if req.OnBlock != nil {
				req.OnBlock(key)
			}
		}
		if err := emit(engine.Token{Index: i, ID: id}); err != nil {
			return err
		}
		state = sha256.Sum256(append(state[:], u32s([]uint32{id})...))
		e.mu.Lock()
		share := float64(max(1, e.running))
		e.mu.Unlock()
		if err := p.charge(ctx, time.Duration(share/e.cfg.DecodeTokensPerS*float64(time.Second))); err != nil {
			return err
		}
	}
	return nil
}

// candidates is the number of tokens of the synthetic distribution.
const candidates = 64

// sample picks output token i from the distribution of the context state:
// greedy takes the most likely; top-p draws from the smallest set of
// candidates whose probability reaches p, with a generator seeded by the
// sampler seed and i (deterministic).
func (e *Engine) sample(state [32]byte, i int, s engine.Sampler) uint32 {
	type cand struct {
		id    uint32
		logit float64
	}
	var cs [candidates]cand
	r := rand.New(rand.NewChaCha8(state))
	for j := range cs {
		cs[j] = cand{id: r.Uint32N(e.cfg.Vocab), logit: 4 * r.Float64()}
	}
	sort.Slice(cs[:], func(a, b int) bool { return cs[a].logit > cs[b].logit })
	if s.Method != engine.TopP {
		return cs[0].id
	}
	var z float64
	for _, c := range cs {
		z += math.Exp(c.logit)
	}
	n, cum := 0, 0.0
	for n < len(cs) && cum < s.P {
		cum += math.Exp(cs[n].logit) / z
		n++
	}
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[:], s.Seed)
	binary.LittleEndian.PutUint64(seed[8:], uint64(i))
	copy(seed[16:], state[:16])
	u := rand.New(rand.NewChaCha8(seed)).Float64() * cum
	for j := 0; j < n; j++ {
		if u -= math.Exp(cs[j].logit) / z; u < 0 {
			return cs[j].id
		}
	}
	return cs[n-1].id
}

func u32s(ts []uint32) []byte {
	b := make([]byte, 4*len(ts))
	for i, t := range ts {
		binary.LittleEndian.PutUint32(b[4*i:], t)
	}
	return b
}

// pacer charges simulated time against the wall clock: it sleeps only
// once the time owed exceeds a millisecond (timers are coarser than a
// token's 200 us on some kernels), so the average rates are the
// configured ones.
type pacer struct {
	start   time.Time
	charged time.Duration
}

func (p *pacer) charge(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil { // behind schedule, it never sleeps
		return err
	}
	p.charged += d
	if ahead := time.Until(p.start.Add(p.charged)); ahead >= time.Millisecond {
		return sleep(ctx, ahead)
	}
	return nil
}

// flush sleeps what is still owed.
func (p *pacer) flush(ctx context.Context) { sleep(ctx, time.Until(p.start.Add(p.charged))) }

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// kv is the engine's KV memory: blocks by key, least recently used
// resident block evicted when full.
type kv Engine

func (m *kv) Has(key kvsp.BlockKey) bool { return m.blocks.Has(key) }

func (m *kv) WriteLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error {
	sec := int(m.g.RawSectionLen())
	if layer >= m.g.Layers || len(k) != sec || len(v) != sec {
		return fmt.Errorf("sim: layer %d with sections of %d and %d octets (want layer < %d, %d octets)", layer, len(k), len(v), m.g.Layers, sec)
	}
	return m.blocks.Write(key, layer, func(layers [][]byte) error {
		layers[layer] = append(append(layers[layer][:0], k...), v...)
		return nil
	})
}

func (m *kv) ReadLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error {
	return m.blocks.Read(key, layer, func(layers [][]byte) error {
		sec := len(layers[layer]) / 2
		copy(k, layers[layer][:sec])
		copy(v, layers[layer][sec:])
		return nil
	})
}

func (m *kv) Drop(key kvsp.BlockKey) { m.blocks.Drop(key) }

func (m *kv) Pin(key kvsp.BlockKey) bool { return m.blocks.Pin(key) }

func (m *kv) Unpin(key kvsp.BlockKey) bool { return m.blocks.Unpin(key) }

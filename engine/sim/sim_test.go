package sim

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
)

var desc = kvsp.Descriptor{Model: "sim/tiny", ModelDigest: kvsp.Digest{1}, TokenizerDigest: kvsp.Digest{2}, Layers: 4, KVHeads: 2, HeadDim: 16,
	KVDType: "bf16", Positional: "rope", BlockTokens: 16, Layout: "kvsp-layout-1"}

func newEngine(t *testing.T, batch, blocks int) *Engine {
	t.Helper()
	e, err := New(Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 1000, BatchSize: batch, KVBlocks: blocks})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func request(n int, sampler engine.Sampler) engine.Request {
	toks := make([]uint32, n)
	for i := range toks {
		toks[i] = uint32(7*i + 3)
	}
	keys := make([]kvsp.BlockKey, n/16)
	for i := range keys {
		keys[i] = kvsp.BlockKey{byte(i), 0xee}
	}
	return engine.Request{Tokens: toks, Keys: keys, MaxTokens: 12, Sampler: sampler}
}

func run(t *testing.T, e *Engine, req engine.Request) []uint32 {
	t.Helper()
	var out []uint32
	_, err := e.Generate(context.Background(), req, func(tok engine.Token) error {
		if tok.Index != len(out) {
			t.Fatalf("token %d out of order", tok.Index)
		}
		out = append(out, tok.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestFetchedEqualsRecomputed: the KV the engine computes for a block is
// BlockContent of its prefix; blocks copied into another engine's KV (as a
// fetch would) are used there, cut its prefill time by exactly their
// tokens, and give the same output (greedy and seeded top-p).
func TestFetchedEqualsRecomputed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for _, s := range []engine.Sampler{{Method: engine.Greedy}, {Method: engine.TopP, P: 0.9, Seed: 7}} {
			a, b := newEngine(t, 4, 64), newEngine(t, 4, 64)
			req := request(10*16+5, s)
			t0 := time.Now()
			outA := run(t, a, req)
			full := time.Since(t0)
			g := a.Geometry()
			k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
			wk, wv := make([]byte, len(k)), make([]byte, len(v))
			for i, key := range req.Keys {
				for l := uint32(0); l < g.Layers; l++ {
					if err := a.KV().ReadLayer(key, l, k, v); err != nil {
						t.Fatal(err)
					}
					BlockContent(g, key, l, wk, wv)
					if !bytes.Equal(k, wk) || !bytes.Equal(v, wv) {
						t.Fatalf("block %d layer %d differs from its derivation", i, l)
					}
					if i < 6 { // "fetch" the first six blocks into b
						b.KV().WriteLayer(req.Keys[i], l, k, v)
					}
				}
			}
			t0 = time.Now()
			outB := run(t, b, req)
			saved := full - time.Since(t0)
			want := time.Duration(6*16*int64(time.Second)) / 42000
			if d := saved - want; d < -time.Microsecond || d > time.Microsecond {
				t.Fatalf("%s: six cached blocks saved %v, want %v", s.Method, saved, want)
			}
			if !equal(outA, outB) {
				t.Fatalf("%s: outputs differ: %v vs %v", s.Method, outA, outB)
			}
		}
	})
}

// TestResume: R-SES-12..14 on the engine side: a session resumed on
// another engine from a checkpoint (its prompt's block keys, resident
// there, its tail, the tokens generated so far) continues at that index
// with exactly the tokens of an uninterrupted run, for greedy and seeded
// top-p; without the prompt's blocks it cannot (their tokens are unknown).
func TestResume(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for _, s := range []engine.Sampler{{Method: engine.Greedy}, {Method: engine.TopP, P: 0.9, Seed: 11}} {
			a, b := newEngine(t, 4, 64), newEngine(t, 4, 64)
			req := request(3*16+7, s)
			req.MaxTokens = 20
			full := run(t, a, req)
			g := a.Geometry()
			k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
			for _, key := range req.Keys {
				for l := uint32(0); l < g.Layers; l++ {
					a.KV().ReadLayer(key, l, k, v)
					b.KV().WriteLayer(key, l, k, v)
				}
			}
			res := engine.Request{Tail: req.Tokens[3*16:], Keys: req.Keys, Generated: full[:8], MaxTokens: 20, Sampler: s}
			var got []uint32
			_, err := b.Generate(context.Background(), res, func(tok engine.Token) error {
				if tok.Index != 8+len(got) {
					t.Fatalf("resumed index %d", tok.Index)
				}
				got = append(got, tok.ID)
				return nil
			})
			if err != nil || !equal(got, full[8:]) {
				t.Fatalf("%s: resumed %v, uninterrupted %v (%v)", s.Method, got, full[8:], err)
			}
			c := newEngine(t, 4, 64)
			if _, err := c.Generate(context.Background(), res, func(engine.Token) error { return nil }); !errors.Is(err, engine.ErrNotResident) {
				t.Fatalf("resume without the prompt's blocks: %v", err)
			}
		}
	})
}

func equal(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestSamplers: greedy ignores the seed; top-p with another seed gives
// another output; a wider p draws from more candidates.
func TestSamplers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e := newEngine(t, 4, 64)
		g1 := run(t, e, request(40, engine.Sampler{Method: engine.Greedy, Seed: 1}))
		g2 := run(t, e, request(40, engine.Sampler{Method: engine.Greedy, Seed: 2}))
		p1 := run(t, e, request(40, engine.Sampler{Method: engine.TopP, P: 0.95, Seed: 1}))
		p2 := run(t, e, request(40, engine.Sampler{Method: engine.TopP, P: 0.95, Seed: 2}))
		if !equal(g1, g2) || equal(p1, p2) || equal(g1, p1) {
			t.Fatalf("greedy %v %v, top-p %v %v", g1, g2, p1, p2)
		}
	})
}

// TestBatchAndStats: beyond the batch size requests queue, which Stats
// reports; the KV memory evicts its least recently used block when full.
func TestBatchAndStats(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e := newEngine(t, 1, 2)
		done := make(chan struct{})
		for range 2 {
			go func() {
				e.Generate(context.Background(), request(16, engine.Sampler{Method: engine.Greedy}), func(engine.Token) error { return nil })
				done <- struct{}{}
			}()
		}
		synctest.Wait()
		if st := e.Stats(); st.Running != 1 || st.Queued != 1 || st.BatchSize != 1 || st.PrefillTokensPerS != 42000 {
			t.Fatalf("stats %+v", st)
		}
		<-done
		<-done
		if st := e.Stats(); st.Running != 0 || st.Queued != 0 {
			t.Fatalf("stats after %+v", st)
		}
		k := make([]byte, e.Geometry().RawSectionLen())
		write := func(key byte) {
			for l := uint32(0); l < 4; l++ {
				if err := e.KV().WriteLayer(kvsp.BlockKey{key}, l, k, k); err != nil {
					t.Fatal(err)
				}
			}
		}
		write(1)
		write(2)
		e.KV().Has(kvsp.BlockKey{1}) // 1 used: 2 is the LRU
		write(3)
		if !e.KV().Has(kvsp.BlockKey{1}) || e.KV().Has(kvsp.BlockKey{2}) || !e.KV().Has(kvsp.BlockKey{3}) {
			t.Fatal("LRU eviction")
		}
		if err := e.KV().ReadLayer(kvsp.BlockKey{2}, 0, k, k); !errors.Is(err, engine.ErrNotResident) {
			t.Fatalf("evicted block read: %v", err)
		}
	})
}

// TestPinnedBlocksStay: a pinned block is never evicted (a retained shard
// keeps its memory, R-RSH-5); when every block is pinned the KV is full;
// once unpinned it is evictable again.
func TestPinnedBlocksStay(t *testing.T) {
	e := newEngine(t, 1, 2)
	kv := e.KV()
	k := make([]byte, e.Geometry().RawSectionLen())
	write := func(key byte) error {
		for l := uint32(0); l < 4; l++ {
			if err := kv.WriteLayer(kvsp.BlockKey{key}, l, k, k); err != nil {
				return err
			}
		}
		return nil
	}
	if kv.Pin(kvsp.BlockKey{1}) {
		t.Fatal("pinned a block that is not resident")
	}
	write(1)
	write(2)
	for range 2 { // pinned twice: two unpins free it
		if !kv.Pin(kvsp.BlockKey{1}) {
			t.Fatal("pin of a resident block refused")
		}
	}
	kv.Has(kvsp.BlockKey{2}) // 1 is the LRU, but pinned
	if err := write(3); err != nil {
		t.Fatal(err)
	}
	if !kv.Has(kvsp.BlockKey{1}) || kv.Has(kvsp.BlockKey{2}) {
		t.Fatal("the pinned block was evicted, or the unpinned one kept")
	}
	kv.Pin(kvsp.BlockKey{3})
	if err := write(4); !errors.Is(err, engine.ErrKVFull) {
		t.Fatalf("all pinned: %v, want ErrKVFull", err)
	}
	if !kv.Unpin(kvsp.BlockKey{1}) || kv.Unpin(kvsp.BlockKey{1}) {
		t.Fatal("Unpin must say whether the block is still pinned")
	}
	if err := write(4); err != nil || kv.Has(kvsp.BlockKey{1}) {
		t.Fatalf("unpinned block not evictable: %v", err)
	}
}

// TestRunningRequestKeepsItsBlocks: a running request's prompt blocks stay
// resident until it ends, however many blocks others write meanwhile (an
// engine's running sequences keep their KV), up to half the KV for all
// running requests; once it ends they are evictable again. Before, they
// were evicted under load before the agent copied them for its holder.
func TestRunningRequestKeepsItsBlocks(t *testing.T) {
	e := newEngine(t, 2, 16)
	req := request(4*16+3, engine.Sampler{Method: engine.Greedy}) // 4 blocks
	req.MaxTokens = 1 << 20
	ctx, cancel := context.WithCancel(context.Background())
	prefilled := make(chan struct{})
	req.OnPrefill = func(engine.PrefillStats) { close(prefilled) }
	done := make(chan error, 1)
	go func() { _, err := e.Generate(ctx, req, func(engine.Token) error { return nil }); done <- err }()
	<-prefilled
	kv := e.KV()
	k := make([]byte, e.Geometry().RawSectionLen())
	for i := range 40 { // two and a half times the KV
		for l := uint32(0); l < 4; l++ {
			if err := kv.WriteLayer(kvsp.BlockKey{0x77, byte(i)}, l, k, k); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i, key := range req.Keys {
		if !kv.Has(key) {
			t.Fatalf("block %d of the running request evicted", i)
		}
	}
	// The half-KV bound: a second request's twelve blocks pin only four
	// more; the rest are written, not pinned.
	req2 := request(12*16, engine.Sampler{Method: engine.Greedy})
	for i := range req2.Keys {
		req2.Keys[i] = kvsp.BlockKey{byte(i), 0xdd}
	}
	req2.MaxTokens = 1 << 20
	prefilled2 := make(chan struct{})
	req2.OnPrefill = func(engine.PrefillStats) { close(prefilled2) }
	go func() { e.Generate(ctx, req2, func(engine.Token) error { return nil }) }()
	<-prefilled2
	e.mu.Lock()
	pins := e.pins
	e.mu.Unlock()
	if pins != 8 {
		t.Fatalf("%d blocks pinned by two running requests, want 8 (half of 16)", pins)
	}
	cancel()
	<-done
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		e.mu.Lock()
		pins = e.pins
		e.mu.Unlock()
		if pins == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d blocks still pinned after both requests ended", pins)
		}
	}
	for i := range 16 {
		for l := uint32(0); l < 4; l++ {
			if err := kv.WriteLayer(kvsp.BlockKey{0x78, byte(i)}, l, k, k); err != nil {
				t.Fatal(err)
			}
		}
	}
	if kv.Has(req.Keys[0]) {
		t.Fatal("a block of an ended request still resident after the KV turned over")
	}
}

// TestNoPrefixCache: an engine without its prefix cache (kvsp demo's
// no-cache mode) computes every prompt token, even of blocks it holds,
// and still produces the same tokens.
func TestNoPrefixCache(t *testing.T) {
	e, err := New(Config{Descriptor: desc, PrefillTokensPerS: 1e9, DecodeTokensPerS: 1e9, NoPrefixCache: true})
	if err != nil {
		t.Fatal(err)
	}
	cached := newEngine(t, 1, 64)
	for _, eng := range []*Engine{e, cached} {
		run(t, eng, request(4*16+3, engine.Sampler{Method: engine.Greedy}))
	}
	var got, want engine.PrefillStats
	req := request(4*16+3, engine.Sampler{Method: engine.Greedy})
	req.OnPrefill = func(s engine.PrefillStats) { got = s }
	out := run(t, e, req)
	req.OnPrefill = func(s engine.PrefillStats) { want = s }
	ref := run(t, cached, req)
	if got.CachedTokens != 0 || got.ComputedTokens != 4*16+3 || want.CachedTokens != 64 || !equal(out, ref) {
		t.Fatalf("without the prefix cache %+v, with %+v; tokens equal %v", got, want, equal(out, ref))
	}
}

// TestLateBlocksJoinThePrefill (issue 47: a prefetch that lands after the
// engine started on the prompt still serves the blocks not yet computed):
// blocks 0 and 1 are resident at the start; block 6 lands while the
// prefill computes block 2, and block 9 after the prefill passed it. Block
// 6 is used when the prefill reaches it (its time saved, reported Joined),
// block 9 is not; the output is the same as with nothing cached.
func TestLateBlocksJoinThePrefill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a, b := newEngine(t, 4, 64), newEngine(t, 4, 64)
		req := request(10*16+5, engine.Sampler{Method: engine.Greedy})
		outA := run(t, a, req)
		g := a.Geometry()
		block := func(i int) func() {
			return func() {
				k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
				for l := uint32(0); l < g.Layers; l++ {
					BlockContent(g, req.Keys[i], l, k, v)
					if err := b.KV().WriteLayer(req.Keys[i], l, k, v); err != nil {
						t.Error(err)
					}
				}
			}
		}
		block(0)()
		block(1)()
		perBlock := time.Duration(16*int64(time.Second)) / 42000 // 381 µs
		time.AfterFunc(perBlock/2, block(6))                     // before the prefill reaches it
		time.AfterFunc(9*perBlock, block(9))                     // after the prefill computed it (blocks 2..5, 7..9: 7 blocks)
		var st engine.PrefillStats
		req.OnPrefill = func(s engine.PrefillStats) { st = s }
		outB := run(t, b, req)
		if st.CachedTokens != 3*16 || st.ComputedTokens != 7*16+5 || len(st.Joined) != 1 || st.Joined[0] != 6 {
			t.Fatalf("prefill %+v: want blocks 0, 1 and 6 cached (6 joined), 7 blocks and the tail computed", st)
		}
		if !equal(outA, outB) {
			t.Fatalf("outputs differ: %v vs %v", outA, outB)
		}
	})
}

// TestAnswerTokensEndAtEndOfGeneration (A-39 on the simulated model): with
// AnswerTokens the answer ends after a length drawn from the prompt, in
// the range; Generate says "stop". A session resumed part-way (its
// generated tokens given) ends at the same length with the same tokens;
// max_tokens below that length ends it first, "length".
func TestAnswerTokensEndAtEndOfGeneration(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, err := New(Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 1000, AnswerTokens: [2]int{5, 9}})
		if err != nil {
			t.Fatal(err)
		}
		lengths := map[int]bool{}
		for k := range 12 {
			req := request(40+k, engine.Sampler{Method: engine.Greedy})
			req.MaxTokens = 100
			var out []uint32
			finish, err := e.Generate(context.Background(), req, func(tok engine.Token) error { out = append(out, tok.ID); return nil })
			if err != nil || finish != kvsp.FinishStop || len(out) < 5 || len(out) > 9 {
				t.Fatalf("prompt %d: %d tokens, finish %q, %v", k, len(out), finish, err)
			}
			lengths[len(out)] = true
			res := req
			res.Generated = out[:3]
			var rest []uint32
			if finish, err := e.Generate(context.Background(), res, func(tok engine.Token) error { rest = append(rest, tok.ID); return nil }); err != nil ||
				finish != kvsp.FinishStop || !equal(append(out[:3:3], rest...), out) {
				t.Fatalf("prompt %d resumed at 3: %v then %v, want %v (%q, %v)", k, out[:3], rest, out, finish, err)
			}
			short := req
			short.MaxTokens = 4
			if finish, err := e.Generate(context.Background(), short, func(engine.Token) error { return nil }); err != nil || finish != kvsp.FinishLength {
				t.Fatalf("max_tokens 4: finish %q, %v", finish, err)
			}
		}
		if len(lengths) < 2 {
			t.Fatalf("every prompt's answer has the same length: %v", lengths)
		}
		plain := newEngine(t, 8, 64)
		req := request(40, engine.Sampler{Method: engine.Greedy})
		if finish, err := plain.Generate(context.Background(), req, func(engine.Token) error { return nil }); err != nil || finish != kvsp.FinishLength {
			t.Fatalf("without AnswerTokens: finish %q, %v", finish, err)
		}
	})
}

// TestContextWindow: with context_tokens, the simulated engine reports
// its window in Limits (the instance's status carries it, so the PC
// refuses a request beyond it before placing: RELIABILITY B14) and Check
// refuses a prompt past it, or max_tokens past what the prompt leaves,
// naming the member; a prompt sent as block keys and tail counts its
// blocks' tokens. Without a window nothing is bounded, as before (make
// api-fuzz found a placed generate of 2^20 tokens on a window-less sim).
func TestContextWindow(t *testing.T) {
	e, err := New(Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 1000, ContextTokens: 64})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := e.Limits(), (engine.Limits{ContextTokens: 64, MaxOutputTokens: 63}); got != want {
		t.Fatalf("limits %+v, want %+v", got, want)
	}
	tokens := func(n, max int) *engine.Request {
		r := request(n, engine.Sampler{Method: engine.Greedy})
		r.MaxTokens = max
		return &r
	}
	keyed := func(blocks, tail, max int) *engine.Request {
		return &engine.Request{Keys: make([]kvsp.BlockKey, blocks), Tail: make([]uint32, tail), MaxTokens: max}
	}
	for _, tc := range []struct {
		name   string
		req    *engine.Request
		member string // "" accepted
	}{
		{"within", tokens(40, 24), ""},
		{"prompt past the window", tokens(65, 1), "tokens"},
		{"max_tokens past what the prompt leaves", tokens(40, 25), "max_tokens"},
		{"keys and tail within", keyed(3, 4, 12), ""},
		{"keys and tail past the window", keyed(4, 1, 1), "tokens"},
		{"keys and tail leave too little", keyed(3, 4, 13), "max_tokens"},
	} {
		err := e.Check(tc.req)
		switch {
		case tc.member == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.member != "" && (!errors.Is(err, kvsp.ErrInvalid) || !strings.HasPrefix(problemDetail(err), tc.member+":")):
			t.Errorf("%s: %v; want invalid naming %s", tc.name, err, tc.member)
		}
	}
	open := newEngine(t, 4, 64)
	if got := open.Limits(); got != (engine.Limits{}) {
		t.Fatalf("no window: limits %+v", got)
	}
	if err := open.Check(tokens(1<<20, 1<<20)); err != nil {
		t.Fatalf("no window: %v", err)
	}
}

func problemDetail(err error) string {
	var p *kvsp.Problem
	if errors.As(err, &p) {
		return p.Detail
	}
	return ""
}

package llamacpp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hybridgroup/yzma/pkg/llama"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// tokensOf returns n token ids of the vocabulary, a function of seed.
func tokensOf(seed, n, vocab int) []uint32 {
	out := make([]uint32, n)
	x := uint32(seed*2654435761 + 1)
	for i := range out {
		x = x*1664525 + 1013904223
		out[i] = (x >> 8) % uint32(vocab)
	}
	return out
}

// holderOf starts a real holder on loopback TLS for the engine's model.
func holderOf(t testing.TB, e *Engine) *client.Holder {
	t.Helper()
	compat, _ := e.Descriptor().CompatID()
	h, err := holder.New(holder.Config{Base: "https://127.0.0.1/h1/", Geometries: map[kvsp.CompatID]container.Geometry{compat: e.Geometry()},
		Capacity: 256 << 20, RecordTTL: time.Minute, LeaseQuota: holder.LeaseQuota{Octets: 64 << 20, MaxTTL: time.Minute, MaxLeases: 16}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close(context.Background()) })
	p := kvsptest.NewPKI(t)
	srv := kvsptest.StartServer(t, p, kvsptest.Options{}, func(s *server.Server) {
		if err := h.Mount(s.Mount("/h1/")); err != nil {
			t.Fatal(err)
		}
	})
	c, err := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(kvsptest.ClientA)), Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c.Holder(srv.URL("/h1/"))
}

// blockOf encodes a resident block of e's KV as a KVB1 container.
func blockOf(t testing.TB, e *Engine, key kvsp.BlockKey) ([]byte, container.Digest) {
	t.Helper()
	g := e.Geometry()
	h, _ := container.NewHeader(container.CodecRaw, 0, g.Layers, g)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
	for l := uint32(0); l < g.Layers; l++ {
		if err := e.KV().ReadLayer(key, l, k, v); err != nil {
			t.Fatalf("block %s layer %d: %v", key, l, err)
		}
		if err := w.WriteLayer(k, v); err != nil {
			t.Fatal(err)
		}
	}
	d, err := w.Close()
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), d.Container
}

// moveBlocks sends the blocks from a's KV through a holder into b's:
// KVB1 PUT, verified GET, layers written into b. It checks every section
// arrives octet for octet.
func moveBlocks(t *testing.T, a, b *Engine, hold *client.Holder, keys []kvsp.BlockKey) {
	t.Helper()
	ctx := context.Background()
	compat, _ := a.Descriptor().CompatID()
	g := a.Geometry()
	for _, key := range keys {
		data, digest := blockOf(t, a, key)
		ref := client.BlockRef{Compat: compat, Scope: testScope.ID(), Key: key}
		if err := hold.PutBlock(ctx, ref, bytes.NewReader(data), int64(len(data)), digest); err != nil {
			t.Fatalf("PUT %s: %v", key, err)
		}
		s, err := hold.GetBlock(ctx, ref, g, client.GetOptions{})
		if err != nil {
			t.Fatalf("GET %s: %v", key, err)
		}
		k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
		for {
			l, err := s.Next()
			if err != nil {
				if err.Error() != "EOF" {
					t.Fatalf("GET %s: %v", key, err)
				}
				break
			}
			a.KV().ReadLayer(key, l.Index, k, v)
			if !bytes.Equal(l.K, k) || !bytes.Equal(l.V, v) {
				t.Fatalf("block %s layer %d: the sections differ after the holder", key, l.Index)
			}
			if err := b.KV().WriteLayer(key, l.Index, l.K, l.V); err != nil {
				t.Fatal(err)
			}
		}
		s.Close()
		if !b.KV().Has(key) {
			t.Fatalf("block %s not resident at the consumer", key)
		}
	}
}

// moveBlock copies a resident block from a's KV into b's, layer by layer.
func moveBlock(t *testing.T, a, b *Engine, key kvsp.BlockKey) {
	t.Helper()
	g := a.Geometry()
	k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
	for l := uint32(0); l < g.Layers; l++ {
		if err := a.KV().ReadLayer(key, l, k, v); err != nil {
			t.Fatal(err)
		}
		if err := b.KV().WriteLayer(key, l, k, v); err != nil {
			t.Fatal(err)
		}
	}
}

// TestExactRoundTrip (issue 20, test 2): sequence state → blocks → KVB1 →
// holder → KVB1 → blocks → state: the K and V sections arrive octet for
// octet, and a fresh engine of the same configuration that injects them
// and decodes the next token alone has the same logits, bit for bit, as
// the producer decoding it from its own state. Both V layouts.
func TestExactRoundTrip(t *testing.T) {
	for _, m := range testModels(t) {
		for _, fa := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/flash_attention=%v", m.name, fa), func(t *testing.T) { exactRoundTrip(t, m.path, fa) })
		}
	}
}

// testModels are the models the exactness tests hold on: the generated
// tiny one (path "": newEngine's default), and the real SmolLM2 (Q4_1
// weights, 9 query heads on 3 KV heads, RoPE base 100000, an f16 cache).
func testModels(t *testing.T) []struct{ name, path string } {
	return []struct{ name, path string }{{"tiny", ""}, {"smollm2", kvsptest.SmolLM2(t)}}
}

func exactRoundTrip(t *testing.T, model string, fa bool) {
	cfg := Config{Model: model, FlashAttention: fa, BatchSize: 1}
	a, b := newEngine(t, cfg), newEngine(t, cfg)
	bt := int(a.Geometry().BlockTokens)
	prompt := tokensOf(1, 4*bt, a.Vocab())
	var want []float32
	a.onLogits = func(step int, l []float32) {
		if step == 1 { // decoded alone, after the prompt and y0
			want = slices.Clone(l)
		}
	}
	req := request(t, a, prompt, 2)
	out := collect(t, a, req)
	moveBlocks(t, a, b, holderOf(t, a), req.Keys)
	var got []float32
	b.onLogits = func(step int, l []float32) { got = slices.Clone(l) }
	before := b.Evaluated()
	next := request(t, b, append(slices.Clone(prompt), out[0]), 1)
	collect(t, b, next)
	if n := b.Evaluated() - before; n != 1 {
		t.Fatalf("the consumer evaluated %d tokens, want 1 (the rest injected)", n)
	}
	if len(got) != len(want) || len(got) == 0 {
		t.Fatalf("logits: %d and %d", len(got), len(want))
	}
	for i := range got {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("logit %d: %v after injection, %v at the producer", i, got[i], want[i])
		}
	}
}

// TestStateConversionExact: the blocks read back from llama.cpp's state
// and written into it again give llama.cpp's state octet for octet (the
// conversion loses nothing, in both V layouts).
func TestStateConversionExact(t *testing.T) {
	for _, m := range testModels(t) {
		for _, fa := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/flash_attention=%v", m.name, fa), func(t *testing.T) { stateConversionExact(t, m.path, fa) })
		}
	}
}

func stateConversionExact(t *testing.T, model string, fa bool) {
	e := newEngine(t, Config{Model: model, FlashAttention: fa, BatchSize: 1})
	bt := int(e.Geometry().BlockTokens)
	req := request(t, e, tokensOf(2, 3*bt, e.Vocab()), 1)
	collect(t, e, req)
	// The engine's own state of the same blocks, injected and read again.
	w := newStateWriter(&e.lay, 0, 3*bt, bt, nil)
	sec := e.sec
	for i, key := range req.Keys {
		for l := 0; l < int(e.Geometry().Layers); l++ {
			e.blocks.Read(key, uint32(l), func(p []byte) error {
				w.put(i, l, p[2*sec*l:2*sec*l+sec], p[2*sec*l+sec:2*sec*(l+1)])
				return nil
			})
		}
	}
	st, _, err := parseState(w.b, &e.lay)
	if err != nil {
		t.Fatal(err)
	}
	for i, key := range req.Keys {
		idx, err := st.cellsByPos(i*bt, bt)
		if err != nil {
			t.Fatal(err)
		}
		k, v := make([]byte, sec), make([]byte, sec)
		k2, v2 := make([]byte, sec), make([]byte, sec)
		for l := 0; l < int(e.Geometry().Layers); l++ {
			e.lay.kSection(k, st, l, idx)
			e.lay.vSection(v, st, l, idx)
			e.KV().ReadLayer(key, uint32(l), k2, v2)
			if !bytes.Equal(k, k2) || !bytes.Equal(v, v2) {
				t.Fatalf("block %d layer %d: blocks → state → blocks differs", i, l)
			}
		}
	}
}

// TestContinuousBatching (issue 20): up to batch_size sessions decode
// together, one token each per llama_decode, and the others wait in the
// queue, as the status record's running and queued say; a session's
// prefill goes in chunks between decode steps.
func TestContinuousBatching(t *testing.T) {
	e := newEngine(t, Config{BatchSize: 3, PrefillChunk: 32})
	const sessions, out = 6, 40
	var mu sync.Mutex
	var maxRunning, maxQueued uint64
	var maxKV float64
	var wg sync.WaitGroup
	before := e.Decodes()
	errs := make(chan error, sessions)
	for i := 0; i < sessions; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := request(t, e, tokensOf(50+i, 70, e.Vocab()), out)
			n := 0
			_, err := e.Generate(context.Background(), req, func(engine.Token) error {
				st := e.Stats()
				mu.Lock()
				maxRunning, maxQueued = max(maxRunning, st.Running), max(maxQueued, st.Queued)
				maxKV = max(maxKV, st.KVUtilization)
				mu.Unlock()
				n++
				return nil
			})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	steps := e.Decodes() - before
	// Alone, each session would take 3 prefill chunks and out-1 decodes.
	alone := int64(sessions * (3 + out - 1))
	t.Logf("%d sessions of %d tokens: %d llama_decode calls (%d one at a time); running up to %d, queued up to %d", sessions, out, steps, alone, maxRunning, maxQueued)
	if maxRunning != 3 || maxQueued == 0 {
		t.Fatalf("running up to %d (batch_size 3), queued up to %d", maxRunning, maxQueued)
	}
	if steps > alone*2/3 {
		t.Fatalf("%d llama_decode calls for %d one at a time: the sessions did not decode together", steps, alone)
	}
	// The running sequences held KV cells; ended, they hold none (the
	// prefix cache's host copies are not the context's cells).
	if st := e.Stats(); st.Running != 0 || st.Queued != 0 || st.PrefillTokensPerS <= 0 || st.DecodeTokensPerS <= 0 || maxKV <= 0 || st.KVUtilization != 0 {
		t.Fatalf("after: %+v (KV utilization up to %g while running)", st, maxKV)
	}
}

// TestCancelFreesSequence: a session whose client goes away mid-decode
// leaves the batch, and its sequence and cells serve the next one.
func TestCancelFreesSequence(t *testing.T) {
	e := newEngine(t, Config{BatchSize: 1})
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	_, err := e.Generate(ctx, request(t, e, tokensOf(60, 30, e.Vocab()), 500), func(engine.Token) error {
		if n++; n == 3 {
			cancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Generate: %v", err)
	}
	if out := collect(t, e, request(t, e, tokensOf(61, 30, e.Vocab()), 4)); len(out) != 4 {
		t.Fatalf("the next session: %d tokens", len(out))
	}
	if st := e.Stats(); st.Running != 0 || st.Queued != 0 {
		t.Fatalf("after: %+v", st)
	}
}

// TestTopPResumesItsStream (issue 20): top-p's random stream is a
// function of (seed, step), so a session resumed at step 27 with its
// blocks loaded (the prompt's and those of its output, kept as they
// completed) continues with exactly the tokens of the uninterrupted run.
// (Recomputing the output instead would not do: llama.cpp evaluates a
// token alone and in a batch to different last bits, and a top-p draw
// near a boundary follows them.)
func TestTopPResumesItsStream(t *testing.T) {
	e := newEngine(t, Config{BatchSize: 1})
	bt := int(e.Geometry().BlockTokens)
	prompt := tokensOf(70, 2*bt+5, e.Vocab())
	compat, _ := e.Descriptor().CompatID()
	run := func(seed uint64, generated []uint32) (out []uint32, cached int) {
		req := request(t, e, prompt, 40)
		req.Sampler = engine.Sampler{Method: engine.TopP, P: 0.9, Seed: seed}
		chain, _ := kvsp.ResumeChain(testScope, compat, bt, req.Keys[len(req.Keys)-1], len(req.Keys))
		req.GeneratedKeys = chain.Append(nil, prompt[2*bt:]...)
		req.GeneratedKeys = chain.Append(req.GeneratedKeys, generated...)
		req.Chain, req.Generated = chain, generated
		req.OnPrefill = func(st engine.PrefillStats) { cached = st.CachedTokens }
		return collect(t, e, req), cached
	}
	whole, _ := run(42, nil)
	rest, cached := run(42, whole[:27])
	if cached != 4*bt-1 { // all four blocks, the last token evaluated again for its logits
		t.Fatalf("resumed with %d tokens injected, want %d", cached, 4*bt-1)
	}
	if !slices.Equal(rest, whole[27:]) {
		t.Fatalf("resumed at 27: %v, uninterrupted %v", rest, whole[27:])
	}
	if other, _ := run(43, nil); slices.Equal(other, whole) {
		t.Fatal("another seed, the same 40 tokens: the seed is not used")
	}
	if variate(42, 3) != variate(42, 3) || variate(42, 3) == variate(42, 4) || variate(42, 3) == variate(43, 3) {
		t.Fatal("the variate is not a function of (seed, step)")
	}
}

// TestGeneratedBlocksKept (R-SES-2): when a block of output tokens
// completes, its KV is read back and kept under the chain's key before
// OnBlock tells the agent, and a session resumed with those tokens
// injects them instead of recomputing them.
func TestGeneratedBlocksKept(t *testing.T) {
	e := newEngine(t, Config{BatchSize: 1})
	bt := int(e.Geometry().BlockTokens)
	prompt := tokensOf(71, 2*bt+5, e.Vocab())
	req := request(t, e, prompt, 3*bt)
	compat, _ := e.Descriptor().CompatID()
	chain, err := kvsp.ResumeChain(testScope, compat, bt, req.Keys[len(req.Keys)-1], len(req.Keys))
	if err != nil {
		t.Fatal(err)
	}
	chain.Append(nil, prompt[2*bt:]...)
	req.Chain = chain
	var blocks []kvsp.BlockKey
	req.OnBlock = func(k kvsp.BlockKey) {
		if !e.KV().Has(k) {
			t.Errorf("OnBlock(%s) before the block is resident", k)
		}
		blocks = append(blocks, k)
	}
	out := collect(t, e, req)
	all, _ := kvsp.BlockKeys(testScope, compat, bt, append(slices.Clone(prompt), out...))
	if !slices.Equal(blocks, all[2:]) {
		t.Fatalf("OnBlock got %d blocks, want the %d of the output", len(blocks), len(all)-2)
	}
	res := request(t, e, prompt, 3*bt)
	res.Generated = out[:2*bt]
	res.GeneratedKeys = all[2:4]
	var st engine.PrefillStats
	res.OnPrefill = func(s engine.PrefillStats) { st = s }
	collect(t, e, res)
	if st.CachedTokens != 4*bt {
		t.Fatalf("resumed: %+v, want the prompt's and the output's blocks (%d tokens) injected", st, 4*bt)
	}
}

// TestAnswerEndsAtEndOfGeneration (A-39, on the real model): SmolLM2
// asked a short question in its chat format answers and ends with its
// end-of-generation token, well before max_tokens: Generate says "stop"
// and never outputs that token; the answer is the model's (it names
// Paris). With max_tokens below the answer's length it says "length" after
// exactly that many tokens, the answer's first ones.
func TestAnswerEndsAtEndOfGeneration(t *testing.T) {
	e := newEngine(t, Config{Model: kvsptest.SmolLM2(t), BatchSize: 1})
	vocab := llama.ModelGetVocab(e.model)
	prompt := "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
	var toks []uint32
	for _, tok := range llama.Tokenize(vocab, prompt, false, true) {
		toks = append(toks, uint32(tok))
	}
	gen := func(max int) ([]uint32, kvsp.FinishReason) {
		var out []uint32
		finish, err := e.Generate(context.Background(), request(t, e, toks, max), func(tok engine.Token) error {
			out = append(out, tok.ID)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return out, finish
	}
	out, finish := gen(64)
	ids := make([]llama.Token, len(out))
	for i, id := range out {
		ids[i] = llama.Token(id)
		if e.eog[id] {
			t.Fatalf("output %d is an end-of-generation token", i)
		}
	}
	text := llama.Detokenize(vocab, ids, false, false)
	t.Logf("%d prompt tokens; answer of %d tokens, %q: %q", len(toks), len(out), finish, text)
	if finish != kvsp.FinishStop || len(out) == 0 || len(out) >= 64 || !strings.Contains(text, "Paris") {
		t.Fatalf("answer %q: %d tokens, finish %q", text, len(out), finish)
	}
	short, finish := gen(3)
	if finish != kvsp.FinishLength || !slices.Equal(short, out[:3]) {
		t.Fatalf("max_tokens 3: %v, finish %q (the answer starts %v)", short, finish, out[:3])
	}
	if st := e.Stats(); st.Running != 0 || st.Queued != 0 {
		t.Fatalf("requests still running: %+v", st)
	}
}

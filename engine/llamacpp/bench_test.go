package llamacpp

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/hybridgroup/yzma/pkg/llama"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/internal/gguf"
)

// The benchmarks' models: the default tiny one, and a larger one of 8
// layers, 1024 wide with 4 KV heads of 64 (8 KiB of KV per token, as an
// 8-layer slice of a 7-8B model has), whose context holds 8,192-token
// prompts.
var (
	benchTiny  = func() gguf.TinyParams { p := gguf.DefaultTiny(); p.Context = 16384; return p }()
	benchLarge = gguf.TinyParams{Name: "kvsp-bench-8x1024", Layers: 8, Embd: 1024, Heads: 16, KVHeads: 4, FF: 2816, Vocab: 32000, Context: 16384, Seed: 7}
)

// benchHolder puts keys' blocks of src through a real holder on loopback
// TLS and returns it.
func benchHolder(b *testing.B, src *Engine, keys []kvsp.BlockKey) *client.Holder {
	b.Helper()
	hold := holderOf(b, src)
	compat, _ := src.Descriptor().CompatID()
	for _, key := range keys {
		data, digest := blockOf(b, src, key)
		if err := hold.PutBlock(context.Background(), client.BlockRef{Compat: compat, Scope: testScope.ID(), Key: key}, bytes.NewReader(data), int64(len(data)), digest); err != nil {
			b.Fatal(err)
		}
	}
	return hold
}

// fetch GETs keys' blocks from hold, verified layer by layer and whole
// (the client checks Repr-Digest), and hands each layer to sink.
func fetch(b *testing.B, hold *client.Holder, compat kvsp.CompatID, g container.Geometry, keys []kvsp.BlockKey, sink func(key kvsp.BlockKey, l container.Layer)) {
	for _, key := range keys {
		s, err := hold.GetBlock(context.Background(), client.BlockRef{Compat: compat, Scope: testScope.ID(), Key: key}, g, client.GetOptions{})
		if err != nil {
			b.Fatal(err)
		}
		for {
			l, err := s.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			sink(key, l)
		}
		s.Close()
	}
}

// BenchmarkTTFT (issue 20): the time to the first token of a prompt whose
// prefix is cached at another instance's holder (fetch over loopback
// TLS, verify, inject, prefill the 16-token suffix) against recomputing
// the whole prompt, in the same run: ratio = recompute / cached.
func BenchmarkTTFT(b *testing.B) {
	for _, m := range []struct {
		name string
		p    gguf.TinyParams
	}{{"tiny", benchTiny}, {"8x1024", benchLarge}} {
		for _, n := range []int{512, 2048, 8192} {
			b.Run(fmt.Sprintf("%s/%d", m.name, n), func(b *testing.B) { benchTTFT(b, m.p, n) })
		}
	}
}

func benchTTFT(b *testing.B, p gguf.TinyParams, n int) {
	cfg := Config{Model: tinyModel(b, p), ContextTokens: n + 64, BatchSize: 1, PrefillChunk: 512, KVCapacity: n/16 + 8}
	a, e := newEngine(b, cfg), newEngine(b, cfg)
	prompt := tokensOf(7, n+16, a.Vocab())
	req := request(b, a, prompt, 1)
	collect(b, a, request(b, a, prompt[:n], 1)) // A computes the prefix
	hold := benchHolder(b, a, req.Keys[:n/16])
	compat, _ := a.Descriptor().CompatID()
	g := a.Geometry()
	ttft := func(load bool) time.Duration {
		for _, k := range req.Keys {
			e.KV().Drop(k)
		}
		t0 := time.Now()
		if load {
			fetch(b, hold, compat, g, req.Keys[:n/16], func(key kvsp.BlockKey, l container.Layer) {
				if err := e.KV().WriteLayer(key, l.Index, l.K, l.V); err != nil {
					b.Fatal(err)
				}
			})
		}
		var first time.Duration
		r := req
		r.OnPrefill = func(st engine.PrefillStats) {
			if load && st.CachedTokens != n {
				b.Fatalf("%d tokens cached, want %d", st.CachedTokens, n)
			}
		}
		if _, err := e.Generate(context.Background(), r, func(engine.Token) error { first = time.Since(t0); return nil }); err != nil {
			b.Fatal(err)
		}
		return first
	}
	var cached, full time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		cached += ttft(true)
		full += ttft(false)
	}
	b.ReportMetric(float64(cached.Milliseconds())/float64(b.N), "cached-ms")
	b.ReportMetric(float64(full.Milliseconds())/float64(b.N), "recompute-ms")
	b.ReportMetric(float64(full)/float64(cached), "speedup")
}

// BenchmarkLoadPath (issue 20): loading blocks of about 2 MiB (8 layers ×
// 8 KiB per token × 256 tokens): the verified GET, the conversion into
// llama.cpp's state and the injection, against the same verified GETs
// into a discarded buffer, same transport, same run. ratio = GET alone /
// the load path; the bound is 0.7.
func BenchmarkLoadPath(b *testing.B) {
	for _, fa := range []bool{false, true} {
		b.Run(fmt.Sprintf("flash_attention=%v", fa), func(b *testing.B) { benchLoadPath(b, fa) })
	}
}

func benchLoadPath(b *testing.B, fa bool) {
	cfg := Config{Model: tinyModel(b, benchLarge), ContextTokens: 4096, BatchSize: 1, BlockTokens: 256, PrefillChunk: 512, KVCapacity: 64, FlashAttention: fa}
	a, e := newEngine(b, cfg), newEngine(b, cfg)
	const blocks = 4
	req := request(b, a, tokensOf(8, blocks*256, a.Vocab()), 1)
	collect(b, a, req)
	hold := benchHolder(b, a, req.Keys)
	compat, _ := a.Descriptor().CompatID()
	g := a.Geometry()
	size := int64(container.HeaderLen(int(g.Layers))) + 2*int64(g.Layers)*int64(g.RawSectionLen())
	b.SetBytes(blocks * size)
	b.ReportAllocs()
	var get, load time.Duration
	sink := make([]byte, 2*g.RawSectionLen())
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		fetch(b, hold, compat, g, req.Keys, func(_ kvsp.BlockKey, l container.Layer) { copy(sink, l.K); copy(sink[len(l.K):], l.V) })
		get += time.Since(t0)
		for _, k := range req.Keys {
			e.KV().Drop(k)
		}
		t0 = time.Now()
		fetch(b, hold, compat, g, req.Keys, func(key kvsp.BlockKey, l container.Layer) {
			if err := e.KV().WriteLayer(key, l.Index, l.K, l.V); err != nil {
				b.Fatal(err)
			}
		})
		var err error
		e.onLoop(func(l *loopState) {
			for _, k := range req.Keys {
				e.blocks.Pin(k)
			}
			err = l.inject(0, 0, req.Keys)
			for _, k := range req.Keys {
				e.blocks.Unpin(k)
			}
			llama.MemorySeqRm(e.mem, 0, -1, -1)
		})
		if err != nil {
			b.Fatal(err)
		}
		load += time.Since(t0)
	}
	b.ReportMetric(float64(get)/float64(load), "ratio")
	b.ReportMetric(float64(blocks*size)*float64(b.N)/load.Seconds()/1e6, "load-MB/s")
	b.ReportMetric(float64(blocks*size)*float64(b.N)/get.Seconds()/1e6, "get-MB/s")
}

// BenchmarkConvert (issue 20): the conversion between llama.cpp's state
// and kvsp-layout-1 blocks, both ways, for 2 MiB blocks of the 8x1024
// geometry, in both V layouts, against copy of the same octets in the
// same run: ratio = copy / conversion; the bound is 0.5.
func BenchmarkConvert(b *testing.B) {
	for _, vt := range []bool{false, true} {
		b.Run(fmt.Sprintf("v_trans=%v", vt), func(b *testing.B) {
			const layers, bt, blocks, row = 8, 256, 4, 4 * 64 * 2
			l := layout{streams: 1, vTrans: vt, layers: layers, kType: ggmlF16, vType: ggmlF16, kRow: row, vRow: row}
			if vt {
				l.vElem = 2
			}
			sec := bt * row
			src := make([][]byte, blocks) // per block: per layer K then V
			r := rand.New(rand.NewPCG(1, 2))
			for i := range src {
				src[i] = make([]byte, 2*layers*sec)
				for j := range src[i] {
					src[i][j] = byte(r.Uint32())
				}
			}
			w := newStateWriter(&l, 0, blocks*bt, bt, nil)
			put := func() {
				for i := range src {
					for y := 0; y < layers; y++ {
						w.put(i, y, src[i][2*y*sec:2*y*sec+sec], src[i][2*y*sec+sec:2*(y+1)*sec])
					}
				}
			}
			put()
			st, _, err := parseState(w.b, &l)
			if err != nil {
				b.Fatal(err)
			}
			dst := make([]byte, 2*sec)
			get := func() {
				for i := range src {
					idx, _ := st.cellsByPos(i*bt, bt)
					for y := 0; y < layers; y++ {
						l.kSection(dst[:sec], st, y, idx)
						l.vSection(dst[sec:], st, y, idx)
						if !bytes.Equal(dst, src[i][2*y*sec:2*(y+1)*sec]) {
							b.Fatal("the conversion is not exact")
						}
					}
				}
			}
			get()
			plain := make([]byte, len(w.b))
			n := int64(blocks * 2 * layers * sec)
			b.SetBytes(2 * n)
			b.ReportAllocs()
			var conv, cp time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				put()
				for j := range src {
					idx, _ := st.cellsByPos(j*bt, bt)
					for y := 0; y < layers; y++ {
						l.kSection(dst[:sec], st, y, idx)
						l.vSection(dst[sec:], st, y, idx)
					}
				}
				conv += time.Since(t0)
				t0 = time.Now()
				for j := range src { // the same octets, copied both ways
					copy(plain[j*len(src[j]):], src[j])
				}
				for j := range src {
					copy(src[j], plain[j*len(src[j]):])
				}
				cp += time.Since(t0)
			}
			b.ReportMetric(float64(cp)/float64(conv), "ratio")
		})
	}
}

// BenchmarkDecode (issue 20): 1, 4 and 8 sessions decoding through the
// engine (prefill of a 32-token prompt, 64 greedy tokens each, the
// output blocks read back) against the bare binding decoding the same
// sequences on a context of the same parameters, one llama_decode per
// step, logits read and argmax taken: ratio = bare / engine; the bound is
// 0.95.
func BenchmarkDecode(b *testing.B) {
	for _, m := range []struct {
		name string
		p    gguf.TinyParams
	}{{"tiny", gguf.DefaultTiny()}, {"8x1024", benchLarge}} {
		for _, n := range []int{1, 4, 8} {
			b.Run(fmt.Sprintf("%s/%d", m.name, n), func(b *testing.B) { benchDecode(b, m.p, n) })
		}
	}
}

func benchDecode(b *testing.B, p gguf.TinyParams, sessions int) {
	const promptN, out = 32, 64
	cfg := Config{Model: tinyModel(b, p), ContextTokens: 256, BatchSize: 8, PrefillChunk: 256, KVCapacity: 1024}
	e := newEngine(b, cfg)
	prompts := make([][]uint32, sessions)
	for i := range prompts {
		prompts[i] = tokensOf(900+i, promptN, e.Vocab())
	}
	bare := newBare(b, e)
	var eng, raw time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		errs := make(chan error, sessions)
		for s := range prompts {
			req := request(b, e, prompts[s], out)
			for _, k := range req.Keys {
				e.KV().Drop(k)
			}
			go func() {
				_, err := e.Generate(context.Background(), req, func(engine.Token) error { return nil })
				errs <- err
			}()
		}
		for range prompts {
			if err := <-errs; err != nil {
				b.Fatal(err)
			}
		}
		eng += time.Since(t0)
		t0 = time.Now()
		bare.run(b, prompts, out)
		raw += time.Since(t0)
	}
	b.ReportMetric(float64(sessions*out*b.N)/eng.Seconds(), "engine-tokens/s")
	b.ReportMetric(float64(sessions*out*b.N)/raw.Seconds(), "bare-tokens/s")
	b.ReportMetric(float64(raw)/float64(eng), "ratio")
}

// bare is the binding alone: a context of the engine's parameters.
type bare struct {
	e     *Engine
	lctx  llama.Context
	mem   llama.Memory
	batch llama.Batch
}

func newBare(b *testing.B, e *Engine) *bare {
	cp := e.cfg.contextParams() // the engine's own, whatever they become
	lctx, err := llama.InitFromModel(e.model, cp)
	if err != nil || lctx == 0 {
		b.Fatal(err)
	}
	mem, _ := llama.GetMemory(lctx)
	x := &bare{e: e, lctx: lctx, mem: mem, batch: llama.BatchInit(int32(cp.NBatch), 0, 1)}
	b.Cleanup(func() { llama.BatchFree(x.batch); llama.Free(lctx) })
	return x
}

func (x *bare) run(b *testing.B, prompts [][]uint32, out int) {
	ids := []llama.SeqId{0}
	last := make([]uint32, len(prompts))
	for s, p := range prompts { // each prompt in one batch
		x.batch.Clear()
		ids[0] = llama.SeqId(s)
		for i, t := range p {
			x.batch.Add(llama.Token(t), llama.Pos(i), ids, i == len(p)-1)
		}
		if rc, err := llama.Decode(x.lctx, x.batch); rc != 0 || err != nil {
			b.Fatal(rc, err)
		}
		l, _ := llama.GetLogitsIth(x.lctx, x.batch.NTokens-1, x.e.vocab)
		last[s] = uint32(slices.Index(l, slices.Max(l)))
	}
	for step := 1; step < out; step++ { // then one llama_decode per step
		x.batch.Clear()
		for s, p := range prompts {
			ids[0] = llama.SeqId(s)
			x.batch.Add(llama.Token(last[s]), llama.Pos(len(p)+step-1), ids, true)
		}
		if rc, err := llama.Decode(x.lctx, x.batch); rc != 0 || err != nil {
			b.Fatal(rc, err)
		}
		for s := range prompts {
			l, _ := llama.GetLogitsIth(x.lctx, int32(s), x.e.vocab)
			last[s] = uint32(slices.Index(l, slices.Max(l)))
		}
	}
	for s := range prompts {
		llama.MemorySeqRm(x.mem, llama.SeqId(s), -1, -1)
	}
}

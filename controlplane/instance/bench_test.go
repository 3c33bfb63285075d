package instance_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
)

// BenchmarkPrefetch64: a directive for 64 blocks of 2 MiB (32 layers, 8
// KV heads of 128, 16 tokens, bf16: a Llama-3-8B-like block) loaded from a
// holder over loopback mutual TLS, leases, layer verification and
// placement into the engine included, against the simulated recompute time
// of the same 1,024 tokens at 42,000 tokens/s (the comparison).
func BenchmarkPrefetch64(b *testing.B) {
	big := desc
	big.Model, big.Layers, big.KVHeads, big.HeadDim = "sim/8b-like", 32, 8, 128
	w := newRig(b, rigOptions{d: &big, noStore: true})
	tokens := prompt(64)
	keys := w.fill(b, tokens, 64)
	b.SetBytes(64 * 2 << 20)
	b.ResetTimer()
	for b.Loop() {
		b.StopTimer()
		for _, k := range keys[:64] {
			w.eng.KV().Drop(k)
		}
		d := w.directive(keys[:64], func(int) []string { return []string{w.url("/h1/")} }, 60000)
		b.StartTimer()
		if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
			b.Fatal(err)
		}
		for {
			st, err := w.pc.PrefetchStatus(context.Background(), d.Directive)
			if err != nil {
				b.Fatal(err)
			}
			if st.State != kvsp.PrefetchPending {
				if st.State != kvsp.PrefetchComplete {
					b.Fatalf("%+v", st)
				}
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	perOp := b.Elapsed() / time.Duration(b.N)
	recompute := 64 * 16 * time.Second / 42000
	b.ReportMetric(float64(perOp.Microseconds())/1e3, "ms-to-resident")
	b.ReportMetric(float64(recompute.Microseconds())/1e3, "ms-recompute")
	b.ReportMetric(float64(recompute)/float64(perOp), "recompute/fetch")
}

// BenchmarkReleaseLatency: what checkpoint-gated release costs a
// non-deterministic sampler (R-SES-6/7): time to the first token and to
// the whole output of 256 tokens, greedy (released at once) against top-p
// (released as each block of 16 generated tokens is acknowledged by the
// PC), over mutual TLS on loopback, decode at 5,000 tokens/s.
func BenchmarkReleaseLatency(b *testing.B) {
	w := newRig(b, rigOptions{noStore: true})
	w.runAgents(b, "/ii1/")
	tokens := prompt(2)
	for _, sampler := range []*kvsp.PlaceSampler{nil, {Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: 1}} {
		name := "greedy"
		if sampler != nil {
			name = "top-p"
		}
		b.Run(name, func(b *testing.B) {
			var first, total time.Duration
			for b.Loop() {
				pl, err := w.front.Controller(w.url("/pc/")).Place(context.Background(), &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: tokens, MaxTokens: 256, Sampler: sampler})
				if err != nil {
					b.Fatal(err)
				}
				t0 := time.Now()
				gotFirst := false
				err = w.front.Instance(pl.Instance).Generate(context.Background(), &kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, Grant: pl.Grant, ScopeID: w.scopeKey.ID(),
					CompatID: w.compat, Tokens: tokens, MaxTokens: 256, Sampler: sampler}, func(kvsp.GeneratedToken) error {
					if !gotFirst {
						gotFirst = true
						first += time.Since(t0)
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
				total += time.Since(t0)
			}
			b.ReportMetric(float64(first.Microseconds())/float64(b.N)/1e3, "ms-first-token")
			b.ReportMetric(float64(total.Microseconds())/float64(b.N)/1e3, "ms-256-tokens")
		})
	}
}

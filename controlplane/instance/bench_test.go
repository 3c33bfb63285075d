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

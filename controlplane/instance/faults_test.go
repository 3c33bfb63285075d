package instance_test

import (
	"bytes"
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine/sim"
	"github.com/kvsp/kvsp/internal/faultproxy"
)

// TestF13_PrefetchUnderBadNetworks (RELIABILITY F13, R-PF-*): with the
// holder behind a faulty network (latency 200±50 ms, 10 MB/s, resets,
// slicing, a black hole), every directive ends by its deadline (plus a
// margin) as complete, partial or failed; what it lists as loaded is a
// prefix of its blocks, resident with exactly the engine's own bytes; no
// block it lists as failed is resident; and a request admitted meanwhile
// runs unhindered.
func TestF13_PrefetchUnderBadNetworks(t *testing.T) {
	w := newRig(t, rigOptions{noStore: true})
	keys := w.fill(t, prompt(8), 8)
	p, err := faultproxy.Start(w.srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	src := "https://" + p.Addr() + "/h1/"
	for _, tc := range []struct {
		name       string
		f          faultproxy.Faults
		deadlineMs uint64
	}{
		{"latency 200±50ms", faultproxy.Faults{Latency: 200 * time.Millisecond, Jitter: 50 * time.Millisecond}, 50},
		{"latency, long deadline", faultproxy.Faults{Latency: 200 * time.Millisecond, Jitter: 50 * time.Millisecond}, 2000},
		{"10 MB/s", faultproxy.Faults{BytesPerSecond: 10e6}, 300},
		{"reset after 3000 octets", faultproxy.Faults{ResetAfter: 3000}, 1000},
		{"slicer", faultproxy.Faults{SliceBytes: 7, Latency: time.Millisecond}, 2000},
		{"black hole", faultproxy.Faults{BlackHole: true}, 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, k := range keys {
				w.eng.KV().Drop(k)
			}
			p.Set(tc.f)
			defer p.Set(faultproxy.Faults{})
			d := w.directive(keys, func(int) []string { return []string{src} }, tc.deadlineMs)
			start := time.Now()
			if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
				t.Fatal(err)
			}
			// Admitted requests are not blocked meanwhile: a prompt of
			// its own (no directive, no shared block) gets its first
			// token promptly.
			own := prompt(1)
			for i := range own {
				own[i] += 7
			}
			probe := time.Now()
			err := w.front.Instance(w.url("/ii1/")).Generate(context.Background(), &kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1,
				ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: own, MaxTokens: 1}, func(kvsp.GeneratedToken) error { return nil })
			if err != nil || time.Since(probe) > time.Second {
				t.Errorf("a request during the prefetch: %v after %v", err, time.Since(probe))
			}
			st := w.wait(t, d.Directive)
			took := time.Since(start)
			if limit := time.Duration(tc.deadlineMs)*time.Millisecond + 1500*time.Millisecond; took > limit {
				t.Errorf("the directive ended after %v, deadline %d ms", took, tc.deadlineMs)
			}
			if !slices.Equal(st.Loaded, keys[:len(st.Loaded)]) || len(st.Loaded)+len(st.Failed) != len(keys) {
				t.Fatalf("loaded %d, failed %d: not a prefix and the rest", len(st.Loaded), len(st.Failed))
			}
			switch {
			case st.State == kvsp.PrefetchComplete && len(st.Loaded) != len(keys),
				st.State != kvsp.PrefetchComplete && len(st.Failed) == 0:
				t.Fatalf("state %s with %d loaded", st.State, len(st.Loaded))
			}
			k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
			wk, wv := make([]byte, len(k)), make([]byte, len(v))
			for _, key := range st.Loaded {
				for l := uint32(0); l < w.g.Layers; l++ {
					if err := w.eng.KV().ReadLayer(key, l, k, v); err != nil {
						t.Fatalf("a loaded block is not resident: %v", err)
					}
					sim.BlockContent(w.g, key, l, wk, wv)
					if !bytes.Equal(k, wk) || !bytes.Equal(v, wv) {
						t.Fatal("a loaded block's bytes are not the engine's own")
					}
				}
			}
			for _, key := range st.Failed {
				if w.eng.KV().Has(key) {
					t.Fatal("a block the directive failed is resident")
				}
			}
			t.Logf("%s: %s, %d of %d loaded in %v", tc.name, st.State, len(st.Loaded), len(keys), took.Round(time.Millisecond))
		})
	}
}

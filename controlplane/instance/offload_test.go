package instance_test

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/engine/sim"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestOffloadCopiedAtOffer (issue 21): the blocks a request computed
// reach the instance's holder even when the engine evicts them before
// their PUT starts: they are copied out when offered. (The holder holds
// its PUTs until the blocks are dropped: eight PUTs wait there, the other
// eight blocks in the agent's queue.) Read at PUT time,
// 42% of the blocks computed in kvsp demo --speed 24 were gone by then,
// without a trace.
func TestOffloadCopiedAtOffer(t *testing.T) {
	gate := make(chan struct{})
	w := newRig(t, rigOptions{wrap: func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPut && strings.HasPrefix(r.URL.Path, "/hi/blocks/") {
				<-gate // the instance's holder answers no PUT until the blocks are gone from the engine
			}
			h.ServeHTTP(rw, r)
		})
	}})
	tokens := prompt(16) // twice the PUTs under way at once: half wait in the agent's queue
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, tokens)
	err := w.front.Instance(w.url("/ii1/")).Generate(context.Background(), w.granted(t, &kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1, ScopeID: w.scopeKey.ID(),
		CompatID: w.compat, Tokens: tokens, MaxTokens: 2}), func(kvsp.GeneratedToken) error { return nil })
	if err != nil {
		close(gate)
		t.Fatal(err)
	}
	for _, k := range keys {
		w.eng.KV().Drop(k)
	}
	close(gate)
	for deadline := time.Now().Add(10 * time.Second); offloadsOf(w, "stored") < 16; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%v of 16 computed blocks stored at the instance's holder after the engine evicted them (%v evicted first)", offloadsOf(w, "stored"), offloadsOf(w, "evicted"))
		}
	}
	k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
	for i, key := range keys {
		blk, err := w.hi.GetBlock(context.Background(), client.BlockRef{Compat: w.compat, Scope: w.scopeKey.ID(), Key: key}, w.g, client.GetOptions{})
		if err != nil {
			t.Fatalf("block %d at the instance's holder: %v", i, err)
		}
		for l := uint32(0); l < w.g.Layers; l++ {
			got, err := blk.Next()
			if err != nil {
				t.Fatal(err)
			}
			sim.BlockContent(w.g, key, l, k, v)
			if !bytes.Equal(got.K, k) || !bytes.Equal(got.V, v) {
				t.Fatalf("block %d layer %d: not what the engine computed", i, l)
			}
		}
		blk.Close()
	}
}

// TestPrefetchedBlocksKeptUntilPrefill (issue 21): blocks a request's
// directive loaded stay resident while the request waits for a place in
// the engine's batch, though other requests' prefills fill the engine's
// KV meanwhile: its prefill reuses them all. Unpinned, they were evicted
// and recomputed (kvsp_instance_prompt_blocks_lost_total counts what the
// pins' bound, a quarter of the KV, cannot keep).
func TestPrefetchedBlocksKeptUntilPrefill(t *testing.T) {
	w := newRig(t, rigOptions{})
	tokens := prompt(4)
	session, d := w.prefetchForSession(t, tokens)
	w.wait(t, d.Directive)
	// The batch (4) is full of long generations.
	busy, stop := context.WithCancel(context.Background())
	defer stop()
	for i := range 4 {
		go w.front.Instance(w.url("/ii1/")).Generate(busy, w.granted(t, &kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1, ScopeID: w.scopeKey.ID(),
			CompatID: w.compat, Tokens: prompt(1 + i), MaxTokens: 1 << 16}), func(kvsp.GeneratedToken) error { return nil })
	}
	kvsptest.WaitFor(t, "the batch full", func() bool { return w.eng.Stats().Running == 4 })
	done := make(chan error, 1)
	var cached uint64
	go func() {
		done <- w.front.Instance(w.url("/ii1/")).Generate(context.Background(), w.granted(t, &kvsp.GenerateRequest{Session: session, Epoch: 1, ScopeID: w.scopeKey.ID(),
			CompatID: w.compat, Tokens: tokens, MaxTokens: 2}), func(t kvsp.GeneratedToken) error {
			if t.Prefill != nil {
				cached = t.Prefill.CachedTokens
			}
			return nil
		})
	}()
	kvsptest.WaitFor(t, "the request queued", func() bool { return w.eng.Stats().Queued == 1 })
	// Other blocks fill the engine's KV (256 blocks) over and over.
	k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
	for i := range 600 {
		var key kvsp.BlockKey
		key[0], key[1], key[2] = 0xee, byte(i), byte(i>>8)
		for l := uint32(0); l < w.g.Layers; l++ {
			if err := w.eng.KV().WriteLayer(key, l, k, v); err != nil {
				t.Fatalf("filling the KV: %v", err)
			}
		}
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if cached != 64 {
		t.Fatalf("%d prompt tokens reused after the wait, want 64 (the 4 blocks loaded)", cached)
	}
}

// offloadsOf is kvsp_instance_offloads_total{outcome} (0 before the
// first).
func offloadsOf(w *rig, outcome string) float64 {
	mfs, _ := w.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "kvsp_instance_offloads_total" {
			for _, m := range mf.GetMetric() {
				if m.GetLabel()[0].GetValue() == outcome {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

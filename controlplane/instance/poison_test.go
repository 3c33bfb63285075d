package instance_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/failpoint"
)

// metric sums the samples of name in reg whose labels include each
// label=value pair given (labels: label, value, ...).
func metric(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	samples:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || lp.GetName() == labels[i] && lp.GetValue() == labels[i+1]
				}
				if !found {
					continue samples
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// loadFrom runs a directive for key with sources srcs, in that order,
// and checks that it completed.
func (w *rig) loadFrom(t *testing.T, key kvsp.BlockKey, srcs ...string) {
	t.Helper()
	d := w.directive([]kvsp.BlockKey{key}, func(int) []string { return srcs }, 5000)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete || len(st.Loaded) != 1 {
		t.Fatalf("directive from %v: %+v", srcs, st)
	}
}

// TestS8_AgentHoldsReplicasToTheProducersDigests (RELIABILITY S8 and B2,
// the consumer's half; spec "Cache poisoning"; R-IS-10, R-BLK-8,
// R-BLK-9). The IS runs with producer digests: each key's digest is
// pinned to its first live replica's, h1's. A holder h2 stores other
// bytes under the key, self-consistent (its Repr-Digest and the layer
// digests it computes are those of its bytes): another prefix's block
// (S8), or h1's block with one data octet changed (B2). h2's publish is
// refused (the holder counts the refusal) and a lookup names h1 only.
// A directive naming h2 first anyway (a directive may name any holder)
// has h2's bytes checked against the layer digests the key's records
// agree on, the producer's: the agent counts a digest failure, keeps
// nothing of h2's, and loads h1's replica, the engine's own bytes.
func TestS8_AgentHoldsReplicasToTheProducersDigests(t *testing.T) {
	other := prompt(2)
	other[0]++ // another prefix: other keys, other content
	for _, c := range []struct {
		name   string
		poison func(w *rig, good []byte) []byte
	}{
		{"another prefix's block", func(w *rig, _ []byte) []byte { b, _ := w.blockBytes(t, other, 0); return b }},
		{"one data octet changed", func(_ *rig, good []byte) []byte { b := bytes.Clone(good); b[len(b)-1] ^= 0x40; return b }},
	} {
		t.Run(c.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			w := newRig(t, rigOptions{h2: true, producerDigests: true, holderReg: reg})
			tokens := prompt(2)
			keys := w.fill(t, tokens, 1)
			good, _ := w.blockBytes(t, tokens, 0)
			poison := c.poison(w, good)
			if bytes.Equal(poison, good) {
				t.Fatal("the poison is the block")
			}
			r := client.BlockRef{Compat: w.compat, Scope: w.scopeKey.ID(), Key: keys[0]}
			if err := w.h2.PutBlock(context.Background(), r, bytes.NewReader(poison), int64(len(poison)), container.Digest(sha256.Sum256(poison))); err != nil {
				t.Fatalf("h2 stores the poison: %v", err)
			}
			for deadline := time.Now().Add(5 * time.Second); metric(t, reg, "kvsp_holder_publish_failures_total", "holder", "/h2/", "why", "refused") == 0; {
				if time.Now().After(deadline) {
					t.Fatal("h2's publish was not refused")
				}
				time.Sleep(10 * time.Millisecond)
			}
			resp, err := w.front.Index(w.isURL).Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: keys[:1]})
			if err != nil || resp.Matched != 1 || len(resp.Replicas[0]) != 1 || resp.Replicas[0][0].Holder != w.url("/h1/") {
				t.Fatalf("lookup: %+v %v; want h1's replica only", resp, err)
			}
			w.loadFrom(t, keys[0], w.url("/h2/"), w.url("/h1/"))
			if n := metric(t, w.reg, "kvsp_instance_digest_failures_total"); n != 1 {
				t.Fatalf("%v digest failures, want 1 (h2's)", n)
			}
			w.engineHolds(t, keys[:1])
		})
	}
}

// TestF1_AgentUsesAnotherReplicaOnBitrot (RELIABILITY F1, the consumer's
// half; R-BLK-8, R-BLK-9): h1 and h2 hold the block and publish it; the
// failpoint holder/corrupt-on-read flips an octet of what h1 sends after
// its Repr-Digest was set from the stored digest. The agent's directive
// (h1 first) detects it by the layer digests of h1's record, counts a
// digest failure, keeps nothing of h1's, and loads h2's replica: the
// engine's own bytes. (The holder's half, bitrot on disk detected,
// dropped and withdrawn, is holder's TestF1_BitrotAtHolder.)
func TestF1_AgentUsesAnotherReplicaOnBitrot(t *testing.T) {
	t.Cleanup(failpoint.Reset)
	w := newRig(t, rigOptions{h2: true})
	tokens := prompt(2)
	keys := w.fill(t, tokens, 1)
	good, d := w.blockBytes(t, tokens, 0)
	r := client.BlockRef{Compat: w.compat, Scope: w.scopeKey.ID(), Key: keys[0]}
	if err := w.h2.PutBlock(context.Background(), r, bytes.NewReader(good), int64(len(good)), d.Container); err != nil {
		t.Fatal(err)
	}
	w.waitPublished(t, keys[:1], w.url("/h2/"))
	failpoint.Enable("holder/corrupt-on-read", "1*return")
	w.loadFrom(t, keys[0], w.url("/h1/"), w.url("/h2/"))
	if hits := failpoint.Hits("holder/corrupt-on-read"); hits != 1 {
		t.Fatalf("the fault was injected %d times, want 1", hits)
	}
	if n := metric(t, w.reg, "kvsp_instance_digest_failures_total"); n != 1 {
		t.Fatalf("%v digest failures, want 1 (h1's)", n)
	}
	w.engineHolds(t, keys[:1])
}

package instance_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/figures"
)

// TestS13_OnlyProducersStoreBlocks (RELIABILITY S13, red team D3: a
// principal with only the client role PUT a random, self-consistent
// container for the Block Key of a prompt nobody had run; the holder
// stored and published it, the next request of the scope injected it and
// its output changed; with producer digests the poison's digest was
// pinned first and the genuine replica refused).
//   - A client-only principal's PUT of such a block is 403 at every
//     holder, and nothing is stored.
//   - With producer digests (IS and instance): a principal that may store
//     blocks but did not compute this one (the producer role) stores other
//     bytes at h2 for the key before anyone ran the prompt; h2's publish
//     is refused (no producer stated a digest), the lookup finds nothing.
//     The prompt then runs on ii1, which states its blocks' digests and
//     offloads them: its holder's replicas are published, the genuine
//     digest. A directive naming h2 first has h2's bytes refused by the
//     consumer's digest check and the genuine replica loaded: the
//     engine holds its own KV.
func TestS13_OnlyProducersStoreBlocks(t *testing.T) {
	reg := prometheus.NewRegistry()
	w := newRig(t, rigOptions{h2: true, producerDigests: true, holderReg: reg})
	w.runAgents(t, "/ii1/")
	ctx := context.Background()
	tokens := prompt(2)
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, tokens)
	other := prompt(2)
	other[0]++
	poison, _ := w.blockBytes(t, other, 0) // self-consistent: another prefix's KV
	ref := client.BlockRef{Compat: w.compat, Scope: w.scopeKey.ID(), Key: keys[0]}
	put := func(id, base string) error {
		return w.as(id).Holder(w.url(base)).PutBlock(ctx, ref, bytes.NewReader(poison), int64(len(poison)), container.Digest(sha256.Sum256(poison)))
	}
	for _, base := range []string{"/h1/", "/hi/", "/h2/"} {
		if err := put(clientOnly, base); !errors.Is(err, kvsp.ErrForbidden) {
			t.Fatalf("a client's PUT at %s: %v; want 403", base, err)
		}
		if _, err := w.as(clientOnly).Holder(w.url(base)).GetBlock(ctx, ref, w.g, client.GetOptions{}); !errors.Is(err, kvsp.ErrNotFound) {
			t.Fatalf("after the refused PUT, %s: %v; want 404", base, err)
		}
	}

	// Pinning: the first writer of a key is not trusted for being first.
	if err := put(producerOnly, "/h2/"); err != nil {
		t.Fatalf("a producer's PUT at h2: %v", err)
	}
	refused := func(base string) float64 {
		return metric(t, reg, "kvsp_holder_publish_failures_total", "holder", base, "why", "refused")
	}
	for deadline := time.Now().Add(5 * time.Second); refused("/h2/") == 0; {
		if time.Now().After(deadline) {
			t.Fatal("h2's publish of a block no producer stated was not refused")
		}
		time.Sleep(10 * time.Millisecond)
	}
	is := w.front.Index(w.isURL)
	if resp, err := is.Lookup(ctx, &kvsp.LookupRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: keys[:1]}); err != nil || resp.Matched != 0 {
		t.Fatalf("lookup before the prompt ran: %+v %v; want nothing", resp, err)
	}
	// The prompt runs on ii1, which computes the blocks and states them.
	pl, err := w.as(clientOnly).Controller(w.url("/pc/")).Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: tokens, MaxTokens: 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.as(clientOnly).Instance(pl.Instance).Generate(ctx, &kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, ScopeID: w.scopeKey.ID(),
		CompatID: w.compat, Tokens: tokens, MaxTokens: 2, Grant: pl.Grant}, func(kvsp.GeneratedToken) error { return nil }); err != nil {
		t.Fatal(err)
	}
	w.waitPublished(t, keys[:2], w.url("/hi/"))
	_, d := w.blockBytes(t, tokens, 0)
	genuine := kvsp.Digest(container.ReplicaDigest(d.Layers))
	resp, err := is.Lookup(ctx, &kvsp.LookupRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: keys[:1]})
	if err != nil || resp.Matched != 1 || len(resp.Replicas[0]) != 1 || resp.Replicas[0][0].Holder != w.url("/hi/") || resp.Replicas[0][0].Digest != genuine {
		t.Fatalf("lookup after the prompt ran: %+v %v; want hi's genuine replica only", resp, err)
	}
	if n := refused("/hi/"); n != 0 {
		t.Fatalf("the genuine replica's publishes refused %v times", n)
	}
	// A directive naming h2 first: its bytes are refused, hi's loaded.
	w.floodKV(t, 300)
	if w.eng.KV().Has(keys[0]) {
		t.Fatal("the block stayed in the engine: the directive would prove nothing")
	}
	w.loadFrom(t, keys[0], w.url("/h2/"), w.url("/hi/"))
	if n := metric(t, w.reg, "kvsp_instance_digest_failures_total"); n != 1 {
		t.Fatalf("%v digest failures, want 1 (h2's)", n)
	}
	w.engineHolds(t, keys[:1])
	figures.Report(t, figures.Row{Row: "S13", Inputs: 4, Requests: 1,
		Held: "a client's block PUT 403 at every holder; with producer digests a non-producer's block for an unrun prompt never published, the producer's replica published and loaded, the poison refused by the consumer"})
}

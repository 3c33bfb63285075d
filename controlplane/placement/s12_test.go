package placement_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestS12_PlacementRespectsScopes (RELIABILITY S12): ii3 is reported by an
// instance identity authorized for scope A only, and reports the fastest
// status (nothing queued); ii1 and ii2, reported by an identity of both
// scopes, are busier. 100 requests of scope B, their prefix cached, are
// placed: none on ii3, and ii3 receives no directive of scope B, while
// scope A's requests (the paired positive) do go to ii3 with their
// directives. A shard map of scope B naming ii3 is refused. Once the
// policy takes scope A from ii3's identity, scope A's requests leave it
// too: the policy in force is what counts.
func TestS12_PlacementRespectsScopes(t *testing.T) {
	keyB := make([]byte, 32)
	for i := range keyB {
		keyB[i] = byte(0x20 + i)
	}
	scopeB, _ := kvsp.NewScopeKey(keyB)
	w := newWorldWith(t, 1000, func(c *placement.Config) { c.Scopes = append(c.Scopes, scopeB) })
	const (
		iiA     = "spiffe://kvsp.test/ii/a-only"
		clientB = "spiffe://kvsp.test/client/b"
	)
	policy := func(iiAScopes string) {
		pol := `principals:
  - {id: "` + kvsptest.PC + `", roles: [controller], scopes: [` + kvsptest.Scope + `, ` + scopeB.ID().String() + `]}
  - {id: "` + kvsptest.ClientA + `", roles: [client], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + iiID + `", roles: [instance], speaks_for: ["` + w.base["ii1"] + `", "` + w.base["ii2"] + `"], scopes: [` + kvsptest.Scope + `, ` + scopeB.ID().String() + `]}
  - {id: "` + iiA + `", roles: [instance], speaks_for: ["` + w.base["ii3"] + `"], scopes: [` + iiAScopes + `]}
  - {id: "` + clientB + `", roles: [client], scopes: [` + scopeB.ID().String() + `]}
`
		if err := os.WriteFile(w.pki.Path("policy.yaml"), []byte(pol), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := w.srv.Policy.Reload(); err != nil {
			t.Fatal(err)
		}
	}
	policy(kvsptest.Scope)
	mk := func(id string) *client.Client {
		c, _ := client.New(client.Config{TLS: w.pki.ClientTLS(w.pki.Leaf(id))})
		t.Cleanup(c.Close)
		return c
	}
	ctx := context.Background()
	link := kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12}
	w.status(t, "ii1", 1, 5, kvsp.StateActive, link)
	w.status(t, "ii2", 1, 5, kvsp.StateActive, link)
	ii3 := func() {
		st := &kvsp.InstanceStatus{Instance: w.base["ii3"], Epoch: 1, State: kvsp.StateActive, BatchSize: 8, PrefillTokensPerS: 42000,
			DecodeTokensPerS: 3100, Links: []kvsp.Link{link}, TTLMs: 60000, CompatID: compat, Started: w.started(w.base["ii3"])}
		if _, err := mk(iiA).Controller(w.srv.URL("/pc/")).PutStatus(ctx, st); err != nil {
			t.Fatal(err)
		}
	}
	ii3()
	// Both scopes' prefixes are cached at h1, so placements send directives.
	tokens := prompt(4*bt+3, 12)
	w.publish(t, tokens, 4)
	keysB, _ := kvsp.BlockKeys(scopeB, compat, bt, tokens)
	for _, k := range keysB[:4] {
		r := &kvsp.ReplicaRecord{BlockKey: k, CompatID: compat, ScopeID: scopeB.ID(), Holder: h1Base, Codec: 1, Size: 2097152,
			Digest: kvsp.Digest{1}, LayerDigests: []kvsp.LayerDigest{{1}}, TTLMs: 60000,
			Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 0}}}}
		if _, err := w.mem.Put(ctx, r, time.Minute, index.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	frontB := mk(clientB).Controller(w.srv.URL("/pc/"))
	placedB := map[string]int{}
	for range 100 {
		out, err := frontB.Place(ctx, &kvsp.PlaceRequest{ScopeID: scopeB.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16})
		if err != nil {
			t.Fatal(err)
		}
		placedB[out.Instance]++
		w.track(t, out, scopeB)
		ii3()                                            // its status keeps showing nothing queued
		w.status(t, "ii1", 1, 5, kvsp.StateActive, link) // and theirs room: what was placed is running
		w.status(t, "ii2", 1, 5, kvsp.StateActive, link)
	}
	if placedB[w.base["ii3"]] != 0 || placedB[w.base["ii1"]]+placedB[w.base["ii2"]] != 100 {
		t.Fatalf("scope B's requests: %v; none may go to ii3 (%s)", placedB, w.base["ii3"])
	}
	for _, d := range w.ii[w.base["ii3"]].sent() {
		if d.ScopeID == scopeB.ID() {
			t.Fatal("ii3 was sent a directive of scope B")
		}
	}
	sentB := 0
	for _, n := range []string{"ii1", "ii2"} {
		for _, d := range w.ii[w.base[n]].sent() {
			if d.ScopeID == scopeB.ID() {
				sentB++
			}
		}
	}
	if sentB == 0 {
		t.Fatal("no directive of scope B was sent at all: the test proves nothing")
	}
	// The paired positive: scope A's requests go to ii3, with directives.
	out, err := w.place(t, tokens)
	if err != nil || out.Instance != w.base["ii3"] || out.Directive == nil {
		t.Fatalf("scope A's request: %+v %v; want ii3 with a directive", out, err)
	}
	// A shard map of scope B naming ii3.
	m := kvsp.ShardMap{Map: "b12", Version: 1, Shards: []kvsp.Shard{{Tokens: kvsp.TokenRange{0, 4 * bt}, Instance: w.base["ii3"]}}}
	if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: m, ScopeID: scopeB.ID(), CompatID: compat, Tokens: tokens}); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Fatalf("a map of scope B on ii3: %v", err)
	}
	// The policy in force counts: without scope A, ii3 serves nobody, and
	// the session placed on it moves (its resume goes elsewhere).
	policy("")
	ii3()
	if out, err := w.place(t, tokens); err != nil || out.Instance == w.base["ii3"] {
		t.Fatalf("scope A's request after ii3 lost the scope: %+v %v", out, err)
	}
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16, Session: &out.Session}
	moved, err := w.front.Controller(w.srv.URL("/pc/")).Place(ctx, q)
	if err != nil || moved.Instance == w.base["ii3"] || moved.Epoch != 2 {
		t.Fatalf("the session on ii3 after it lost the scope: %+v %v; want it moved at epoch 2", moved, err)
	}
	if rs := w.ii[moved.Instance].resumed(); len(rs) != 1 || rs[0].Checkpoint.Session != out.Session {
		t.Fatalf("resumes at %s: %+v", moved.Instance, rs)
	}
	if rs := w.ii[w.base["ii3"]].resumed(); len(rs) != 0 {
		t.Fatalf("ii3 was sent %d resumes after it lost the scope", len(rs))
	}
}

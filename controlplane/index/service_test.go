package index_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

const (
	h1   = "https://127.0.0.1/h1/"
	ii7  = "https://ii7.example/kvsp/"
	ii9  = "https://ii9.example/kvsp/"
	pol2 = kvsptest.Policy + `  - {id: "spiffe://kvsp.test/holder/h2", roles: [holder], speaks_for: ["https://127.0.0.1/h2/"], scopes: [` + kvsptest.Scope + `]}
  - {id: "spiffe://kvsp.test/holder/h1-other", roles: [holder], speaks_for: ["https://127.0.0.1/h1/"], scopes: [aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa]}
  - {id: "spiffe://kvsp.test/client/b", roles: [client], scopes: [bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb]}
  - {id: "spiffe://kvsp.test/instance/ii1", roles: [instance], speaks_for: ["https://127.0.0.1/ii1/"], scopes: [` + kvsptest.Scope + `]}
`
)

var scope, _ = kvsp.ParseScopeID(kvsptest.Scope)

type fixture struct {
	status *index.StatusTable
	pki    *kvsptest.PKI
	srv    *kvsptest.Server
}

func start(t *testing.T) *fixture {
	f := &fixture{status: index.NewStatusTable(), pki: kvsptest.NewPKI(t)}
	mem := index.NewMemory(time.Second)
	t.Cleanup(func() { mem.Close() })
	svc, err := index.New(index.Config{MaxTTL: time.Minute, MaxLookupKeys: 8, Status: f.status,
		BlockTokens: func(kvsp.CompatID) (int, bool) { return 16, true }}, mem)
	if err != nil {
		t.Fatal(err)
	}
	f.srv = kvsptest.StartServer(t, f.pki, kvsptest.Options{Policy: pol2}, func(s *server.Server) {
		if err := svc.Mount(s.Mount("/is/")); err != nil {
			t.Fatal(err)
		}
	})
	return f
}

func (f *fixture) client(t *testing.T, id string) *client.Index {
	c, err := client.New(client.Config{TLS: f.pki.ClientTLS(f.pki.Leaf(id))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c.Index(f.srv.URL("/is/"))
}

func rec(holder string, k byte, ttl uint64) *kvsp.ReplicaRecord {
	return &kvsp.ReplicaRecord{BlockKey: kvsp.BlockKey{k, 1}, CompatID: kvsp.CompatID{1}, ScopeID: scope, Holder: holder, Codec: 1,
		Size: 2097152, Digest: kvsp.Digest{1}, Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 31}}}, TTLMs: ttl}
}

func keys(ks ...byte) []kvsp.BlockKey {
	out := make([]kvsp.BlockKey, len(ks))
	for i, k := range ks {
		out[i] = kvsp.BlockKey{k, 1}
	}
	return out
}

// TestPublishRules: who may publish what, the TTL cap echoed, 201 then 200
// (R-IS-2, R-IS-3, R-IS-5, R-IS-6, A-28).
func TestPublishRules(t *testing.T) {
	f := start(t)
	ctx := context.Background()
	h := f.client(t, kvsptest.Holder1)
	got, created, err := h.Publish(ctx, rec(h1, 1, 9007199254740991))
	if err != nil || !created || got.TTLMs != 60000 {
		t.Fatalf("publish: %+v %v %v", got, created, err)
	}
	if _, created, err := h.Publish(ctx, rec(h1, 1, 1000)); err != nil || created {
		t.Fatalf("refresh: %v %v", created, err)
	}
	if _, _, err := f.client(t, "spiffe://kvsp.test/holder/h2").Publish(ctx, rec(h1, 2, 1000)); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("h2 publishing for h1: %v", err)
	}
	if _, _, err := f.client(t, "spiffe://kvsp.test/holder/h1-other").Publish(ctx, rec(h1, 2, 1000)); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Fatalf("holder outside the scope: %v", err)
	}
	if _, _, err := f.client(t, kvsptest.ClientA).Publish(ctx, rec(h1, 2, 1000)); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("a client publishing: %v", err)
	}
	// Withdraw: 204, then unknown (the client treats 404 as done).
	if err := h.Withdraw(ctx, h1, kvsp.BlockKey{1, 1}); err != nil {
		t.Fatal(err)
	}
	if err := f.client(t, "spiffe://kvsp.test/holder/h2").Withdraw(ctx, h1, kvsp.BlockKey{1, 1}); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("h2 withdrawing for h1: %v", err)
	}
}

// TestTTLsPastDurationsRange: ttl_ms may be anything up to 2^53-1,
// past what a time.Duration holds (about 106 days of milliseconds); such
// a TTL is capped at index.max_ttl_ms, for a replica and for a producer's
// statement alike, never wrapped into a negative one that answered
// ttl_ms 0 (what schemathesis found on PUT producers/{key}).
func TestTTLsPastDurationsRange(t *testing.T) {
	f := start(t)
	ctx := context.Background()
	got, _, err := f.client(t, kvsptest.Holder1).Publish(ctx, rec(h1, 7, kvsp.MaxJSONInt))
	if err != nil || got.TTLMs != 60000 {
		t.Fatalf("publish: %+v %v", got, err)
	}
	for _, ttl := range []uint64{kvsp.MaxJSONInt, 1 << 44} {
		st, err := f.client(t, "spiffe://kvsp.test/instance/ii1").StateDigest(ctx, &kvsp.ProducerRecord{BlockKey: kvsp.BlockKey{8, byte(ttl)}, ScopeID: scope,
			CompatID: kvsp.CompatID{1}, Producer: "https://127.0.0.1/ii1/", Digest: kvsp.Digest{2}, TTLMs: ttl})
		if err != nil || st.TTLMs != 60000 {
			t.Fatalf("statement of ttl_ms %d: %+v %v", ttl, st, err)
		}
	}
	if kvsp.Millis(kvsp.MaxJSONInt) <= 0 || kvsp.Millis(1500) != 1500*time.Millisecond {
		t.Fatal("kvsp.Millis")
	}
}

// TestLookupRules: the scope pair (same scope matches, which proves the
// cache works; another scope is 403 before any probe), the size quota, and
// estimates (R-IS-13..18, R-PLC-1..6, A-3, A-11, A-21, A-22, A-27).
func TestLookupRules(t *testing.T) {
	f := start(t)
	ctx := context.Background()
	h := f.client(t, kvsptest.Holder1)
	for _, k := range []byte{1, 2, 4} {
		if _, _, err := h.Publish(ctx, rec(h1, k, 60000)); err != nil {
			t.Fatal(err)
		}
	}
	a := f.client(t, kvsptest.ClientA)
	q := &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: keys(1, 2, 3, 4)}
	resp, err := a.Lookup(ctx, q)
	if err != nil || resp.Matched != 2 || len(resp.Replicas) != 2 || resp.Replicas[1][0].BlockKey != (kvsp.BlockKey{2, 1}) {
		t.Fatalf("same scope: %+v %v", resp, err)
	}
	if _, err := f.client(t, "spiffe://kvsp.test/client/b").Lookup(ctx, q); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Fatalf("other scope: %v", err)
	}
	big := &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: keys(1, 2, 3, 4, 5, 6, 7, 8, 9)}
	_, err = a.Lookup(ctx, big)
	var p *kvsp.Problem
	if !errors.As(err, &p) || p.Status != 413 || p.Extensions["max_block_keys"] != float64(8) {
		t.Fatalf("9 keys with a limit of 8: %v", err)
	}

	// Estimates: ii7 reaches h1 at 200000 Mbit/s with 12 us RTT; ii9 has no
	// status. One matched block of 2097152 octets: 12 + 8*2097152/200000 =
	// 95.9 -> 96 us; recompute 1e6*16/42000 = 380.95 -> 381 us (R-PLC-2,
	// R-PLC-6).
	f.status.Update(kvsp.InstanceStatus{Instance: ii7, Epoch: 1, State: kvsp.StateActive, PrefillTokensPerS: 42000,
		Links: []kvsp.Link{{Holder: h1, MbitPerS: 200000, RTTUs: 12}}, TTLMs: 3000})
	q1 := &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: keys(1), Targets: []string{ii7, ii9}}
	resp, err = a.Lookup(ctx, q1)
	if err != nil || len(resp.Targets) != 1 || resp.Targets[0] != (kvsp.TargetEstimate{Instance: ii7, FetchUs: 96, RecomputeUs: 381}) {
		t.Fatalf("estimates: %+v %v", resp, err)
	}
}

// TestEstimate covers A-21 directly: storage tier rates, residency at the
// target, greedy choice between sources, and missing links.
func TestEstimate(t *testing.T) {
	st := &kvsp.InstanceStatus{Instance: ii7, PrefillTokensPerS: 42000, Links: []kvsp.Link{
		{Holder: "https://a/", MbitPerS: 200000, RTTUs: 12}, {Holder: "https://b/", MbitPerS: 100000, RTTUs: 5}}}
	r := func(holder string, res ...kvsp.Residency) kvsp.ReplicaRecord {
		return kvsp.ReplicaRecord{Holder: holder, Size: 2000000, Residency: res}
	}
	host := kvsp.Residency{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 31}}
	disk := kvsp.Residency{Tier: kvsp.TierLocalStorage, Layers: kvsp.LayerRange{0, 31}, ReadMbitPerS: 1000}
	for _, c := range []struct {
		name  string
		reps  [][]kvsp.ReplicaRecord
		fetch uint64
		ok    bool
	}{
		{"one block from a", [][]kvsp.ReplicaRecord{{r("https://a/", host)}}, 92, true},                  // 12 + 80
		{"R-PLC-5 storage tier read rate", [][]kvsp.ReplicaRecord{{r("https://a/", disk)}}, 16012, true}, // 12 + 16000
		{"split residency", [][]kvsp.ReplicaRecord{{r("https://a/",
			kvsp.Residency{Tier: kvsp.TierDevice, Layers: kvsp.LayerRange{0, 15}},
			kvsp.Residency{Tier: kvsp.TierLocalStorage, Layers: kvsp.LayerRange{16, 31}, ReadMbitPerS: 1000})}}, 8052, true}, // 12 + 40 + 8000
		{"R-PLC-3 resident at the target", [][]kvsp.ReplicaRecord{{r(ii7, host)}}, 0, true},
		{"greedy over two sources", [][]kvsp.ReplicaRecord{
			{r("https://a/", host), r("https://b/", host)},
			{r("https://a/", host), r("https://b/", host)}}, 165, true}, // a: 12+80; b: 5+160 -> max 165
		{"no link to the only source", [][]kvsp.ReplicaRecord{{r("https://c/", host)}}, 0, false},
	} {
		f, rc, ok := index.Estimate(st, c.reps, 16)
		if ok != c.ok || (ok && f != c.fetch) {
			t.Errorf("%s: fetch %d ok %v, want %d %v", c.name, f, ok, c.fetch, c.ok)
		}
		if ok && rc != uint64((1e6*16*float64(len(c.reps))+41999)/42000) {
			t.Errorf("%s: recompute %d", c.name, rc)
		}
	}
	if _, _, ok := index.Estimate(&kvsp.InstanceStatus{}, nil, 16); ok {
		t.Error("no prefill rate, yet an estimate")
	}
}

// TestLookupRedisDown: with the shared store gone, a lookup is a clear 503
// problem (not a miss); once Redis is back and holders republish, lookups
// match again. The service's metrics count what happened.
func TestLookupRedisDown(t *testing.T) {
	red := kvsptest.StartRedis(t)
	rb, err := index.NewRedis(context.Background(), index.RedisConfig{Addrs: []string{red.Addr}, Password: kvsptest.RedisPassword, Timeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer rb.Close()
	reg := prometheus.NewRegistry()
	svc, err := index.New(index.Config{MaxTTL: time.Minute, MaxLookupKeys: 8, Registerer: reg}, rb)
	if err != nil {
		t.Fatal(err)
	}
	p := kvsptest.NewPKI(t)
	srv := kvsptest.StartServer(t, p, kvsptest.Options{Policy: pol2}, func(s *server.Server) { svc.Mount(s.Mount("/is/")) })
	mk := func(id string) *client.Index {
		c, _ := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(id)), Attempts: 1})
		t.Cleanup(c.Close)
		return c.Index(srv.URL("/is/"))
	}
	h, a := mk(kvsptest.Holder1), mk(kvsptest.ClientA)
	ctx := context.Background()
	q := &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: keys(1)}
	if _, _, err := h.Publish(ctx, rec(h1, 1, 60000)); err != nil {
		t.Fatal(err)
	}
	if resp, err := a.Lookup(ctx, q); err != nil || resp.Matched != 1 {
		t.Fatalf("before: %v %v", resp, err)
	}
	red.Kill()
	_, err = a.Lookup(ctx, q)
	var prob *kvsp.Problem
	if !errors.As(err, &prob) || prob.Status != 503 || !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("lookup with Redis down: %v", err)
	}
	red.Restart()
	if resp, err := a.Lookup(ctx, q); err != nil || resp.Matched != 0 {
		t.Fatalf("after restart, before republish: %v %v", resp, err)
	}
	if _, _, err := h.Publish(ctx, rec(h1, 1, 60000)); err != nil {
		t.Fatal(err)
	}
	if resp, err := a.Lookup(ctx, q); err != nil || resp.Matched != 1 {
		t.Fatalf("after republish: %v %v", resp, err)
	}
	if n := testutil.ToFloat64(counter(t, reg, "kvsp_index_lookups_total")); n != 3 {
		t.Errorf("lookups_total = %v, want 3 (the failed one is not counted)", n)
	}
	if n := testutil.ToFloat64(counter(t, reg, "kvsp_index_publishes_total")); n != 2 {
		t.Errorf("publishes_total = %v, want 2", n)
	}
}

func counter(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
			c.Add(mf.GetMetric()[0].GetCounter().GetValue())
			return c
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

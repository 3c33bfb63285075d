package placement

import (
	"math"
	"testing"

	"github.com/kvsp/kvsp"
)

// TestCost checks the cost model against hand-computed cases (R-PLC-2..8).
func TestCost(t *testing.T) {
	const h1, h2, ii = "https://h1.example/kvsp/", "https://h2.example/kvsp/", "https://ii7.example/kvsp/"
	st := func(queued uint64, links ...kvsp.Link) *kvsp.InstanceStatus {
		return &kvsp.InstanceStatus{Instance: ii, Queued: queued, PrefillTokensPerS: 42000, Links: append([]kvsp.Link{}, links...)}
	}
	rec := func(holder string, tier kvsp.Tier, rate uint64) kvsp.ReplicaRecord {
		return kvsp.ReplicaRecord{Holder: holder, Size: 2097152, Residency: []kvsp.Residency{{Tier: tier, Layers: kvsp.LayerRange{0, 31}, ReadMbitPerS: rate}}}
	}
	fast := kvsp.Link{Holder: h1, MbitPerS: 200000, RTTUs: 12}
	const B = 16
	for _, c := range []struct {
		name                               string
		st                                 *kvsp.InstanceStatus
		serviceUs                          float64
		replicas                           [][]kvsp.ReplicaRecord
		tokens                             int
		wait, fetch, unmatched, all, total float64
		useCache                           bool
	}{
		{name: "R-PLC-2 one block from h1: 12 + 8x2097152/200000 = 95.9, rounded up",
			st: st(0, fast), replicas: [][]kvsp.ReplicaRecord{{rec(h1, kvsp.TierHost, 0)}}, tokens: 16,
			fetch: 96, unmatched: 0, all: 1e6 * 16 / 42000.0, total: 96, useCache: true},
		{name: "R-PLC-3 resident at the instance: fetch 0",
			st: st(0), replicas: [][]kvsp.ReplicaRecord{{rec(ii, kvsp.TierDevice, 0)}}, tokens: 20,
			fetch: 0, unmatched: 1e6 * 4 / 42000.0, all: 1e6 * 20 / 42000.0, total: 1e6 * 4 / 42000.0, useCache: true},
		{name: "R-PLC-5 local-storage at 1000 Mbit/s: 12 + 8x2097152/1000; recompute (381 us) is cheaper",
			st: st(0, fast), replicas: [][]kvsp.ReplicaRecord{{rec(h1, kvsp.TierLocalStorage, 1000)}}, tokens: 16,
			fetch: 16790, unmatched: 0, all: 1e6 * 16 / 42000.0, total: 1e6 * 16 / 42000.0, useCache: false},
		{name: "R-PLC-7 wait: queued 3 x 10 ms",
			st: st(3, fast), serviceUs: 10000, replicas: nil, tokens: 8,
			wait: 30000, unmatched: 1e6 * 8 / 42000.0, all: 1e6 * 8 / 42000.0, total: 30000 + 1e6*8/42000.0},
		{name: "no link to the source: recompute all",
			st: st(0), replicas: [][]kvsp.ReplicaRecord{{rec(h2, kvsp.TierHost, 0)}}, tokens: 32,
			unmatched: 1e6 * 16 / 42000.0, all: 1e6 * 32 / 42000.0, total: 1e6 * 32 / 42000.0},
		{name: "R-PLC-2 two sources: the slower one bounds fetch",
			st:       st(0, fast, kvsp.Link{Holder: h2, MbitPerS: 100000, RTTUs: 50}),
			replicas: [][]kvsp.ReplicaRecord{{rec(h1, kvsp.TierHost, 0)}, {rec(h2, kvsp.TierHost, 0)}}, tokens: 48,
			fetch: math.Ceil(50 + 8*2097152/100000.0), unmatched: 1e6 * 16 / 42000.0, all: 1e6 * 48 / 42000.0,
			total: math.Ceil(50+8*2097152/100000.0) + 1e6*16/42000.0, useCache: true},
	} {
		got := costAt(c.st, c.serviceUs, c.replicas, B, c.tokens)
		near := func(a, b float64) bool { return math.Abs(a-b) < 1e-6 }
		if !near(got.WaitUs, c.wait) || !near(got.FetchUs, c.fetch) || !near(got.RecomputeUnmatchedUs, c.unmatched) ||
			!near(got.RecomputeAllUs, c.all) || !near(got.Total, c.total) || got.Fetch != c.useCache {
			t.Errorf("%s:\n got %+v\nwant wait %v fetch %v unmatched %v all %v total %v fetch? %v", c.name, got, c.wait, c.fetch, c.unmatched, c.all, c.total, c.useCache)
		}
	}
}

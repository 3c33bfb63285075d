package placement_test

import (
	"reflect"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
)

func shardMap(v uint64, s ...any) kvsp.ShardMap {
	m := kvsp.ShardMap{Map: "m", Version: v}
	for i := 0; i < len(s); i += 3 {
		m.Shards = append(m.Shards, kvsp.Shard{Tokens: kvsp.TokenRange{uint64(s[i].(int)), uint64(s[i+1].(int))}, Instance: s[i+2].(string)})
	}
	return m
}

type r = kvsp.TokenRange

// TestPlanReshard: every instance of either version gets a plan from v to
// v+1 (R-RSH-3); a range an instance holds in both versions is in its
// retain list (R-RSH-5) and in no fetch (R-RSH-6); gained ranges are
// fetched from their owner in v, split at v's shard boundaries; lost ranges
// are released. The spec's example: ii1 keeps [0,32768).
func TestPlanReshard(t *testing.T) {
	const a, b, c, d = "https://ii1/", "https://ii2/", "https://ii3/", "https://ii4/"
	type want struct {
		retain, release []r
		fetch           []kvsp.ReshardFetch
	}
	for name, tc := range map[string]struct {
		cur, next kvsp.ShardMap
		want      map[string]want
	}{
		"spec example: three to two": {
			cur:  shardMap(4, 0, 32768, a, 32768, 65536, b, 65536, 98304, c),
			next: shardMap(5, 0, 49152, a, 49152, 98304, c),
			want: map[string]want{
				a: {retain: []r{{0, 32768}}, release: []r{}, fetch: []kvsp.ReshardFetch{{Tokens: r{32768, 49152}, From: b}}},
				b: {retain: []r{}, release: []r{{32768, 65536}}, fetch: []kvsp.ReshardFetch{}},
				c: {retain: []r{{65536, 98304}}, release: []r{}, fetch: []kvsp.ReshardFetch{{Tokens: r{49152, 65536}, From: b}}},
			},
		},
		"first map: fetched through the IS by each member": {
			cur:  kvsp.ShardMap{Map: "m"},
			next: shardMap(1, 0, 64, a, 64, 128, b),
			want: map[string]want{
				a: {retain: []r{}, release: []r{}, fetch: []kvsp.ReshardFetch{{Tokens: r{0, 64}, From: a}}},
				b: {retain: []r{}, release: []r{}, fetch: []kvsp.ReshardFetch{{Tokens: r{64, 128}, From: b}}},
			},
		},
		"a gained range spans two old owners": {
			cur:  shardMap(1, 0, 32, a, 32, 64, b, 64, 96, c),
			next: shardMap(2, 0, 16, a, 16, 80, d, 80, 96, c),
			want: map[string]want{
				a: {retain: []r{{0, 16}}, release: []r{{16, 32}}, fetch: []kvsp.ReshardFetch{}},
				b: {retain: []r{}, release: []r{{32, 64}}, fetch: []kvsp.ReshardFetch{}},
				c: {retain: []r{{80, 96}}, release: []r{{64, 80}}, fetch: []kvsp.ReshardFetch{}},
				d: {retain: []r{}, release: []r{}, fetch: []kvsp.ReshardFetch{{Tokens: r{16, 32}, From: a}, {Tokens: r{32, 64}, From: b}, {Tokens: r{64, 80}, From: c}}},
			},
		},
		"two shards of one instance merge; nothing moves": {
			cur:  shardMap(1, 0, 16, a, 16, 32, a),
			next: shardMap(2, 0, 32, a),
			want: map[string]want{a: {retain: []r{{0, 32}}, release: []r{}, fetch: []kvsp.ReshardFetch{}}},
		},
	} {
		plans := placement.PlanReshard(tc.cur, tc.next)
		if len(plans) != len(tc.want) {
			t.Errorf("%s: %d plans, want %d", name, len(plans), len(tc.want))
		}
		for inst, w := range tc.want {
			p := plans[inst]
			if p == nil || p.Kind != kvsp.ReshardPlan || p.From != tc.cur.Version || p.To != tc.next.Version {
				t.Errorf("%s: %s: plan %+v", name, inst, p)
				continue
			}
			if !reflect.DeepEqual(p.Retain, w.retain) || !reflect.DeepEqual(p.Release, w.release) || !reflect.DeepEqual(p.Fetch, w.fetch) {
				t.Errorf("%s: %s: retain %v release %v fetch %v; want %v %v %v", name, inst, p.Retain, p.Release, p.Fetch, w.retain, w.release, w.fetch)
			}
			for _, f := range p.Fetch { // R-RSH-6
				for _, x := range p.Retain {
					if f.Tokens[0] < x[1] && x[0] < f.Tokens[1] {
						t.Errorf("%s: %s fetches retained tokens %v", name, inst, x)
					}
				}
			}
		}
	}
}

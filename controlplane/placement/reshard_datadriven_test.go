package placement_test

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cockroachdb/datadriven"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
)

// TestReshardPlans runs testdata/reshard, the plans a reshard sends each
// member (R-RSH-3, R-RSH-5, R-RSH-6), as a script. Its one command:
//
//	plan
//	cur vN: A-B NAME, A-B NAME, ...    (vN: alone, a context with no map)
//	next vM: A-B NAME, ...
//
// prints each member's plan, members in order: what it retains, fetches
// (and from whom) and releases.
func TestReshardPlans(t *testing.T) {
	uri := func(name string) string { return "https://" + name + "/" }
	name := func(u string) string { return strings.TrimSuffix(strings.TrimPrefix(u, "https://"), "/") }
	parse := func(t *testing.T, line, want string) kvsp.ShardMap {
		head, body, _ := strings.Cut(strings.TrimSpace(strings.TrimPrefix(line, want)), ":")
		v, err := strconv.ParseUint(strings.TrimPrefix(strings.TrimSpace(head), "v"), 10, 64)
		if !strings.HasPrefix(line, want+" ") || err != nil {
			t.Fatalf("%q: want %q vN: shards", line, want)
		}
		m := kvsp.ShardMap{Map: "m", Version: v}
		for _, s := range strings.Split(body, ",") {
			if s = strings.TrimSpace(s); s == "" {
				continue
			}
			var a, b uint64
			var inst string
			if _, err := fmt.Sscanf(s, "%d-%d %s", &a, &b, &inst); err != nil {
				t.Fatalf("shard %q: want A-B NAME", s)
			}
			m.Shards = append(m.Shards, kvsp.Shard{Tokens: kvsp.TokenRange{a, b}, Instance: uri(inst)})
		}
		if len(m.Shards) > 0 {
			if err := m.Validate(); err != nil {
				t.Fatalf("%q: %v", line, err)
			}
		}
		return m
	}
	ranges := func(rs []kvsp.TokenRange) string {
		if len(rs) == 0 {
			return "none"
		}
		var out []string
		for _, r := range rs {
			out = append(out, fmt.Sprintf("[%d,%d)", r[0], r[1]))
		}
		return strings.Join(out, " ")
	}
	datadriven.RunTest(t, "testdata/reshard", func(t *testing.T, d *datadriven.TestData) string {
		if d.Cmd != "plan" {
			t.Fatalf("unknown command %q", d.Cmd)
		}
		lines := strings.Split(strings.TrimSpace(d.Input), "\n")
		if len(lines) != 2 {
			t.Fatalf("plan: want a cur and a next line")
		}
		cur, next := parse(t, lines[0], "cur"), parse(t, lines[1], "next")
		plans := placement.PlanReshard(cur, next)
		members := make([]string, 0, len(plans))
		for m := range plans {
			members = append(members, m)
		}
		slices.Sort(members)
		var b strings.Builder
		for _, m := range members {
			p := plans[m]
			var fetch []string
			for _, f := range p.Fetch {
				fetch = append(fetch, fmt.Sprintf("[%d,%d) from %s", f.Tokens[0], f.Tokens[1], name(f.From)))
			}
			if len(fetch) == 0 {
				fetch = []string{"none"}
			}
			fmt.Fprintf(&b, "%s v%d->v%d: retain %s; fetch %s; release %s\n", name(m), p.From, p.To, ranges(p.Retain), strings.Join(fetch, ", "), ranges(p.Release))
		}
		return b.String()
	})
}

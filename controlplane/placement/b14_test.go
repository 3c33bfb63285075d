package placement_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
)

// TestB14_PlaceRefusesWhatNoInstanceCanRun (RELIABILITY B14, red team
// D7): ii1 and ii2 report a vocabulary of 256 tokens, a context of 64 and
// at most 48 output tokens, as a llama.cpp instance's status does; ii3 a
// vocabulary of 512. A place with a token id past every vocabulary (512,
// 2^32-1), a prompt past the context, max_tokens past the context or the
// instances' output limit, or 2^53-1, is 400 naming the member, before any
// instance is chosen: no lookup, no session, no room taken, no directive.
// A token only ii3's vocabulary has goes to ii3; a request within the
// limits is placed (the paired positive).
func TestB14_PlaceRefusesWhatNoInstanceCanRun(t *testing.T) {
	reg := prometheus.NewRegistry()
	w := newWorldWith(t, 1000, func(c *placement.Config) { c.Registerer = reg })
	ctx := context.Background()
	report := func(name string, vocab uint64) {
		st := &kvsp.InstanceStatus{Instance: w.base[name], Epoch: 1, State: kvsp.StateActive, BatchSize: 4, PrefillTokensPerS: 42000,
			DecodeTokensPerS: 3100, Links: []kvsp.Link{}, TTLMs: 60000, CompatID: compat, VocabSize: vocab, ContextTokens: 64, MaxOutputTokens: 48}
		if _, err := w.ctl.PutStatus(ctx, st); err != nil {
			t.Fatal(err)
		}
	}
	report("ii1", 256)
	report("ii2", 256)
	report("ii3", 512)
	small := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(i % 200)
		}
		return out
	}
	w.publish(t, small(40), 2) // a cached prefix: a placement would look it up and send a directive
	front := w.front.Controller(w.srv.URL("/pc/"))
	lookups := func() float64 { return counterSum(t, reg, "kvsp_pc_lookups_total") }
	for _, tc := range []struct {
		name      string
		tokens    []uint32
		maxTokens uint64
		member    string
	}{
		{"token past every vocabulary", append(small(40), 512), 8, "tokens[40]"},
		{"token 2^32-1", append(small(3), math.MaxUint32, 5), 8, "tokens[3]"},
		{"prompt past the context", small(65), 1, "tokens"},
		{"max_tokens past the context", small(40), 25, "max_tokens"},
		{"max_tokens past the output limit", small(8), 49, "max_tokens"},
		{"max_tokens 2^53-1", small(40), 1<<53 - 1, "max_tokens"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := lookups()
			_, err := front.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tc.tokens, MaxTokens: tc.maxTokens})
			var p *kvsp.Problem
			if !errors.As(err, &p) || p.Status != 400 || !errors.Is(err, kvsp.ErrInvalid) {
				t.Fatalf("place: %v; want 400 kvsp-invalid", err)
			}
			if !strings.Contains(p.Detail, tc.member+":") {
				t.Fatalf("the problem's detail %q does not name %s", p.Detail, tc.member)
			}
			if m, ok := p.Extensions["member"]; ok && m != tc.member {
				t.Fatalf("member %v, want %s", m, tc.member)
			}
			if got := lookups(); got != before {
				t.Fatalf("the refused place looked its prefix up (%v lookups, %v before): an instance was being chosen", got, before)
			}
		})
	}
	if n := len(w.pc.Sessions()); n != 0 {
		t.Fatalf("%d sessions created by refused places", n)
	}
	for _, name := range []string{"ii1", "ii2", "ii3"} {
		if s, _ := w.pc.Registry().Get(w.base[name]); s.Placed != 0 {
			t.Fatalf("%s: %d placements hold room after refused places", name, s.Placed)
		}
		if d := w.ii[w.base[name]].sent(); len(d) != 0 {
			t.Fatalf("%s was sent %d directives for refused places", name, len(d))
		}
	}
	// A token in ii3's vocabulary only: placed there, not refused.
	out, err := front.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: append(small(10), 300), MaxTokens: 8})
	if err != nil || out.Instance != w.base["ii3"] {
		t.Fatalf("a token of ii3's vocabulary: %+v %v; want ii3", out, err)
	}
	// The paired positive: within every limit, placed.
	if out, err := front.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: small(40), MaxTokens: 24}); err != nil || out.Session.IsZero() {
		t.Fatalf("a request within the limits: %+v %v", out, err)
	}
}

// counterSum sums the series of a counter family in reg.
func counterSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestTextDemo (issue 50): kvsp demo on the text workload's first four
// requests, through the gateway on SmolLM2 and three llama.cpp
// instances, in the kvsp and none modes. The follow-up (request 3) finds
// the chat it extends cached in the kvsp mode (computed after its parent
// was answered: nothing races) and nothing with no cache; the greedy
// answers are the same text in both modes; the report has the members
// tools read. About a minute of three llama.cpp engines: make test-slow
// runs it (KVSP_SLOW=1), alone.
func TestTextDemo(t *testing.T) {
	if os.Getenv("KVSP_SLOW") != "1" {
		t.Skip("a minute of real prefill: make test-slow runs it (KVSP_SLOW=1)")
	}
	requireLlama(t)
	gguf := kvsptest.SmolLM2(t)
	jsonPath := filepath.Join(t.TempDir(), "demo.json")
	code, out, errs := runCLI(t, "demo", "-requests", "4", "-modes", "kvsp,none", "-model", gguf, "-json", jsonPath, "-png", "")
	if code != 0 {
		t.Fatalf("exit %d: %s\n%s", code, errs, out)
	}
	t.Log(out)
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rep textDemoReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	var top map[string]any
	if err := json.Unmarshal(b, &top); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"engine", "model", "bound_ratio", "hit_ratio", "requests", "errors", "modes"} {
		if _, ok := top[k]; !ok {
			t.Errorf("the report has no %q", k)
		}
	}
	kv, no := rep.Modes["kvsp"], rep.Modes["none"]
	if rep.Engine != "llamacpp" || rep.Requests != 4 || rep.Errors != 0 || kv == nil || no == nil || rep.Sample != 3 {
		t.Fatalf("report: %+v", rep)
	}
	if !strings.Contains(rep.Model, "Smollm2") || rep.BoundRatio <= 0 || rep.HitRatio != kv.HitRatio {
		t.Errorf("model %q, bound %v, hit ratio %v (kvsp mode's %v)", rep.Model, rep.BoundRatio, rep.HitRatio, kv.HitRatio)
	}
	// Request 3 extends request 2's chat of 767 tokens: 752 of its 875
	// tokens are in blocks request 2 computed (the workload's bound).
	if kv.CachedTokens < 752 || no.CachedTokens != 0 || kv.HitRatio <= 0 || kv.FetchedOctets+kv.StoredOctets == 0 || no.StoredOctets != 0 {
		t.Errorf("cached tokens: kvsp %d (hit %v, %v fetched, %v stored), none %d", kv.CachedTokens, kv.HitRatio, kv.FetchedOctets, kv.StoredOctets, no.CachedTokens)
	}
	for name, m := range rep.Modes {
		if m.Errors != 0 || m.TTFT.P50 <= 0 || m.TTFT.P90 < m.TTFT.P50 || m.TTFT.P99 != nil || m.Latency.P50 < m.TTFT.P50 ||
			m.OutputTokens <= 0 || m.PrefillRate <= 0 || m.CPUSeconds <= 0 || m.Answer == "" {
			t.Errorf("mode %s: %+v", name, m)
		}
	}
	if kv.Answer != no.Answer {
		t.Errorf("the greedy answer differs: kvsp %q, none %q", kv.Answer, no.Answer)
	}
	if !strings.Contains(out, "request 3 asks") || !strings.Contains(out, strconv.Quote(kv.Answer)) {
		t.Errorf("the output does not print the sample answer:\n%s", out)
	}
}

// TestTextDemoWithoutTheModel: a missing model is one clear line naming
// where it was looked for and how to install it, before anything starts.
func TestTextDemoWithoutTheModel(t *testing.T) {
	code, _, errs := runCLI(t, "demo", "-model", filepath.Join(t.TempDir(), "none.gguf"))
	if code != 1 || strings.Count(strings.TrimSpace(errs), "\n") != 0 || !strings.Contains(errs, "none.gguf") || !strings.Contains(errs, "make deps") {
		t.Fatalf("exit %d: %q", code, errs)
	}
}

// TestTextHolds: --require names each bound a run misses.
func TestTextHolds(t *testing.T) {
	mode := func(hit, of, p50, p90 float64) *textModeReport {
		m := &textModeReport{HitRatio: hit, OfBound: of}
		m.TTFT.P50, m.TTFT.P90 = p50, p90
		return m
	}
	rep := func(k *textModeReport) *textDemoReport {
		return &textDemoReport{BoundRatio: 0.8, Modes: map[string]*textModeReport{"kvsp": k, "local": mode(0.5, 0.62, 9000, 30000), "none": mode(0, 0, 60000, 160000)}}
	}
	if got := textHolds(rep(mode(0.78, 0.975, 900, 8000)), 0.9); len(got) != 0 {
		t.Fatalf("a run within its bounds: %v", got)
	}
	for _, c := range []struct {
		k    *textModeReport
		want string
	}{
		{mode(0.70, 0.875, 900, 8000), "of the bound"},
		{mode(0.69, 0.9, 900, 8000), "0.2 above local"},
		{mode(0.78, 0.975, 9500, 8000), "not below local's"},
		{mode(0.78, 0.975, 900, 31000), "not below local's"},
	} {
		if got := strings.Join(textHolds(rep(c.k), 0.9), "; "); !strings.Contains(got, c.want) {
			t.Errorf("%+v: %q, want %q", c.k, got, c.want)
		}
	}
	if got := textHolds(&textDemoReport{Modes: map[string]*textModeReport{"kvsp": mode(1, 1, 1, 1)}}, 0.9); len(got) != 1 {
		t.Errorf("one mode: %v", got)
	}
}

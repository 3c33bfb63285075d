package main

import (
	"encoding/json"
	"fmt"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDemo: kvsp demo starts the whole system (IS, PC, holders with host
// and local-storage tiers, simulated instances, mutual TLS) and replays a
// trace whose requests share a prefix: every request succeeds, the
// instances reuse (by verified transfers) most of what an infinite cache
// would, the report and chart are written.
func TestDemo(t *testing.T) {
	dir := t.TempDir()
	var trace strings.Builder
	const n = 24
	for i := range n {
		// Four shared blocks, then one of its own; 2460 tokens: the four
		// shared blocks are complete.
		fmt.Fprintf(&trace, `{"timestamp": %d, "input_length": 2460, "output_length": 4, "hash_ids": [1, 2, 3, 4, %d]}`+"\n", i*250, 100+i)
	}
	tracePath := filepath.Join(dir, "trace.jsonl")
	os.WriteFile(tracePath, []byte(trace.String()), 0o644)
	jsonPath, pngPath := filepath.Join(dir, "d.json"), filepath.Join(dir, "d.png")
	code, out, errs := runCLI(t, "demo", "-trace", tracePath, "-speed", "1", "-host-capacity", "64MiB", "-disk-capacity", "64MiB",
		"-json", jsonPath, "-png", pngPath)
	if code != 0 {
		t.Fatalf("demo: %d\n%s\n%s", code, out, errs)
	}
	var rep demoReport
	data, _ := os.ReadFile(jsonPath)
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatal(err)
	}
	// Bound: requests 2..24 reuse 4 x 512 of 2460 tokens.
	wantBound := float64((n-1)*4*512) / float64(n*2460)
	if rep.Requests != n || rep.Errors != 0 || rep.BoundRatio < wantBound-1e-9 || rep.BoundRatio > wantBound+1e-9 {
		t.Fatalf("report %+v, bound want %v", rep, wantBound)
	}
	if rep.HitRatio < 0.8*rep.BoundRatio || rep.HitRatio > rep.BoundRatio+1e-9 || rep.Fetched == 0 {
		t.Fatalf("hit ratio %.3f of bound %.3f, %d tokens fetched:\n%s", rep.HitRatio, rep.BoundRatio, rep.Fetched, out)
	}
	if rep.CachedTokens+rep.Computed != int64(n*2460) {
		t.Fatalf("the instances report %d prompt tokens, the trace has %d", rep.CachedTokens+rep.Computed, n*2460)
	}
	for _, want := range []string{"prefix hit ratio", "TTFT p50 / p90", "lease rejections", "digest failures", "migrations"} {
		if !strings.Contains(out, want) {
			t.Errorf("the table lacks %q:\n%s", want, out)
		}
	}
	f, err := os.Open(pngPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := png.Decode(f); err != nil {
		t.Fatal(err)
	}
}

// TestDemoBadTrace: a trace line that is not a Mooncake request is an
// error naming the line, before anything starts.
func TestDemoBadTrace(t *testing.T) {
	p := filepath.Join(t.TempDir(), "bad.jsonl")
	os.WriteFile(p, []byte(`{"timestamp": 0, "input_length": 9999, "output_length": 1, "hash_ids": [1]}`+"\n"), 0o644)
	code, _, errs := runCLI(t, "demo", "-trace", p)
	if code != 1 || !strings.Contains(errs, "trace line 1") {
		t.Fatalf("exit %d: %s", code, errs)
	}
}

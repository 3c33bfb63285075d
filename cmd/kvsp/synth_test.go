package main

import (
	"errors"
	"slices"
	"testing"
)

// TestSynthTrace: the generated workload has the shape issue 47's longer
// workload had (12,031 requests over 59 minutes, about 24 blocks each,
// four times the embedded trace's 43,924 distinct blocks or more, an
// infinite-cache bound near 0.37), is the same for the same seed and
// another for another, and every request fits loadTrace's rules.
func TestSynthTrace(t *testing.T) {
	p, err := parseSynth("synth")
	if err != nil {
		t.Fatal(err)
	}
	reqs := synthTrace(p)
	if len(reqs) != 12031 {
		t.Fatalf("%d requests", len(reqs))
	}
	seen := map[int64]bool{}
	blocks, hits := 0, 0
	for i, q := range reqs {
		if i > 0 && q.Timestamp < reqs[i-1].Timestamp || q.Timestamp > 59*60_000 {
			t.Fatalf("request %d at %v ms: out of order or past 59 minutes", i, q.Timestamp)
		}
		if q.InputLength <= (len(q.HashIDs)-1)*traceBlockTokens || q.InputLength > len(q.HashIDs)*traceBlockTokens || q.OutputLength < 1 {
			t.Fatalf("request %d: input_length %d for %d blocks", i, q.InputLength, len(q.HashIDs))
		}
		prefix := true // keys chain: a block hits only after every block before it did
		for _, id := range q.HashIDs {
			prefix = prefix && seen[id]
			if prefix {
				hits++
			}
			seen[id] = true
		}
		blocks += len(q.HashIDs)
	}
	mean, bound := float64(blocks)/float64(len(reqs)), float64(hits)/float64(blocks)
	t.Logf("%d requests, %d distinct blocks, %.1f blocks a request, bound %.3f (by blocks)", len(reqs), len(seen), mean, bound)
	if len(seen) < 4*43924 || mean < 20 || mean > 28 || bound < 0.3 || bound > 0.45 {
		t.Fatalf("%d distinct blocks, %.1f a request, bound %.3f: not the shape asked for", len(seen), mean, bound)
	}
	again := synthTrace(p)
	if !slices.EqualFunc(reqs, again, func(a, b traceRequest) bool { return a.Timestamp == b.Timestamp && slices.Equal(a.HashIDs, b.HashIDs) }) {
		t.Fatal("the same seed gave another workload")
	}
	p.Seed++
	if other := synthTrace(p); slices.Equal(other[100].HashIDs, reqs[100].HashIDs) && other[100].Timestamp == reqs[100].Timestamp {
		t.Fatal("another seed gave the same workload")
	}
	for _, bad := range []string{"synth:requests=0", "synth:zipf=1", "synth:docs", "synth:unknown=3", "synth:doc-blocks=500,tail-blocks=20"} {
		if _, err := parseSynth(bad); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
	if _, err := openTrace("synth:requests=x"); !errors.As(err, new(usageErr)) {
		t.Errorf("a bad spec: %v, want a usage error", err)
	}
}

// TestRepeatTrace: each copy of the trace comes after the one before, its
// hash ids past every id before it: as many more distinct blocks, the
// same shape.
func TestRepeatTrace(t *testing.T) {
	reqs, err := openTrace("")
	if err != nil {
		t.Fatal(err)
	}
	four := repeatTrace(reqs, 4)
	if len(four) != 4*len(reqs) {
		t.Fatalf("%d requests", len(four))
	}
	ids := map[int64]bool{}
	for i, q := range four {
		if i > 0 && q.Timestamp < four[i-1].Timestamp {
			t.Fatalf("request %d out of order", i)
		}
		for _, id := range q.HashIDs {
			ids[id] = true
		}
	}
	if len(ids) != 4*43924 {
		t.Fatalf("%d distinct blocks, want 4 x 43,924", len(ids))
	}
}

package placement_test

import (
	"context"
	"testing"

	"github.com/kvsp/kvsp"
)

// TestPlaceAffinity: an instance that reports its engine's capacity
// (kv_blocks) is preferred for a prompt whose blocks the PC placed there
// and that fewer than kv_blocks blocks have followed since: its engine
// prefills them from its prefix cache, though the IS knows none of them
// yet. Placed blocks beyond the capacity, and a restart (a new epoch), end
// the estimate; without kv_blocks there is none (ties go to the smallest
// URI, ii1).
func TestPlaceAffinity(t *testing.T) {
	w := newWorld(t, 4)
	status := func(name string, epoch, queued, kvBlocks uint64) {
		t.Helper()
		st := &kvsp.InstanceStatus{Instance: w.base[name], Epoch: epoch, State: kvsp.StateActive, Queued: queued, BatchSize: 8,
			PrefillTokensPerS: 42000, DecodeTokensPerS: 3100, TTLMs: 60000, CompatID: compat, KVBlocks: kvBlocks}
		if _, err := w.ctl.PutStatus(context.Background(), st); err != nil {
			t.Fatalf("status of %s: %v", name, err)
		}
	}
	placed := func(tokens []uint32) string {
		t.Helper()
		out, err := w.place(t, tokens)
		if err != nil {
			t.Fatal(err)
		}
		for name, b := range w.base {
			if b == out.Instance {
				return name
			}
		}
		t.Fatalf("placed on %s", out.Instance)
		return ""
	}
	idle := func(kvBlocks uint64, epoch2 uint64) {
		status("ii1", 1, 0, kvBlocks)
		status("ii2", epoch2, 0, kvBlocks)
	}
	p := prompt(4*bt+3, 7)

	status("ii1", 1, 4, 8) // busy: p goes to ii2
	status("ii2", 1, 0, 8)
	if got := placed(p); got != "ii2" {
		t.Fatalf("first placement on %s, want ii2 (ii1 busy)", got)
	}
	idle(8, 1)
	if got := placed(p); got != "ii2" {
		t.Fatalf("p again, both idle: placed on %s, want ii2 (its engine holds p's 4 blocks)", got)
	}
	// Eight more blocks through ii2's engine of 8: p's are gone from it.
	status("ii1", 1, 4, 8)
	if got := placed(prompt(8*bt, 8)); got != "ii2" {
		t.Fatalf("filler on %s, want ii2", got)
	}
	idle(8, 1)
	if got := placed(p); got != "ii1" {
		t.Fatalf("p after 8 other blocks on ii2: placed on %s, want ii1 (the tie: ii2's engine has evicted p)", got)
	}
	// A restart: from its new epoch, nothing is estimated resident.
	p2 := prompt(4*bt, 9)
	status("ii1", 1, 4, 8)
	if got := placed(p2); got != "ii2" {
		t.Fatalf("p2 on %s, want ii2 (ii1 busy)", got)
	}
	idle(8, 2)
	if got := placed(p2); got != "ii1" {
		t.Fatalf("p2 after ii2 restarted: on %s, want ii1 (the tie)", got)
	}
	// Without kv_blocks, no estimate: the tie goes to ii1 whatever was
	// placed where.
	p3 := prompt(4*bt, 10)
	status("ii1", 1, 4, 0)
	status("ii2", 2, 0, 0)
	if got := placed(p3); got != "ii2" {
		t.Fatalf("p3 on %s, want ii2 (ii1 busy)", got)
	}
	idle(0, 2)
	if got := placed(p3); got != "ii1" {
		t.Fatalf("p3 without kv_blocks: on %s, want ii1 (the tie)", got)
	}
}

package placement_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/failpoint"
)

// TestF8_PCStallDoesNotMassFailInstances (RELIABILITY F8; R-ST-3, R-SES-10):
// the PC's migration sweep is stalled (failpoint pc/sweep paused) for
// three status TTLs, so every status record it holds expires though the
// instances were alive. When it resumes, nothing is migrated without fresh
// evidence: the instances whose status arrives within one TTL keep their
// sessions (no epoch bump, no resume sent), and a front end asking during
// the stall does not move its session either. Failure detection still
// works: the session of an instance that really died is migrated once the
// grace is over.
func TestF8_PCStallDoesNotMassFailInstances(t *testing.T) {
	t.Cleanup(failpoint.Reset)
	w := newWorld(t, 4)
	const ttl = 400 // ms
	w.statusTTL(t, "ii1", 1, 0, kvsp.StateActive, ttl)
	w.statusTTL(t, "ii2", 1, 9, kvsp.StateActive, ttl)
	w.statusTTL(t, "ii3", 1, 9, kvsp.StateActive, ttl)
	tokens := prompt(3*bt+5, 8)
	alive, err := w.place(t, tokens) // ii1: the least loaded
	if err != nil || alive.Instance != w.base["ii1"] {
		t.Fatalf("place on ii1: %+v %v", alive, err)
	}
	w.statusTTL(t, "ii1", 1, 20, kvsp.StateActive, ttl)
	w.statusTTL(t, "ii2", 1, 0, kvsp.StateActive, ttl)
	dead, err := w.place(t, tokens) // ii2, which will not report again
	if err != nil || dead.Instance != w.base["ii2"] {
		t.Fatalf("place on ii2: %+v %v", dead, err)
	}
	for _, out := range []*kvsp.PlaceResponse{alive, dead} {
		cp := &kvsp.Checkpoint{Session: out.Session, Epoch: 1, CompatID: compat, ScopeID: w.scopeKey.ID(), PromptBlocks: []kvsp.BlockKey{{1}, {2}, {3}},
			PromptTail: make([]uint32, 5), Generated: make([]uint32, 8), OutputOffset: 8,
			Sampler: kvsp.Sampler{Method: "greedy", Params: map[string]any{}, Step: 8, Deterministic: true}}
		if _, err := w.ctl.PutCheckpoint(context.Background(), cp); err != nil {
			t.Fatal(err)
		}
	}
	report := func() { // the live instances: ii1 serves, ii3 is the spare
		w.statusTTL(t, "ii1", 1, 0, kvsp.StateActive, ttl)
		w.statusTTL(t, "ii3", 1, 9, kvsp.StateActive, ttl)
	}

	if err := failpoint.Enable("pc/sweep", "pause"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.pc.Run(ctx, 20*time.Millisecond); close(done) }()
	defer func() { cancel(); failpoint.Reset(); <-done }()
	for failpoint.Hits("pc/sweep") == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	// The stall: no status is processed (the instances' records wait in
	// their sockets), and every record expires.
	time.Sleep(3 * ttl * time.Millisecond)
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16, Session: &alive.Session}
	if out, err := w.front.Controller(w.srv.URL("/pc/")).Place(context.Background(), q); err != nil || out.Epoch != 1 || out.Instance != w.base["ii1"] {
		t.Fatalf("a front end asking during the stall: %+v %v (the session must stay at epoch 1 on ii1)", out, err)
	}
	failpoint.Disable("pc/sweep") // resumed: the delayed records arrive
	report()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if s, _ := w.pc.Session(dead.Session); s.Epoch == 2 {
			if s.Instance == w.base["ii2"] {
				t.Fatal("the dead instance's session stayed on it")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the session of the instance that really died was never migrated")
		}
		report()
		time.Sleep(50 * time.Millisecond)
	}
	for range 4 { // a few more sweeps with the live instances reporting
		report()
		time.Sleep(50 * time.Millisecond)
	}
	if s, _ := w.pc.Session(alive.Session); s.Epoch != 1 || s.Instance != w.base["ii1"] {
		t.Fatalf("the live instance's session after the stall: epoch %d on %s, want 1 on ii1", s.Epoch, s.Instance)
	}
	rs := append(w.ii[w.base["ii1"]].resumed(), w.ii[w.base["ii3"]].resumed()...)
	if len(rs) != 1 || rs[0].Checkpoint.Session != dead.Session {
		t.Fatalf("resumes sent: %+v, want only the dead instance's session", rs)
	}
}

package instance_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestAnswerEndsAtItsEndOfGeneration (A-39, the stop path): the simulated
// model ends its answer after 20 to 40 tokens, far below max_tokens; the
// instance's last line says "stop" and counts the tokens, its final
// checkpoint says so too, and the PC records the session finished: a
// front end placing it again is told so (409 kvsp-invalid-state), and
// when its instance then dies the sweep does not migrate it.
func TestAnswerEndsAtItsEndOfGeneration(t *testing.T) {
	w := newRig(t, rigOptions{second: true, answerTokens: [2]int{20, 40}})
	w.runAgents(t, "/ii1/", "/ii2/")
	w.sweep(t)
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: prompt(2), MaxTokens: 500}
	var got []uint32
	res, err := w.front.RunSession(context.Background(), w.front.Controller(w.url("/pc/")), q, 50*time.Millisecond, func(i uint64, tok uint32) error {
		got = append(got, tok)
		return nil
	})
	if err != nil || res.Finish != kvsp.FinishStop || len(got) < 20 || len(got) > 40 {
		t.Fatalf("session: %d tokens, finish %q, %v", len(got), res.Finish, err)
	}
	s := waitFinished(t, w, res.Session, kvsp.FinishStop) // once the front end has the done line
	if s.Checkpoint.OutputOffset != uint64(len(got)) {
		t.Fatalf("the PC's session: %+v", s.Checkpoint)
	}
	again := *q
	again.Session = &res.Session
	if _, err := w.front.Controller(w.url("/pc/")).Place(context.Background(), &again); !errors.Is(err, kvsp.ErrInvalidState) {
		t.Fatalf("a finished session placed again: %v (want 409 kvsp-invalid-state)", err)
	}
	w.agent.Close() // its instance dies: nothing to migrate
	waitStatusGone(t, w, "/ii1/")
	if _, err := w.front.Controller(w.url("/pc/")).Place(context.Background(), &again); !errors.Is(err, kvsp.ErrInvalidState) {
		t.Fatalf("a finished session whose instance died, placed again: %v (want 409, not a migration)", err)
	}
	time.Sleep(100 * time.Millisecond) // five sweeps
	if s, _ := w.ctl.Session(w.scopeKey.ID(), res.Session); s.Epoch != 1 || s.Instance != w.url("/ii1/") {
		t.Fatalf("a finished session was migrated: epoch %d on %s", s.Epoch, s.Instance)
	}
}

// TestFrontEndGoneCancelsTheSession (A-39, the cancelled path): a front
// end that goes away mid-answer ends the session: the engine stops and
// frees the request at once, the instance tells the PC ("cancelled"), and
// the PC never migrates it, though its instance dies afterwards (a front
// end that comes back for it: TestCutStreamIsNotADeparture).
func TestFrontEndGoneCancelsTheSession(t *testing.T) {
	w := newRig(t, rigOptions{second: true})
	w.runAgents(t, "/ii1/", "/ii2/")
	w.sweep(t)
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: prompt(2), MaxTokens: 5000}
	gctx, leave := context.WithCancel(context.Background())
	var session kvsp.UUID
	res, err := w.front.RunSession(gctx, w.front.Controller(w.url("/pc/")), q, 50*time.Millisecond, func(i uint64, tok uint32) error {
		if i == 50 {
			leave() // the front end goes away
		}
		return nil
	})
	session = res.Session
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("session: %v (want the front end's cancellation)", err)
	}
	waitFinished(t, w, session, kvsp.FinishCancelled)
	if st := w.eng.Stats(); st.Running != 0 || st.Queued != 0 {
		t.Fatalf("the engine still runs the request: %+v", st)
	}
	if n := kvsptest.MetricSum(t, w.reg, "kvsp_instance_generations_finished_total", map[string]string{"finish": "cancelled"}); n != 1 {
		t.Fatalf("kvsp_instance_generations_finished_total{finish=cancelled} = %v", n)
	}
	w.agent.Close()
	waitStatusGone(t, w, "/ii1/")
	time.Sleep(100 * time.Millisecond) // five sweeps
	if s, _ := w.ctl.Session(w.scopeKey.ID(), session); s.Epoch != 1 {
		t.Fatalf("a cancelled session was migrated: epoch %d on %s", s.Epoch, s.Instance)
	}
}

// waitFinished waits until the PC records the session finished, why.
func waitFinished(t *testing.T, w *rig, session kvsp.UUID, why kvsp.FinishReason) placement.Session {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s, ok := w.ctl.Session(w.scopeKey.ID(), session)
		if ok && s.Finished() && s.Checkpoint.Finish == why {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("the PC does not record the session finished (%s): %+v", why, s.Checkpoint)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitStatusGone waits until the PC no longer counts the instance at p
// (its status expired or it said it stopped).
func waitStatusGone(t *testing.T, w *rig, p string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if s, ok := w.ctl.Registry().Get(w.url(p)); !ok || s.State != kvsp.StateActive {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the PC still counts %s active", p)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestDeliverErrorEndsTheSession: an error from RunSession's deliver (a
// gateway that met a stop sequence) is returned as it is, at once, not
// taken for a failed instance to resume elsewhere; the instance sees its
// front end leave and the PC records the session cancelled.
func TestDeliverErrorEndsTheSession(t *testing.T) {
	w := newRig(t, rigOptions{})
	w.runAgents(t, "/ii1/")
	stop := errors.New("a stop sequence")
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: prompt(2), MaxTokens: 2000}
	start := time.Now()
	res, err := w.front.RunSession(context.Background(), w.front.Controller(w.url("/pc/")), q, 50*time.Millisecond, func(i uint64, tok uint32) error {
		if i == 5 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || time.Since(start) > time.Second {
		t.Fatalf("RunSession: %v after %v, want the deliver's error at once", err, time.Since(start))
	}
	waitFinished(t, w, res.Session, kvsp.FinishCancelled)
}

// TestCutStreamIsNotADeparture: the instance takes a cut stream for its
// front end leaving and says "cancelled", but a front end that
// comes back asking where the session continues was cut off, not gone:
// once the instance has died, the PC migrates the session for it and the
// output continues. The sweep alone never resumes it.
func TestCutStreamIsNotADeparture(t *testing.T) {
	w := newRig(t, rigOptions{second: true})
	w.runAgents(t, "/ii1/", "/ii2/")
	w.sweep(t)
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: prompt(2), MaxTokens: 400}
	gctx, cut := context.WithCancel(context.Background())
	res, _ := w.front.RunSession(gctx, w.front.Controller(w.url("/pc/")), q, 50*time.Millisecond, func(i uint64, tok uint32) error {
		if i == 40 {
			cut()
		}
		return nil
	})
	waitFinished(t, w, res.Session, kvsp.FinishCancelled)
	w.agent.Close()
	waitStatusGone(t, w, "/ii1/")
	time.Sleep(100 * time.Millisecond) // five sweeps: none resumes it
	if s, _ := w.ctl.Session(w.scopeKey.ID(), res.Session); s.Epoch != 1 {
		t.Fatalf("the sweep resumed a cancelled session: epoch %d", s.Epoch)
	}
	again := *q
	again.Session = &res.Session
	moved, err := w.front.Controller(w.url("/pc/")).Place(context.Background(), &again)
	if err != nil || moved.Epoch != 2 || moved.Instance != w.url("/ii2/") {
		t.Fatalf("the front end's place: %+v %v (want the session moved to ii2 at epoch 2)", moved, err)
	}
}

// sweep runs the PC's failure detection (every 20 ms) until the test ends.
func (w *rig) sweep(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.ctl.Run(ctx, 20*time.Millisecond); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

// TestPlacementWaitIsBounded: with no instance to run it (its one
// instance sleeping), a session waits
// for a placement only as long as it is given (the gateway's PlaceWait),
// then returns the PC's 503: a front end answers its client rather than
// hold the request for ever (what schemathesis found: a chat completion
// hung while the fuzzed deployment had no instance with room).
func TestPlacementWaitIsBounded(t *testing.T) {
	w := newRig(t, rigOptions{})
	w.runAgents(t, "/ii1/")
	if _, err := w.pc.SetState(context.Background(), kvsp.StateDraining); err != nil { // sleeping: no new sessions
		t.Fatal(err)
	}
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: prompt(2), MaxTokens: 5}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	_, err := w.front.RunSessionWithin(ctx, w.front.Controller(w.url("/pc/")), q, 20*time.Millisecond, 300*time.Millisecond, func(uint64, uint32) error { return nil })
	// Placed before the PC heard of the state (the instance refuses it:
	// 409, and the PC does not move it), or refused by the PC (503):
	// either way unavailable, within the wait.
	if !errors.Is(err, kvsp.ErrUnavailable) || ctx.Err() != nil || time.Since(start) > 5*time.Second {
		t.Fatalf("no instance with room: %v after %s (want unavailable after about 300 ms)", err, time.Since(start))
	}
}

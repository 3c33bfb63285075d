package placement_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
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
		cp := w.checkpoint(out.Session, 1, tokens, 8)
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
		if s, _ := w.pc.Session(w.scopeKey.ID(), dead.Session); s.Epoch == 2 {
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
	if s, _ := w.pc.Session(w.scopeKey.ID(), alive.Session); s.Epoch != 1 || s.Instance != w.base["ii1"] {
		t.Fatalf("the live instance's session after the stall: epoch %d on %s, want 1 on ii1", s.Epoch, s.Instance)
	}
	rs := append(w.ii[w.base["ii1"]].resumed(), w.ii[w.base["ii3"]].resumed()...)
	if len(rs) != 1 || rs[0].Checkpoint.Session != dead.Session {
		t.Fatalf("resumes sent: %+v, want only the dead instance's session", rs)
	}
}

// The operations of F14's history on one session's checkpoint register.
type (
	cpInput struct {
		op     string // "checkpoint", "continue" (the front end's place, which may migrate), "read"
		epoch  uint64 // checkpoint: the sender's epoch
		offset uint64 // checkpoint: its output_offset
	}
	cpOutput struct {
		kind   string // "ack", "stale", "forbidden" (checkpoint); "epoch" (continue); "state" (read)
		epoch  uint64 // stale: the session's epoch in the problem; continue, read: the epoch
		offset uint64 // ack: the recorded offset; read: the checkpoint's
	}
	cpState struct{ epoch, offset uint64 }
)

// cpModel is the register A-24 and R-SES-3/4 specify: checkpoints of the
// current epoch raise the recorded offset to the highest seen (a lower or
// equal one is acknowledged with the recorded offset), a lower epoch is
// 409 kvsp-stale-epoch carrying the current epoch, a higher one 403; a
// place for the session answers its epoch, one higher when it migrated it.
var cpModel = porcupine.Model{
	Init: func() any { return cpState{epoch: 1} },
	Step: func(state, input, output any) (bool, any) {
		s, in, out := state.(cpState), input.(cpInput), output.(cpOutput)
		switch in.op {
		case "checkpoint":
			switch {
			case in.epoch < s.epoch:
				return out.kind == "stale" && out.epoch == s.epoch, s
			case in.epoch > s.epoch:
				return out.kind == "forbidden", s
			}
			n := cpState{s.epoch, max(s.offset, in.offset)}
			return out.kind == "ack" && out.offset == n.offset, n
		case "continue":
			return out.kind == "epoch" && (out.epoch == s.epoch || out.epoch == s.epoch+1), cpState{out.epoch, s.offset}
		default: // read
			return out.kind == "state" && out.epoch == s.epoch && out.offset == s.offset, s
		}
	},
	DescribeOperation: func(input, output any) string { return fmt.Sprintf("%+v -> %+v", input, output) },
	DescribeState:     func(state any) string { return fmt.Sprintf("%+v", state) },
}

// TestF14_CheckpointRegisterLinearizable (RELIABILITY F14; A-24, R-SES-3,
// R-SES-4, R-SES-15): eight clients send concurrent checkpoint PUTs over
// mutual TLS with epochs around the one they last saw and random offsets,
// restart the session's instance and ask the PC where the session
// continues (which migrates it: the epoch goes up), and read the register.
// The recorded history is checked with porcupine against the model above:
// it must be linearizable, and every rejection must carry the right
// problem type (and the session's epoch, for a stale one).
func TestF14_CheckpointRegisterLinearizable(t *testing.T) {
	w := newWorld(t, 64)
	var instEpoch sync.Map // instance base -> *atomic.Uint64
	for _, n := range []string{"ii1", "ii2", "ii3"} {
		w.status(t, n, 1, 0, kvsp.StateActive)
		e := new(atomic.Uint64)
		e.Store(1)
		instEpoch.Store(w.base[n], e)
	}
	tokens := prompt(3*bt+5, 14)
	front := w.front.Controller(w.srv.URL("/pc/"))
	// max_tokens above every offset sent: the session never finishes
	// so every place continues it.
	const maxTokens = 256
	placed, err := front.Place(context.Background(), &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: maxTokens})
	if err != nil {
		t.Fatal(err)
	}
	w.track(t, placed, w.scopeKey)
	id := placed.Session
	start := time.Now()
	var (
		mu      sync.Mutex
		history []porcupine.Operation
		stats   = map[string]int{}
	)
	record := func(client int, in cpInput, call time.Time, out cpOutput) {
		mu.Lock()
		defer mu.Unlock()
		history = append(history, porcupine.Operation{ClientId: client, Input: in, Output: out,
			Call: call.Sub(start).Nanoseconds(), Return: time.Since(start).Nanoseconds()})
		stats[in.op+"/"+out.kind]++
	}
	var wg sync.WaitGroup
	for client := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(client), 14))
			seen := uint64(1)
			for range 40 {
				switch r := rng.IntN(100); {
				case r < 60:
					e := max(1, seen+uint64(rng.IntN(3))) - 1 // seen-1 .. seen+1
					if e == 0 {
						e = 1
					}
					off := uint64(1 + rng.IntN(200))
					cp := w.checkpoint(id, e, tokens, off)
					call := time.Now()
					ack, err := w.ctl.PutCheckpoint(context.Background(), cp)
					var out cpOutput
					var p *kvsp.Problem
					switch {
					case err == nil:
						out = cpOutput{kind: "ack", offset: ack.OutputOffset}
					case errors.Is(err, kvsp.ErrStaleEpoch) && errors.As(err, &p):
						out = cpOutput{kind: "stale", epoch: problemEpoch(p)}
						seen = max(seen, out.epoch)
					case errors.Is(err, kvsp.ErrForbidden):
						out = cpOutput{kind: "forbidden"}
					default:
						t.Errorf("checkpoint epoch %d: %v (want an acknowledgement, 409 kvsp-stale-epoch or 403)", e, err)
						return
					}
					record(client, cpInput{op: "checkpoint", epoch: e, offset: off}, call, out)
				case r < 75:
					// The session's instance restarts (a higher epoch):
					// the next place migrates the session.
					s, _ := w.pc.Session(w.scopeKey.ID(), id)
					v, _ := instEpoch.Load(s.Instance)
					st := &kvsp.InstanceStatus{Instance: s.Instance, Epoch: v.(*atomic.Uint64).Add(1), State: kvsp.StateActive, BatchSize: 8,
						PrefillTokensPerS: 42000, DecodeTokensPerS: 3100, Links: []kvsp.Link{}, TTLMs: 60000, CompatID: compat}
					if _, err := w.ctl.PutStatus(context.Background(), st); err != nil && !errors.Is(err, kvsp.ErrStaleEpoch) {
						t.Errorf("status: %v", err)
						return
					}
					q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: maxTokens, Session: &id}
					call := time.Now()
					out, err := front.Place(context.Background(), q)
					if err != nil {
						t.Errorf("place for the session: %v", err)
						return
					}
					seen = max(seen, out.Epoch)
					record(client, cpInput{op: "continue"}, call, cpOutput{kind: "epoch", epoch: out.Epoch})
				default:
					call := time.Now()
					s, _ := w.pc.Session(w.scopeKey.ID(), id)
					out := cpOutput{kind: "state", epoch: s.Epoch}
					if s.Checkpoint != nil {
						out.offset = s.Checkpoint.OutputOffset
					}
					record(client, cpInput{op: "read"}, call, out)
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	res, info := porcupine.CheckOperationsVerbose(cpModel, history, 60*time.Second)
	if res != porcupine.Ok {
		if f, err := os.CreateTemp("", "kvsp-f14-*.html"); err == nil {
			porcupine.Visualize(cpModel, info, f)
			f.Close()
			t.Logf("history visualised in %s", f.Name())
		}
		t.Fatalf("the checkpoint register's history of %d operations is not linearizable (%v)", len(history), res)
	}
	if stats["checkpoint/ack"] == 0 || stats["checkpoint/stale"] == 0 || stats["checkpoint/forbidden"] == 0 || stats["continue/epoch"] == 0 {
		t.Fatalf("the history lacks a kind of outcome, so it proves little: %v", stats)
	}
	s, _ := w.pc.Session(w.scopeKey.ID(), id)
	t.Logf("%d operations linearizable: %v; final epoch %d", len(history), stats, s.Epoch)
}

// problemEpoch reads the epoch extension member of a stale-epoch problem.
func problemEpoch(p *kvsp.Problem) uint64 {
	switch v := p.Extensions["epoch"].(type) {
	case float64:
		return uint64(v)
	case uint64:
		return v
	case int64:
		return uint64(v)
	case json.Number:
		n, _ := strconv.ParseUint(string(v), 10, 64)
		return n
	}
	return 0
}

// TestPlaceWhileEveryInstanceIsDown: a model whose instances all failed
// (or that a restarted PC knows only from its saved state) is still
// served here: a request gets 503 with Retry-After, to try again, not 409
// kvsp-incompatible, which tells the front end the model is not served
// (found by the deterministic simulation, DS1).
func TestPlaceWhileEveryInstanceIsDown(t *testing.T) {
	w := newWorld(t, 4)
	w.statusTTL(t, "ii1", 1, 0, kvsp.StateActive, 100)
	time.Sleep(150 * time.Millisecond)
	_, err := w.place(t, prompt(bt, 3))
	if !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("place with every instance failed: %v, want 503", err)
	}
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: kvsp.CompatID{0xee}, Tokens: prompt(bt, 3), MaxTokens: 16}
	if _, err := w.front.Controller(w.srv.URL("/pc/")).Place(context.Background(), q); !errors.Is(err, kvsp.ErrIncompatible) {
		t.Fatalf("place for a model nobody serves: %v, want 409 kvsp-incompatible", err)
	}
}

// TestSessionsForgotten: a finished session (its checkpoint covers
// max_tokens) is dropped after SessionRetention, an idle one (placed, never
// checkpointed) after SessionIdle, from memory and from the state file; a
// session in progress stays. Without this the PC grew with every request
// (found by L2's heap check).
func TestSessionsForgotten(t *testing.T) {
	store, err := placement.OpenBoltStore(filepath.Join(t.TempDir(), "pc.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	w := newWorldWith(t, 16, func(c *placement.Config) {
		c.State, c.SessionRetention, c.SessionIdle = store, 200*time.Millisecond, 600*time.Millisecond
	})
	w.status(t, "ii1", 1, 0, kvsp.StateActive)
	tokens := prompt(3*bt+5, 21)
	var ids []kvsp.UUID
	for range 3 {
		out, err := w.place(t, tokens)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, out.Session)
	}
	finished, running, idle := ids[0], ids[1], ids[2]
	cp := func(id kvsp.UUID, off uint64) {
		c := w.checkpoint(id, 1, tokens, off)
		if _, err := w.ctl.PutCheckpoint(context.Background(), c); err != nil {
			t.Fatal(err)
		}
	}
	cp(finished, 16) // max_tokens is 16: done
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.pc.Run(ctx, 20*time.Millisecond); close(done) }()
	defer func() { cancel(); <-done }()
	stored := func() map[kvsp.UUID]bool {
		st, err := store.Load()
		if err != nil {
			t.Fatal(err)
		}
		m := map[kvsp.UUID]bool{}
		for _, s := range st.Sessions {
			m[s.ID] = true
		}
		return m
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		cp(running, 8) // still generating
		_, f := w.pc.Session(w.scopeKey.ID(), finished)
		_, i := w.pc.Session(w.scopeKey.ID(), idle)
		if !f && !i {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after their retention: finished kept %v, idle kept %v", f, i)
		}
	}
	if _, ok := w.pc.Session(w.scopeKey.ID(), running); !ok {
		t.Fatal("the running session was dropped")
	}
	if m := stored(); m[finished] || m[idle] || !m[running] {
		t.Fatalf("the state file holds %v", m)
	}
}

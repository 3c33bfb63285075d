package placement

import (
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvsp/kvsp"
)

var compatA, compatB = kvsp.CompatID{0xa}, kvsp.CompatID{0xb}

func status(uri string, epoch uint64, s kvsp.InstanceState, compat kvsp.CompatID) *kvsp.InstanceStatus {
	return &kvsp.InstanceStatus{Instance: uri, Epoch: epoch, State: s, BatchSize: 8, PrefillTokensPerS: 42000, DecodeTokensPerS: 3100,
		Links: []kvsp.Link{}, TTLMs: 3000, CompatID: compat}
}

// TestStatusEpochAndTTL: R-ST-6 / A-12 (a lower epoch is refused with the
// highest seen and changes nothing; an equal one refreshes), R-ST-3 (the
// instance is failed when its record expires, and alive again when a
// record arrives), R-ST-4 (a higher epoch is a restart).
func TestStatusEpochAndTTL(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := NewRegistry()
		const ii7 = "https://ii7.example/kvsp/"
		if s, err := r.Put(status(ii7, 12, kvsp.StateActive, compatA)); err != nil || s != kvsp.StateActive {
			t.Fatalf("first status: %v %v", s, err)
		}
		_, err := r.Put(status(ii7, 11, kvsp.StateDraining, compatA))
		var p *kvsp.Problem
		if !errors.Is(err, kvsp.ErrStaleEpoch) || !errors.As(err, &p) || p.Extensions["epoch"] != uint64(12) {
			t.Fatalf("epoch 11 after 12: %v", err)
		}
		if g, _ := r.Get(ii7); g.State != kvsp.StateActive || g.Status.Epoch != 12 {
			t.Fatalf("a stale record changed the instance: %+v", g)
		}
		time.Sleep(2999 * time.Millisecond)
		if g, _ := r.Get(ii7); g.State != kvsp.StateActive {
			t.Fatalf("before expiry: %s", g.State)
		}
		time.Sleep(time.Millisecond)
		if g, _ := r.Get(ii7); g.State != kvsp.StateFailed {
			t.Fatalf("at expiry: %s, want failed", g.State)
		}
		if s, err := r.Put(status(ii7, 12, kvsp.StateActive, compatA)); err != nil || s != kvsp.StateActive {
			t.Fatalf("same epoch after expiry: %v %v", s, err)
		}
		if s, err := r.Put(status(ii7, 13, kvsp.StateSleeping, compatA)); err != nil || s != kvsp.StateSleeping {
			t.Fatalf("restart: %v %v", s, err)
		}
	})
}

// TestRequestSleep: R-ST-8/9 and A-19: an instance asking to sleep is
// answered draining when another active instance of its model remains,
// active otherwise; once accepted, the PC keeps answering draining until
// the instance reports another state; an instance of another model does
// not count.
func TestRequestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := NewRegistry()
		sleepy := kvsp.StateSleeping
		ask := func(uri string, epoch uint64, compat kvsp.CompatID) kvsp.InstanceState {
			st := status(uri, epoch, kvsp.StateActive, compat)
			st.RequestedState = &sleepy
			s, err := r.Put(st)
			if err != nil {
				t.Fatal(err)
			}
			return s
		}
		if s := ask("https://a1/", 1, compatA); s != kvsp.StateActive {
			t.Fatalf("the only instance: %s, want active (refused)", s)
		}
		r.Put(status("https://b1/", 1, kvsp.StateActive, compatB))
		if s := ask("https://a1/", 1, compatA); s != kvsp.StateActive {
			t.Fatalf("another model's instance counted: %s", s)
		}
		r.Put(status("https://a2/", 1, kvsp.StateActive, compatA))
		if s := ask("https://a1/", 1, compatA); s != kvsp.StateDraining {
			t.Fatalf("with a2 active: %s, want draining", s)
		}
		if s, _ := r.Put(status("https://a1/", 1, kvsp.StateActive, compatA)); s != kvsp.StateDraining {
			t.Fatalf("accepted, then a record still active: %s", s)
		}
		// a2 asks too: a1 is draining, so a2 is the last one: refused.
		if s := ask("https://a2/", 1, compatA); s != kvsp.StateActive {
			t.Fatalf("the last active instance: %s", s)
		}
		for _, st := range []kvsp.InstanceState{kvsp.StateDraining, kvsp.StateSleeping} {
			if s, _ := r.Put(status("https://a1/", 1, st, compatA)); s != st {
				t.Fatalf("reported %s: %s", st, s)
			}
		}
	})
}

// TestPendingQuota: R-PF-13 at the PC: at most max directives pending per
// instance; a slot frees when its directive's deadline (plus lease) passes.
func TestPendingQuota(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := NewRegistry()
		const ii = "https://ii1/"
		r.Put(status(ii, 1, kvsp.StateActive, compatA))
		if r.reserve(ii, 2, 1, Requester{}, time.Now().Add(time.Second)) != nil || r.reserve(ii, 2, 1, Requester{}, time.Now().Add(3*time.Second)) != nil {
			t.Fatal("two slots")
		}
		if r.reserve(ii, 2, 1, Requester{}, time.Now().Add(time.Second)) == nil {
			t.Fatal("a third directive past the quota")
		}
		time.Sleep(time.Second)
		if g, _ := r.Get(ii); g.Pending != 1 {
			t.Fatalf("pending %d after the first deadline", g.Pending)
		}
		if r.reserve(ii, 2, 1, Requester{}, time.Now().Add(time.Second)) != nil {
			t.Fatal("a freed slot was not reusable")
		}
		if r.reserve("https://unknown/", 2, 1, Requester{}, time.Now().Add(time.Second)) == nil {
			t.Fatal("a slot at an unknown instance")
		}
	})
}

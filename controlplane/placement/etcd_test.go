package placement

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// haMember starts a controller of an HA group on etcd and returns it
// with the function that stops it (resigning, as a clean shutdown does).
func haMember(t *testing.T, e *kvsptest.Etcd, self string) (*Controller, *EtcdStore, func()) {
	t.Helper()
	st, err := OpenEtcdStore(EtcdConfig{Endpoints: []string{e.Endpoint}, TLS: e.TLS, Prefix: "/test/pc", SessionTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(Config{Index: BackendIndex{}, Instances: discard{}, BlockTokens: map[kvsp.CompatID]int{compatA: 16}, State: st, Standby: true, Self: self})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { c.RunHA(ctx, st, self); close(done) }()
	stop := func() {
		cancel()
		<-done
		st.Close()
	}
	t.Cleanup(func() {
		select {
		case <-done:
		default:
			stop()
		}
	})
	return c, st, stop
}

func waitLeading(t *testing.T, c *Controller) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for c.standby.Load() {
		if time.Now().After(deadline) {
			t.Fatal("the controller never led")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestEtcdStateSurvivesRestart: the state test of the bbolt store, on a
// real etcd over TLS with client certificates (R-PRV-1).
func TestEtcdStateSurvivesRestart(t *testing.T) {
	p := kvsptest.NewPKI(t)
	e := kvsptest.StartEtcdPKI(t, p, kvsptest.PC)
	stops := map[*Controller]func(){}
	stateSurvivesRestart(t, func() *Controller {
		c, _, stop := haMember(t, e, "https://pc1/")
		waitLeading(t, c)
		stops[c] = stop
		return c
	}, func(c *Controller) { stops[c]() })
}

// TestEtcdStandbyTakesOver: of two controllers on one etcd, one leads and
// the other is a standby that serves nothing; when the leader dies without
// resigning (its lease stops being renewed), the standby takes over within
// the lease TTL with the leader's state: sessions, epochs and checkpoints.
// The deposed leader's writes are fenced off.
func TestEtcdStandbyTakesOver(t *testing.T) {
	e := kvsptest.StartEtcd(t, nil, nil)
	a, sa, _ := haMember(t, e, "https://pc1/")
	waitLeading(t, a)
	b, _, _ := haMember(t, e, "https://pc2/")
	time.Sleep(200 * time.Millisecond)
	if !b.standby.Load() {
		t.Fatal("two leaders")
	}
	if l := b.leader.Load(); l == nil || *l != "https://pc1/" {
		t.Fatalf("the standby does not know the leader: %v", l)
	}
	if _, err := b.Reshard(context.Background(), &ReshardRequest{}); !errors.Is(err, ErrNotLeader) {
		t.Fatalf("a standby reshards: %v", err)
	}
	id := kvsp.NewUUID()
	a.mu.Lock()
	s := &Session{ID: id, Epoch: 3, ScopeID: kvsp.ScopeID{1}, CompatID: compatA, Instance: "https://ii1/", MaxTokens: 100}
	a.sessions[s.key()] = s
	if err := a.persist(s); err != nil {
		t.Fatal(err)
	}
	a.mu.Unlock()
	if _, err := a.PutCheckpoint(checkpoint(id, 3, 32), func(string) bool { return true }); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Registry().Put(status("https://ii1/", 12, kvsp.StateActive, compatA)); err != nil {
		t.Fatal(err)
	}
	sa.mu.Lock()
	old := *sa.fence
	sa.mu.Unlock()

	// The leader dies: its etcd connection is cut, nothing resigns.
	died := time.Now()
	sa.cli.Close()
	waitLeading(t, b)
	d := time.Since(died)
	if d > 5*time.Second {
		t.Fatalf("took over after %v", d)
	}
	t.Logf("the standby led %v after the leader died (lease %v)", d.Round(time.Millisecond), time.Second)
	got, ok := b.Session(kvsp.ScopeID{1}, id)
	if !ok || got.Epoch != 3 || got.Checkpoint == nil || got.Checkpoint.OutputOffset != 32 {
		t.Fatalf("the new leader's session: %+v", got)
	}
	if _, err := b.Registry().Put(status("https://ii1/", 11, kvsp.StateActive, compatA)); !errors.Is(err, kvsp.ErrStaleEpoch) {
		t.Fatalf("an instance epoch went backwards across the takeover: %v", err)
	}
	if _, err := b.PutCheckpoint(checkpoint(id, 2, 40), func(string) bool { return true }); !errors.Is(err, kvsp.ErrStaleEpoch) {
		t.Fatalf("a session epoch went backwards across the takeover: %v", err)
	}
	// A deposed leader that still believes it leads writes nothing.
	sb, _ := b.cfg.State.(*EtcdStore)
	stale := &EtcdStore{cli: sb.cli, cfg: sb.cfg, fence: &old}
	if err := stale.PutSession(&Session{ID: id, Epoch: 1, ScopeID: kvsp.ScopeID{1}, CompatID: compatA}); !errors.Is(err, ErrNotLeader) {
		t.Fatalf("a write under the old leadership: %v", err)
	}
	if got, _ := b.cfg.State.Load(); len(got.Sessions) != 1 || got.Sessions[0].Epoch != 3 {
		t.Fatalf("stored sessions after the fenced write: %+v", got.Sessions)
	}
}

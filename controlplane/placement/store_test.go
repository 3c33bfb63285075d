package placement

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/kvsp/kvsp"
)

// TestStateSurvivesRestart: with a bbolt state file (created 0600), a
// restarted PC still refuses an instance's lower epoch (R-ST-6) and knows
// its sessions with their epochs and latest checkpoints (R-SES-3, R-SES-15:
// the old epoch's checkpoints stay refused).
func TestStateSurvivesRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pc.db")
	stateSurvivesRestart(t, func() *Controller {
		st, err := OpenBoltStore(path)
		if err != nil {
			t.Fatal(err)
		}
		c, err := New(Config{Index: BackendIndex{}, Instances: discard{}, BlockTokens: map[kvsp.CompatID]int{compatA: 16}, State: st})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return c
	}, func(c *Controller) { c.cfg.State.Close() })
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("state file mode: %v %v", fi.Mode(), err)
	}
}

// stateSurvivesRestart: instance epochs, session epochs and checkpoints,
// and shard maps at their committed version survive a restart of the PC
// over the same store (R-ST-6, R-SES-15). open starts a serving PC; stop
// ends it.
func stateSurvivesRestart(t *testing.T, open func() *Controller, stop func(*Controller)) {
	c := open()
	if _, err := c.Registry().Put(status("https://ii1/", 12, kvsp.StateActive, compatA)); err != nil {
		t.Fatal(err)
	}
	id := kvsp.NewUUID()
	c.mu.Lock()
	s := &Session{ID: id, Epoch: 1, ScopeID: kvsp.ScopeID{1}, CompatID: compatA, Instance: "https://ii1/", MaxTokens: 100}
	c.sessions[s.key()] = s
	c.persist(s)
	c.mu.Unlock()
	if _, err := c.PutCheckpoint(checkpoint(id, 1, 32), func(string) bool { return true }); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	s.Epoch = 2 // migrated
	c.persist(s)
	c.mu.Unlock()
	sm := &ShardContext{Map: kvsp.ShardMap{Map: "m1", Version: 3, Shards: []kvsp.Shard{{Tokens: kvsp.TokenRange{0, 32}, Instance: "https://ii1/"}}},
		ScopeID: kvsp.ScopeID{1}, CompatID: compatA, Keys: []kvsp.BlockKey{{1}, {2}}}
	if err := c.cfg.State.PutShardMap(sm); err != nil {
		t.Fatal(err)
	}
	gone := &Session{ID: kvsp.NewUUID(), Epoch: 1, ScopeID: kvsp.ScopeID{1}, CompatID: compatA, Instance: "https://ii1/", MaxTokens: 100}
	if err := c.cfg.State.PutSession(gone); err != nil {
		t.Fatal(err)
	}
	if err := c.cfg.State.DeleteSession(gone.ScopeID, gone.ID); err != nil { // a forgotten session
		t.Fatal(err)
	}
	stop(c)

	c = open() // the restarted PC
	if _, err := c.Registry().Put(status("https://ii1/", 11, kvsp.StateActive, compatA)); !errors.Is(err, kvsp.ErrStaleEpoch) {
		t.Fatalf("a lower instance epoch after the restart: %v", err)
	}
	got, ok := c.Session(kvsp.ScopeID{1}, id)
	if !ok || got.Epoch != 2 || got.Checkpoint == nil || got.Checkpoint.OutputOffset != 32 || got.MaxTokens != 100 {
		t.Fatalf("session after the restart: %+v", got)
	}
	if _, err := c.PutCheckpoint(checkpoint(id, 1, 40), func(string) bool { return true }); !errors.Is(err, kvsp.ErrStaleEpoch) {
		t.Fatalf("the old epoch after the restart: %v", err)
	}
	if g, _ := c.Registry().Get("https://ii1/"); g.State != kvsp.StateFailed {
		t.Fatalf("an instance known only from saved state: %s", g.State)
	}
	if _, ok := c.Session(gone.ScopeID, gone.ID); ok {
		t.Fatal("a deleted session came back after the restart")
	}
	if m, ok := c.ShardMap(kvsp.ScopeID{1}, "m1"); !ok || !reflect.DeepEqual(m, sm.Map) {
		t.Fatalf("shard map after the restart: %+v", m)
	}
}

// TestBoltRekeysLegacySessions: a state file written before session ids
// were scoped (sessions keyed by id alone) is re-keyed when opened, so its
// sessions load and can be forgotten (deleted) under their scoped keys.
func TestBoltRekeysLegacySessions(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pc.db")
	s, err := OpenBoltStore(path)
	if err != nil {
		t.Fatal(err)
	}
	x := &Session{ID: kvsp.NewUUID(), Epoch: 2, ScopeID: kvsp.ScopeID{1}, CompatID: compatA, Instance: "https://ii1/", MaxTokens: 10}
	b, _ := encodeSession(x)
	if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketSessions).Put(x.ID[:], b) }); err != nil { // the old key
		t.Fatal(err)
	}
	s.Close()
	if s, err = OpenBoltStore(path); err != nil {
		t.Fatal(err)
	}
	st, err := s.Load()
	if err != nil || len(st.Sessions) != 1 || st.Sessions[0].ID != x.ID {
		t.Fatalf("sessions after re-keying: %+v %v", st, err)
	}
	if err := s.DeleteSession(x.ScopeID, x.ID); err != nil {
		t.Fatal(err)
	}
	if st, _ := s.Load(); len(st.Sessions) != 0 {
		t.Fatalf("a legacy session survived its deletion: %+v", st.Sessions)
	}
	s.Close()
}

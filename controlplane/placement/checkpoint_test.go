package placement

import (
	"errors"
	"testing"

	"github.com/kvsp/kvsp"
)

func checkpoint(s kvsp.UUID, epoch uint64, gen int) *kvsp.Checkpoint {
	return &kvsp.Checkpoint{Session: s, Epoch: epoch, CompatID: compatA, ScopeID: kvsp.ScopeID{1}, PromptBlocks: []kvsp.BlockKey{{1}},
		PromptTail: []uint32{5}, Generated: make([]uint32, gen), OutputOffset: uint64(gen),
		Sampler: kvsp.Sampler{Method: "greedy", Params: map[string]any{}, Step: uint64(gen), Deterministic: true}}
}

// TestCheckpointRules: A-24 and R-SES-3/4/15/17: the highest offset of the
// current epoch is kept and acknowledged; a lower offset is acknowledged
// with the recorded one; a lower epoch is 409 kvsp-stale-epoch with the
// session's epoch; a higher epoch or another instance are refused; an
// unknown session, or one of another scope, is 404.
func TestCheckpointRules(t *testing.T) {
	c, _ := New(Config{Index: BackendIndex{}, Instances: discard{}, BlockTokens: map[kvsp.CompatID]int{compatA: 16}})
	id := kvsp.NewUUID()
	c.sessions[SessionKey{kvsp.ScopeID{1}, id}] = &Session{ID: id, Epoch: 1, ScopeID: kvsp.ScopeID{1}, CompatID: compatA, Instance: "https://ii1/"}
	mine := func(uri string) bool { return uri == "https://ii1/" }
	for _, c2 := range []struct {
		gen  int
		want uint64
	}{{8, 8}, {4, 8}, {8, 8}, {12, 12}} {
		if off, err := c.PutCheckpoint(checkpoint(id, 1, c2.gen), mine); err != nil || off != c2.want {
			t.Fatalf("offset %d: ack %d %v, want %d", c2.gen, off, err, c2.want)
		}
	}
	if s, _ := c.Session(kvsp.ScopeID{1}, id); s.Checkpoint == nil || s.Checkpoint.OutputOffset != 12 {
		t.Fatalf("recorded %+v", s.Checkpoint)
	}
	if _, err := c.PutCheckpoint(checkpoint(id, 2, 16), mine); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("a higher epoch: %v", err)
	}
	if _, err := c.PutCheckpoint(checkpoint(id, 1, 16), func(string) bool { return false }); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("another instance: %v", err)
	}
	other := checkpoint(id, 1, 16)
	other.ScopeID = kvsp.ScopeID{2}
	if _, err := c.PutCheckpoint(other, mine); !errors.Is(err, kvsp.ErrNotFound) { // S11: as an unknown session
		t.Fatalf("another scope: %v", err)
	}
	long := checkpoint(id, 1, 16)
	long.PromptTail = make([]uint32, 16)
	if _, err := c.PutCheckpoint(long, mine); !errors.Is(err, kvsp.ErrInvalid) {
		t.Fatalf("a prompt tail of a whole block: %v", err)
	}
	if _, err := c.PutCheckpoint(checkpoint(kvsp.NewUUID(), 1, 1), mine); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("unknown session: %v", err)
	}
	c.sessions[SessionKey{kvsp.ScopeID{1}, id}].Epoch = 2 // migrated (R-SES-10)
	_, err := c.PutCheckpoint(checkpoint(id, 1, 20), mine)
	var p *kvsp.Problem
	if !errors.Is(err, kvsp.ErrStaleEpoch) || !errors.As(err, &p) || p.Extensions["epoch"] != uint64(2) {
		t.Fatalf("the old epoch after migration: %v", err)
	}
}

package placement_test

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/server"
)

// TestCheckpointOfTheLongestSession (R-SES-1, R-SES-3): the checkpoint of
// a session that filled a context of 2^20 tokens with 10-digit output
// token ids, 11.5 MB of JSON, is recorded over HTTP and acknowledged at
// its offset, not refused 413. make api-fuzz found an instance's
// checkpoints refused past the default 1 MiB body (about 100,000 output
// tokens), which left such a session unresumable. One past the bound is
// still 413.
func TestCheckpointOfTheLongestSession(t *testing.T) {
	w := newWorld(t, 1000)
	w.status(t, "ii1", 1, 0, kvsp.StateActive)
	tokens := prompt(3*bt+5, 1)
	pl, err := w.place(t, tokens)
	if err != nil {
		t.Fatal(err)
	}
	gen := uint64(kvsp.MaxGenerateTokens - len(tokens))
	cp := w.checkpoint(pl.Session, pl.Epoch, tokens, gen)
	for i := range cp.Generated {
		cp.Generated[i] = math.MaxUint32
	}
	body, err := kvsp.Marshal(cp)
	if err != nil {
		t.Fatal(err)
	}
	if len(body) <= 8<<20 {
		t.Fatalf("the checkpoint is %d octets: not the longest", len(body))
	}
	ack, err := w.ctl.PutCheckpoint(context.Background(), cp)
	if err != nil || ack.OutputOffset != gen {
		t.Fatalf("the checkpoint of %d octets: %+v %v; want acknowledged at %d", len(body), ack, err, gen)
	}
	t.Logf("a checkpoint of %d output tokens, %d octets, recorded", gen, len(body))
	over := w.checkpoint(pl.Session, pl.Epoch, tokens, gen)
	over.Generated = make([]uint32, server.MaxCheckpointBody/2)
	over.OutputOffset, over.Sampler.Step = uint64(len(over.Generated)), uint64(len(over.Generated))
	var p *kvsp.Problem
	if _, err := w.ctl.PutCheckpoint(context.Background(), over); !errors.As(err, &p) || p.Status != 413 {
		t.Fatalf("a checkpoint past MaxCheckpointBody: %v; want 413", err)
	}
}

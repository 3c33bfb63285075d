package instance

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
)

// checkpointer sends a session's checkpoints to the PC while it generates
// (spec "Session Checkpoints and Migration"): whenever a block of
// generated tokens completes and at least every 64 output tokens (R-SES-1),
// and at the end. With a deterministic sampler on a deterministic engine
// (engine.Engine.Deterministic) tokens go to the front end at once (a resumed instance regenerates the same ones, R-SES-5); with
// any other, a token is released only once the PC has acknowledged a
// checkpoint that covers it (R-SES-6), a block at a time (R-SES-7). A
// checkpoint refused for its epoch means the session moved: generation
// stops (R-SES-15).
type checkpointer struct {
	a         *Agent
	q         *kvsp.GenerateRequest
	keys      []kvsp.BlockKey
	tail      []uint32
	emit      func(kvsp.GeneratedToken) error
	det       bool
	generated []uint32
	sent      int // offset of the last checkpoint sent
	released  int // tokens released to the front end
	// ended is why the output ended, once it has: the final
	// checkpoint carries it.
	ended kvsp.FinishReason
}

// maxCheckpointGap is R-SES-1's bound on output tokens between checkpoints.
const maxCheckpointGap = 64

func (a *Agent) newCheckpointer(q *kvsp.GenerateRequest, keys []kvsp.BlockKey, tail []uint32, emit func(kvsp.GeneratedToken) error) *checkpointer {
	// A greedy session is deterministic only on a batch-invariant engine:
	// elsewhere its tokens are held for checkpoints as a top-p session's.
	det := (q.Sampler == nil || q.Sampler.Method == engine.Greedy) && a.cfg.Engine.Deterministic()
	return &checkpointer{a: a, q: q, keys: keys, tail: tail, emit: emit, det: det}
}

// token is the engine's emit: it records the token, checkpoints at the
// boundaries and releases what may be released.
func (c *checkpointer) token(t engine.Token) error {
	if err := c.a.stopCtx.Err(); err != nil {
		return fmt.Errorf("the instance is stopping: %w", err) // Close cuts every stream
	}
	c.generated = append(c.generated, t.ID)
	off := len(c.generated)
	bt := int(c.a.g.BlockTokens)
	boundary := (len(c.tail)+off)%bt == 0 || off-c.sent >= maxCheckpointGap
	if c.det {
		if err := c.release(off); err != nil {
			return err
		}
	}
	if !boundary {
		return nil
	}
	return c.checkpoint()
}

// resumeAt starts from a checkpoint's output: those tokens are the
// session's already; the ones from `from` on (default: none) are sent
// again, labelled with the new epoch, before generation continues.
func (c *checkpointer) resumeAt(generated []uint32, from *uint64) error {
	c.generated = append(c.generated, generated...)
	c.sent = len(generated)
	c.released = len(generated)
	if from != nil && *from < uint64(len(generated)) {
		c.released = int(*from)
		return c.release(len(generated))
	}
	return nil
}

// finish sends the last checkpoint and releases every token.
func (c *checkpointer) finish() error {
	if len(c.generated) > c.sent {
		if err := c.checkpoint(); err != nil {
			return err
		}
	}
	return c.release(len(c.generated))
}

// end tells the PC why the session's output ended: the PC treats
// it as finished, never resumed or migrated. It is sent once the front
// end has the whole output and the done line (or has gone away:
// cancelled), so that an instance lost before the front end got them
// leaves a session the PC still continues elsewhere. Best effort: nothing
// waits for the answer.
func (c *checkpointer) end(why kvsp.FinishReason) {
	if c.a.cfg.Controller == "" {
		return
	}
	c.ended = why
	ctx, cancel := context.WithTimeout(c.a.stopCtx, 5*time.Second)
	defer cancel()
	if _, err := c.a.ctl.PutCheckpoint(ctx, c.record(len(c.generated))); err != nil {
		c.a.m.checkpoints.WithLabelValues("failed").Inc()
		c.a.log.Debug("the session's final checkpoint was not recorded", "session", c.q.Session.String(), "finish", why, "err", err)
		return
	}
	c.a.m.checkpoints.WithLabelValues("acknowledged").Inc()
}

// checkpoint sends the state at the current offset; without a PC, tokens
// are released at once (there is no migration to protect).
func (c *checkpointer) checkpoint() error {
	off := len(c.generated)
	c.sent = off
	if c.a.cfg.Controller == "" {
		return c.release(off)
	}
	ack, err := c.put(c.record(off))
	switch {
	case errors.Is(err, kvsp.ErrStaleEpoch) || errors.Is(err, kvsp.ErrForbidden):
		c.a.m.checkpoints.WithLabelValues("superseded").Inc()
		return fmt.Errorf("session %s moved to a newer epoch: %w", c.q.Session, err)
	case err != nil:
		c.a.m.checkpoints.WithLabelValues("failed").Inc()
		if c.det {
			return nil // resumable from an older checkpoint: regenerated identically
		}
		return fmt.Errorf("checkpoint not acknowledged: %w", err)
	}
	c.a.m.checkpoints.WithLabelValues("acknowledged").Inc()
	return c.release(int(min(ack.OutputOffset, uint64(off))))
}

// record is the session's checkpoint at offset off.
func (c *checkpointer) record(off int) *kvsp.Checkpoint {
	cp := &kvsp.Checkpoint{Session: c.q.Session, Epoch: c.q.Epoch, CompatID: c.q.CompatID, ScopeID: c.q.ScopeID,
		PromptBlocks: append([]kvsp.BlockKey{}, c.keys...), PromptTail: append([]uint32{}, c.tail...),
		Generated: append([]uint32{}, c.generated[:off]...), OutputOffset: uint64(off),
		Sampler: kvsp.Sampler{Method: engine.Greedy, Params: map[string]any{}, Step: uint64(off), Deterministic: c.det},
		Finish:  c.ended}
	if s := c.q.Sampler; s != nil {
		cp.Sampler.Method, cp.Sampler.Seed = s.Method, s.Seed
		if s.Params != nil {
			cp.Sampler.Params = s.Params
		}
	}
	return cp
}

// checkpointRetry bounds how long a checkpoint of a non-deterministic
// session is retried while the PC is unreachable or unavailable (a PC
// restarting, or a standby taking over: about its lease), its tokens held.
const checkpointRetry = 30 * time.Second

// put sends a checkpoint; one that no PC answered is retried, with
// backoff, when the tokens it covers are held for it (non-deterministic
// samplers). A refusal is final.
func (c *checkpointer) put(cp *kvsp.Checkpoint) (*kvsp.CheckpointAck, error) {
	ctx, cancel := context.WithTimeout(c.a.stopCtx, checkpointRetry)
	defer cancel()
	wait := 50 * time.Millisecond
	for {
		actx, acancel := context.WithTimeout(ctx, 5*time.Second)
		ack, err := c.a.ctl.PutCheckpoint(actx, cp)
		acancel()
		var p *kvsp.Problem
		if err == nil || c.det || (errors.As(err, &p) && p.Status != 503) {
			return ack, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// release sends the tokens up to offset off to the front end.
func (c *checkpointer) release(off int) error {
	for ; c.released < off; c.released++ {
		if err := c.emit(kvsp.GeneratedToken{Index: uint64(c.released), Epoch: c.q.Epoch, Token: c.generated[c.released]}); err != nil {
			return err
		}
	}
	return nil
}

package placement

import (
	"fmt"
	"net/http"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/server"
)

// PutCheckpoint records a session checkpoint sent by the instance that
// serves the session (spec "Session Checkpoints and Migration", A-24):
// a lower epoch than the session's is 409 kvsp-stale-epoch (R-SES-4,
// R-SES-15: the messages of a failed instance); a higher one, or a sender
// that does not speak for the session's instance, 403; the checkpoint with
// the highest output_offset of the current epoch is kept (R-SES-3), and
// the answer carries the recorded offset (the acknowledgement that
// releases tokens of non-deterministic samplers).
func (c *Controller) PutCheckpoint(cp *kvsp.Checkpoint, speaksFor func(string) bool) (uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.sessions[SessionKey{cp.ScopeID, cp.Session}] // another scope's session is not found (S11)
	switch {
	case s == nil:
		return 0, fmt.Errorf("%w: session", kvsp.ErrNotFound)
	case cp.Epoch < s.Epoch:
		return 0, kvsp.NewProblem(kvsp.ErrStaleEpoch, fmt.Sprintf("checkpoint epoch %d is below the session's %d", cp.Epoch, s.Epoch)).With("epoch", s.Epoch)
	case cp.Epoch > s.Epoch:
		return 0, fmt.Errorf("%w: checkpoint epoch %d is above the session's", kvsp.ErrForbidden, cp.Epoch)
	case !speaksFor(s.Instance):
		return 0, fmt.Errorf("%w: the session is served by another instance", kvsp.ErrForbidden)
	case cp.CompatID != s.CompatID:
		return 0, fmt.Errorf("%w: checkpoint: the session runs another model", kvsp.ErrIncompatible)
	case s.Prompt != [32]byte{} && kvsp.PromptDigest(cp.PromptBlocks, cp.PromptTail) != s.Prompt:
		return 0, fmt.Errorf("%w: checkpoint: prompt_blocks and prompt_tail are not the session's prompt", kvsp.ErrConflict)
	}
	if bt := c.cfg.BlockTokens[s.CompatID]; bt > 0 {
		if err := cp.ValidateFor(bt); err != nil {
			return 0, err
		}
	}
	s.Active = time.Now()
	if s.Finished() { // its last word stands
		c.m.checkpoints.WithLabelValues("ignored").Inc()
		return s.Checkpoint.OutputOffset, nil
	}
	// The newest checkpoint is the one further on, or the one at the same
	// offset that says the output ended there.
	if s.Checkpoint == nil || cp.OutputOffset > s.Checkpoint.OutputOffset ||
		(cp.Finish != "" && cp.OutputOffset == s.Checkpoint.OutputOffset) {
		keep := *cp
		prev := s.Checkpoint
		s.Checkpoint = &keep
		if err := c.persist(s); err != nil { // durable before the acknowledgement
			s.Checkpoint = prev
			return 0, err
		}
		failpoint.Eval("pc/checkpoint-persisted") // F15: a crash before the acknowledgement
		c.m.checkpoints.WithLabelValues("recorded").Inc()
	} else {
		c.m.checkpoints.WithLabelValues("ignored").Inc() // same epoch, not newer: idempotent
	}
	return s.Checkpoint.OutputOffset, nil
}

func (c *Controller) putCheckpoint(w http.ResponseWriter, r *http.Request) error {
	var cp kvsp.Checkpoint
	if err := server.DecodeJSON(r, &cp); err != nil {
		return err
	}
	if r.PathValue("session") != cp.Session.String() {
		return fmt.Errorf("%w: the path's session is not the checkpoint's (R-SES-18)", kvsp.ErrInvalid)
	}
	off, err := c.PutCheckpoint(&cp, server.PrincipalFrom(r.Context()).SpeaksFor)
	if err != nil {
		return err
	}
	return server.WriteJSON(w, http.StatusOK, &kvsp.CheckpointAck{OutputOffset: off})
}

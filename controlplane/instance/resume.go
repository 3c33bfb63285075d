package instance

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/server"
)

// resumed is a session this instance was asked to resume: its
// checkpoint and new epoch, and the loading of its prompt's blocks.
type resumed struct {
	epoch uint64
	cp    kvsp.Checkpoint
	ready chan struct{} // closed when the blocks are loaded (or could not be)
}

// Resume accepts a session to continue (spec "Session Checkpoints and
// Migration", A-23): it checks the model and the state, then starts
// loading the checkpoint's prompt blocks from the holders the IS names;
// the front end's POST generate with the new epoch continues the output
// from the checkpoint (R-SES-11..14).
func (a *Agent) Resume(r *kvsp.ResumeRequest) error {
	cp := &r.Checkpoint
	if cp.CompatID != a.compat {
		return fmt.Errorf("%w: this instance serves compat_id %s", kvsp.ErrIncompatible, a.compat) // R-SES-19
	}
	if err := cp.ValidateFor(int(a.g.BlockTokens)); err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.state != kvsp.StateActive {
		return fmt.Errorf("%w: the instance is %s", kvsp.ErrInvalidState, a.state)
	}
	if old := a.resumes[cp.Session]; old != nil && old.epoch >= r.Epoch {
		if old.epoch == r.Epoch {
			return nil // the same resume again
		}
		return kvsp.NewProblem(kvsp.ErrStaleEpoch, "a newer epoch of this session is here").With("epoch", old.epoch)
	}
	x := &resumed{epoch: r.Epoch, cp: *cp, ready: make(chan struct{})}
	a.resumes[cp.Session] = x
	go func() {
		defer close(x.ready)
		a.loadPrompt(x)
	}()
	return nil
}

// loadPrompt loads the checkpoint's prompt blocks and the blocks of its
// generated tokens that are not resident, from the replicas the IS knows
// (R-SES-11; what cannot be loaded is recomputed by generate when the
// front end sends the prompt).
func (a *Agent) loadPrompt(x *resumed) {
	keys := append([]kvsp.BlockKey{}, x.cp.PromptBlocks...)
	if sk, ok := a.keys[x.cp.ScopeID]; ok { // the generated blocks' keys continue the chain
		var prev kvsp.BlockKey
		if len(keys) > 0 {
			prev = keys[len(keys)-1]
		}
		if chain, err := kvsp.ResumeChain(sk, x.cp.CompatID, int(a.g.BlockTokens), prev, len(keys)); err == nil {
			keys = chain.Append(keys, x.cp.PromptTail...)
			keys = chain.Append(keys, x.cp.Generated...)
		}
	}
	if len(keys) == 0 || a.cfg.Index == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := a.cfg.Client.Index(a.cfg.Index).Lookup(ctx, &kvsp.LookupRequest{ScopeID: x.cp.ScopeID, CompatID: x.cp.CompatID, BlockKeys: keys})
	if err != nil {
		a.log.Warn("resume: lookup failed; the prompt is recomputed", "err", err)
		return
	}
	d := &directive{d: kvsp.PrefetchDirective{Directive: kvsp.NewUUID(), ScopeID: x.cp.ScopeID, CompatID: x.cp.CompatID, LeaseMs: 5000}, pending: true, purpose: "resume"}
	for i, reps := range resp.Replicas {
		b := kvsp.PrefetchBlock{BlockKey: keys[i]}
		for _, r := range reps {
			b.Sources = append(b.Sources, r.Holder)
		}
		d.d.Blocks = append(d.d.Blocks, b)
	}
	if len(d.d.Blocks) > 0 {
		a.run(ctx, d)
	}
}

// resumeOf returns the resumed session for a generate request of that
// session and epoch, once its blocks are loaded.
func (a *Agent) resumeOf(ctx context.Context, q *kvsp.GenerateRequest) (*resumed, error) {
	a.mu.Lock()
	x := a.resumes[q.Session]
	a.mu.Unlock()
	if x == nil || x.epoch != q.Epoch {
		return nil, nil
	}
	select {
	case <-x.ready:
		return x, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (a *Agent) postResume(w http.ResponseWriter, r *http.Request) error {
	var q kvsp.ResumeRequest
	if err := server.DecodeJSON(r, &q); err != nil {
		return err
	}
	if r.PathValue("session") != q.Checkpoint.Session.String() {
		return fmt.Errorf("%w: the path's session is not the checkpoint's", kvsp.ErrInvalid)
	}
	if err := a.Resume(&q); err != nil {
		return err
	}
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusAccepted)
	return nil
}

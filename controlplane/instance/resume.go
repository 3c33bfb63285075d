package instance

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/server"
)

// sessionKey names a session at the instance: its id within its scope.
// A request of one scope never finds another scope's session, whatever
// id it names: it is answered as for an id nobody uses (RELIABILITY S11).
type sessionKey struct {
	scope kvsp.ScopeID
	id    kvsp.UUID
}

// resumed is a session this instance was asked to resume: its
// checkpoint and new epoch, and the loading of its prompt's blocks.
type resumed struct {
	epoch uint64
	cp    kvsp.Checkpoint
	ready chan struct{} // closed when the blocks are loaded (or could not be)
	// finished is when a generation of it was delivered whole (zero:
	// not yet); it is dropped resumeRetention later.
	finished time.Time
}

// resumeRetention is how long a resumed session is kept once delivered
// whole (its front end may come back for a done line it missed); they
// were kept forever.
const resumeRetention = time.Minute

// dropFinishedLocked forgets the resumed sessions delivered whole more
// than resumeRetention ago (with a.mu held).
func (a *Agent) dropFinishedLocked(now time.Time) {
	for k, x := range a.resumes {
		if !x.finished.IsZero() && now.Sub(x.finished) > resumeRetention {
			delete(a.resumes, k)
		}
	}
}

// Resume accepts a session to continue (spec "Session Checkpoints and
// Migration", A-23): it checks the model and the state, then starts
// loading the checkpoint's prompt blocks from the holders the IS names;
// the front end's POST generate with the new epoch continues the output
// from the checkpoint (R-SES-11..14).
func (a *Agent) Resume(r *kvsp.ResumeRequest) error {
	cp := &r.Checkpoint
	if _, ok := a.keys[cp.ScopeID]; !ok {
		return fmt.Errorf("%w: this instance holds no key for the checkpoint's scope", kvsp.ErrScopeDenied)
	}
	if cp.CompatID != a.compat {
		return fmt.Errorf("%w: this instance serves compat_id %s", kvsp.ErrIncompatible, a.compat) // R-SES-19
	}
	if err := cp.ValidateFor(int(a.g.BlockTokens)); err != nil {
		return err
	}
	if cp.Finish != "" {
		return fmt.Errorf("%w: the session finished (%s): nothing resumes it", kvsp.ErrInvalidState, cp.Finish)
	}
	if err := kvsp.ValidateSampler("resume: checkpoint.sampler", cp.Sampler.Method, cp.Sampler.Params, cp.Sampler.Seed); err != nil {
		return err // B10: what generation would run with
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.state != kvsp.StateActive {
		return fmt.Errorf("%w: the instance is %s", kvsp.ErrInvalidState, a.state)
	}
	a.dropFinishedLocked(time.Now())
	k := sessionKey{cp.ScopeID, cp.Session}
	if old := a.resumes[k]; old != nil && old.epoch >= r.Epoch {
		if old.epoch == r.Epoch {
			return nil // the same resume again
		}
		return kvsp.NewProblem(kvsp.ErrStaleEpoch, "a newer epoch of this session is here").With("epoch", old.epoch)
	}
	x := &resumed{epoch: r.Epoch, cp: *cp, ready: make(chan struct{})}
	a.resumes[k] = x
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

// resumeOf returns the resumed session a generate request continues, once
// its blocks are loaded: nil for a new session (epoch 1, and none resumed
// here). A session is found by its id within the request's scope only,
// so another scope's session is answered exactly as an id nobody uses
// (RELIABILITY S11): an epoch above 1 that this instance was not asked to
// resume is 404, a lower one than it was is 409 kvsp-stale-epoch. The
// prompt must be the checkpoint's, blocks and tail (409 otherwise).
// Nothing is streamed before these checks.
func (a *Agent) resumeOf(ctx context.Context, q *kvsp.GenerateRequest, keys []kvsp.BlockKey, tail []uint32) (*resumed, error) {
	a.mu.Lock()
	x := a.resumes[sessionKey{q.ScopeID, q.Session}]
	a.mu.Unlock()
	switch {
	case x == nil && q.Epoch == 1:
		return nil, nil // a new session
	case x == nil || q.Epoch > x.epoch:
		return nil, fmt.Errorf("%w: session: not resumed here at this epoch", kvsp.ErrNotFound)
	case q.Epoch < x.epoch:
		return nil, kvsp.NewProblem(kvsp.ErrStaleEpoch, "the session continues at a newer epoch").With("epoch", x.epoch)
	case !slices.Equal(x.cp.PromptBlocks, keys):
		return nil, fmt.Errorf("%w: the prompt's blocks are not the checkpoint's prompt_blocks", kvsp.ErrConflict)
	case !slices.Equal(x.cp.PromptTail, tail):
		return nil, fmt.Errorf("%w: the prompt's last tokens are not the checkpoint's prompt_tail", kvsp.ErrConflict)
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
	if !server.PrincipalFrom(r.Context()).MayUseScope(q.Checkpoint.ScopeID) {
		return fmt.Errorf("%w: resume", kvsp.ErrScopeDenied) // before the session is looked at
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

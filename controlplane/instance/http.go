package instance

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/server"
)

// Mount adds the instance's routes under r: prefetch (POST, GET) and PUT
// state of the resource table (callers: the controller), and POST
// generate for front ends (the client role and the request's scope).
// Reshard comes with the resharding step of its issue.
func (a *Agent) Mount(r *server.Router) error {
	handlers := map[string]server.HandlerFunc{
		"POST prefetch":                  a.postPrefetch,
		"GET prefetch/{id}":              a.getPrefetch,
		"PUT state":                      a.putState,
		"POST sessions/{session}/resume": a.postResume,
		"POST reshard":                   a.postReshard,
	}
	for _, rt := range server.RoutesOf(server.RoleInstance) {
		if h := handlers[rt.Method+" "+rt.Path]; h != nil {
			r.Handle(rt.Method, rt.Path, rt.Route(), h)
		}
	}
	r.Handle("POST", "generate", server.Route{Roles: []server.Role{server.RoleClient}, MaxBody: 8 << 20}, a.generate)
	return nil
}

func (a *Agent) postPrefetch(w http.ResponseWriter, r *http.Request) error {
	if err := server.RequireMediaType(r, kvsp.MediaType); err != nil {
		return err
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return err
		}
		return fmt.Errorf("%w: reading body: %v", kvsp.ErrInvalid, err)
	}
	var d kvsp.PrefetchDirective
	if err := kvsp.Decode(body, &d); err != nil {
		return err
	}
	// R-PF-16: the caller must be authorized for the directive's scope,
	// before any lease, GET or lookup (and before its id is looked at).
	if !server.PrincipalFrom(r.Context()).MayUseScope(d.ScopeID) {
		return fmt.Errorf("%w: prefetch", kvsp.ErrScopeDenied)
	}
	if err := a.Prefetch(&d, body); err != nil {
		return err
	}
	w.Header().Set("Location", "prefetch/"+d.Directive.String())
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusAccepted)
	return nil
}

func (a *Agent) getPrefetch(w http.ResponseWriter, r *http.Request) error {
	id, err := kvsp.ParseUUID(r.PathValue("id"))
	if err != nil {
		return fmt.Errorf("%w: directive id", kvsp.ErrInvalid)
	}
	st, scope, ok := a.prefetchStatus(id)
	if !ok || !server.PrincipalFrom(r.Context()).MayUseScope(scope) { // another scope's: as an unknown one (S11)
		return fmt.Errorf("%w: directive", kvsp.ErrNotFound)
	}
	return server.WriteJSON(w, http.StatusOK, &st)
}

func (a *Agent) putState(w http.ResponseWriter, r *http.Request) error {
	var b kvsp.StateBody
	if err := server.DecodeJSON(r, &b); err != nil {
		return err
	}
	if err := a.setState(b.State); err != nil {
		return err
	}
	return server.WriteJSON(w, http.StatusOK, &kvsp.StateBody{State: a.State()})
}

// generate runs a placed request and streams its tokens (kvsp's inference
// API; the spec leaves it out of scope): one GeneratedToken per line,
// flushed as produced, then a line with done.
func (a *Agent) generate(w http.ResponseWriter, r *http.Request) error {
	if ex, ok := a.cfg.Engine.(engine.External); ok && ex.External() {
		return fmt.Errorf("%w: this instance's engine runs its requests through its own API", kvsp.ErrInvalidState)
	}
	var q kvsp.GenerateRequest
	if err := server.DecodeJSON(r, &q); err != nil {
		return err
	}
	if !server.PrincipalFrom(r.Context()).MayUseScope(q.ScopeID) {
		return fmt.Errorf("%w: generate", kvsp.ErrScopeDenied)
	}
	key, ok := a.keys[q.ScopeID]
	if !ok {
		return fmt.Errorf("%w: this instance holds no key for the scope", kvsp.ErrScopeDenied)
	}
	if q.CompatID != a.compat {
		return fmt.Errorf("%w: this instance serves compat_id %s", kvsp.ErrIncompatible, a.compat)
	}
	// S14: only what the PC placed here.
	keys, err := a.placed(&q, key)
	if err != nil {
		return err
	}
	bt := int(a.g.BlockTokens)
	tail := q.Tokens[len(keys)*bt:]
	x, err := a.resumeOf(r.Context(), &q, keys, tail)
	if err != nil {
		return err
	}
	a.mu.Lock()
	switch {
	case a.closed:
		a.mu.Unlock()
		return fmt.Errorf("%w: the instance is stopping", kvsp.ErrUnavailable)
	case a.state != kvsp.StateActive && x == nil: // R-ST-14: no new sessions
		st := a.state
		a.mu.Unlock()
		return fmt.Errorf("%w: the instance is %s", kvsp.ErrInvalidState, st)
	}
	a.occ.change(a.running, a.cfg.Now())
	a.running++
	a.mu.Unlock()
	// The request counts as running (and, beyond the engine's batch, as
	// queued) while the engine works on it: once its last token is made,
	// lines still waiting for a slow client hold no room (B11).
	var once sync.Once
	engineDone := func() {
		once.Do(func() {
			a.mu.Lock()
			a.occ.change(a.running, a.cfg.Now())
			a.running--
			a.mu.Unlock()
			a.settle()
			a.kickStatus() // room for the next request: the PC hears it now, not at the next tick
		})
	}
	defer engineDone()
	// The blocks the PC's directive for this request is loading are
	// worth waiting for: the directive's deadline bounds the wait (R-PF-*).
	held := a.awaitPrefetch(r.Context(), q.ScopeID, q.Session)
	// What is resident now stays until the prefill uses it: the request
	// may wait for a place in the batch while others' prefills evict it.
	ready, unpin := a.pinReady(keys, held)
	defer unpin()
	req := engine.Request{Tokens: q.Tokens, Keys: keys, MaxTokens: int(q.MaxTokens), Sampler: engine.Sampler{Method: engine.Greedy}}
	var prefill atomic.Pointer[kvsp.PrefillInfo] // for the first line sent
	req.OnPrefill = func(st engine.PrefillStats) {
		unpin()
		if lost := ready - st.CachedTokens/bt; lost > 0 {
			a.m.lost.Add(float64(lost))
		}
		prefill.Store(&kvsp.PrefillInfo{CachedTokens: uint64(st.CachedTokens), ComputedTokens: uint64(st.ComputedTokens)})
		a.m.prompt.WithLabelValues("cached").Add(float64(st.CachedTokens))
		a.m.prompt.WithLabelValues("computed").Add(float64(st.ComputedTokens))
		// The prompt blocks it computed go to the instance's holder, which
		// publishes them: the next request with this prefix, on any
		// instance, can load them instead.
		first := min(len(keys), st.CachedTokens/int(a.g.BlockTokens)-len(st.Joined))
		joined := st.Joined
		for i, k := range keys[first:] {
			if len(joined) > 0 && joined[0] == first+i {
				joined = joined[1:] // loaded, not computed: its holder has it
				continue
			}
			a.offload(q.ScopeID, q.CompatID, k, first+i)
		}
	}
	if x != nil { // a resumed session continues from its checkpoint (R-SES-12..14)
		req.Generated = x.cp.Generated
	}
	// The chain past the prompt: blocks of generated tokens get keys, and
	// the instance's holder publishes them (R-SES-2).
	var prev kvsp.BlockKey
	if len(keys) > 0 {
		prev = keys[len(keys)-1]
	}
	if chain, err := kvsp.ResumeChain(key, q.CompatID, int(a.g.BlockTokens), prev, len(keys)); err == nil {
		req.GeneratedKeys = chain.Append(nil, req.PromptTail(int(a.g.BlockTokens))...)
		req.GeneratedKeys = chain.Append(req.GeneratedKeys, req.Generated...)
		req.Chain = chain
		pos := len(keys) + len(req.GeneratedKeys) // the chain's next block
		req.OnBlock = func(k kvsp.BlockKey) { a.offload(q.ScopeID, q.CompatID, k, pos); pos++ }
	}
	if s := q.Sampler; s != nil {
		req.Sampler = engine.Sampler{Method: s.Method, Seed: s.Seed}
		if p, ok := s.Params["p"].(float64); ok {
			req.Sampler.P = p
		}
	}
	if err := a.cfg.Engine.Check(&req); err != nil {
		return err // before anything is streamed: a problem, not a cut stream
	}
	w.Header().Set("Content-Type", kvsp.MediaTypeTokens)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	stop := context.AfterFunc(a.stopCtx, func() { cancel(a.stopCtx.Err()) }) // Close cuts the stream
	defer stop()
	// A front end that stops reading cancels the generation (its
	// sequence and pins freed): its stream is cut at the server's write
	// deadline, or its unread lines pass maxQueuedTokens.
	out := newTokenWriter(w, cancel)
	defer out.close()
	line := func(t kvsp.GeneratedToken) error {
		t.Prefill = prefill.Swap(nil)
		return out.line(t)
	}
	cp := a.newCheckpointer(&q, keys, req.PromptTail(int(a.g.BlockTokens)), line)
	if x != nil {
		if err := cp.resumeAt(x.cp.Generated, q.From); err != nil {
			return nil
		}
	}
	finish, err := a.cfg.Engine.Generate(ctx, req, cp.token)
	if err == nil {
		err = cp.finish()
	}
	engineDone()
	if err != nil {
		gone := out.failed() != nil
		if gone {
			a.m.notReading.Inc()
		}
		if (gone || r.Context().Err() != nil) && a.stopCtx.Err() == nil {
			// The front end went away: its sequence and pins are
			// free already (Generate returned), and the PC hears that the
			// session is over, so that it never migrates it.
			cp.end(kvsp.FinishCancelled)
			a.m.finished.WithLabelValues(string(kvsp.FinishCancelled)).Inc()
		}
		// The status is sent: the stream ends without its done line. A
		// client that went away (a reset stream) is routine: debug, not
		// one warning per stream (issue 19 item 9).
		lvl := slog.LevelWarn
		if r.Context().Err() != nil {
			lvl = slog.LevelDebug
		}
		a.log.Log(r.Context(), lvl, "generation stopped", "session", q.Session.String(), "err", err)
		return nil
	}
	err = line(kvsp.GeneratedToken{Index: uint64(len(cp.generated)), Epoch: q.Epoch, Done: true, Finish: finish})
	if err == nil {
		err = out.close()
	}
	if err != nil { // cut before its done line: the front end went away
		a.m.notReading.Inc()
		if (r.Context().Err() != nil || out.failed() != nil) && a.stopCtx.Err() == nil {
			cp.end(kvsp.FinishCancelled)
			a.m.finished.WithLabelValues(string(kvsp.FinishCancelled)).Inc()
		}
		return nil // the status is sent
	}
	cp.end(finish) // the front end has the whole output: the PC may close the session
	a.m.finished.WithLabelValues(string(finish)).Inc()
	if x != nil { // delivered whole: kept a while for a front end that missed the done line, then dropped
		a.mu.Lock()
		x.finished = time.Now()
		a.mu.Unlock()
	}
	return nil
}

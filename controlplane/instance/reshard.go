package instance

import (
	"context"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/server"
)

// shard is this instance's part of a sequence-sharded context (spec
// "Sequence-Sharded Caches and Resharding"): the blocks of the token
// ranges it holds at the map's current version, pinned in the engine's
// KV, and the plan for the next version while one is open.
type shard struct {
	mu      sync.Mutex // one message of a map at a time
	version uint64     // 0: never had a map (A-26: the first plan goes 0 to 1)
	planned uint64     // the highest version a plan was received for
	scope   kvsp.ScopeID
	owned   map[uint64]kvsp.BlockKey // block index (token / B) -> key
	cached  map[kvsp.BlockKey]bool   // owned blocks that were resident before this map took them: never dropped by it
	pending *openPlan
}

// openPlan is a plan received and loaded, waiting for commit or abort.
type openPlan struct {
	plan    kvsp.Reshard
	fetched map[uint64]kvsp.BlockKey // loaded (and pinned) for plan.To
	cached  map[kvsp.BlockKey]bool   // fetched blocks that were resident already (no transfer)
	moved   uint64
}

// release unpins a block of this map and drops it from the engine unless
// another user still pins it or it was resident before the map took it.
func release(kv engine.KV, key kvsp.BlockKey, cached bool) {
	if !kv.Unpin(key) && !cached {
		kv.Drop(key)
	}
}

// reshardMargin is the part of deadline_ms the instance keeps to answer
// in time when its fetches cannot finish (A-26: an error before the
// deadline rather than a hang).
const reshardMargin = 10 // percent

// shardKey names a map at the instance: its identifier within its scope
// (RELIABILITY S11: a plan, commit or abort of one scope never reaches
// another scope's map of the same identifier, nor tells it exists).
type shardKey struct {
	scope kvsp.ScopeID
	m     string
}

func (a *Agent) shardOf(scope kvsp.ScopeID, m string) *shard {
	a.mu.Lock()
	defer a.mu.Unlock()
	k := shardKey{scope, m}
	s := a.shards[k]
	if s == nil {
		s = &shard{scope: scope, owned: map[uint64]kvsp.BlockKey{}, cached: map[kvsp.BlockKey]bool{}}
		a.shards[k] = s
	}
	return s
}

// shardFor finds the map a reshard message is for, the caller authorized
// (may) for its scope before anything is looked at. A message naming its
// scope_id (kvsp's PC sends it with every message) gets that scope's map,
// 403 kvsp-scope-denied if the caller or this instance is not authorized
// for it. A message without one (the spec's form) gets the map of that
// identifier in a scope the caller may use; a first plan for a map held
// nowhere gets the instance's scope when it serves one only. Maps of
// scopes the caller may not use are never considered.
func (a *Agent) shardFor(r *kvsp.Reshard, may func(kvsp.ScopeID) bool) (*shard, error) {
	if !r.ScopeID.IsZero() {
		if _, ok := a.keys[r.ScopeID]; !ok || !may(r.ScopeID) {
			return nil, fmt.Errorf("%w: reshard", kvsp.ErrScopeDenied)
		}
		return a.shardOf(r.ScopeID, r.Map), nil
	}
	a.mu.Lock()
	var found []kvsp.ScopeID
	for k, s := range a.shards {
		if k.m == r.Map && (k.scope.IsZero() || may(k.scope)) && (len(s.owned) > 0 || s.pending != nil || s.version > 0) {
			found = append(found, k.scope)
		}
	}
	a.mu.Unlock()
	switch {
	case len(found) == 1:
		return a.shardOf(found[0], r.Map), nil
	case len(found) > 1:
		return nil, fmt.Errorf("%w: reshard: scope_id: this map identifier is held in several scopes; name the scope", kvsp.ErrInvalid)
	}
	var scope kvsp.ScopeID
	if len(a.keys) == 1 {
		for id := range a.keys {
			if may(id) {
				scope = id
			}
		}
	}
	return a.shardOf(scope, r.Map), nil
}

// Reshard handles one message of the resharding procedure: a plan is
// acknowledged (nil error) once every fetched range is loaded and pinned;
// a commit makes the plan's version current and releases the ranges the
// plan lists; an abort discards what the plan fetched (R-RSH-7, R-RSH-10,
// R-RSH-12, A-26). A message that does not match the map's version is
// 409 kvsp-plan-conflict (R-RSH-13, R-RSH-14).
func (a *Agent) Reshard(ctx context.Context, r *kvsp.Reshard) (*kvsp.ReshardAck, error) {
	return a.reshard(ctx, r, func(kvsp.ScopeID) bool { return true })
}

// reshard is Reshard for a caller authorized (may) for some scopes.
func (a *Agent) reshard(ctx context.Context, r *kvsp.Reshard, may func(kvsp.ScopeID) bool) (*kvsp.ReshardAck, error) {
	received := time.Now()
	s, err := a.shardFor(r, may)
	if err != nil {
		return nil, err
	}
	if r.Kind == kvsp.ReshardPlan {
		// The spec's plan has neither member: the model is the instance's
		// own, the scope the map's (shardFor).
		x := *r
		if x.CompatID.IsZero() {
			x.CompatID = a.compat
		}
		if x.ScopeID.IsZero() {
			x.ScopeID = s.scope
		}
		r = &x
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ack := func(moved uint64) *kvsp.ReshardAck {
		return &kvsp.ReshardAck{Map: r.Map, Version: s.version, FetchedBytes: moved}
	}
	switch r.Kind {
	case kvsp.ReshardCommit:
		switch {
		case s.version == r.Commit && s.pending == nil: // committed already
			return ack(0), nil
		case s.pending == nil || s.pending.plan.To != r.Commit || !samePlan(r.Plan, s.pending.plan.Plan):
			return nil, kvsp.NewProblem(kvsp.ErrPlanConflict, "no acknowledged plan for this version").With("version", s.version)
		}
		p := s.pending
		kv := a.cfg.Engine.KV()
		for _, x := range p.plan.Release { // R-RSH-10: the memory is freed
			for i := x[0] / a.blockTokens(); i < x[1]/a.blockTokens(); i++ {
				k := s.owned[i]
				release(kv, k, s.cached[k])
				delete(s.owned, i)
				delete(s.cached, k)
			}
		}
		for i, k := range p.fetched {
			s.owned[i] = k
			if p.cached[k] {
				s.cached[k] = true
			}
		}
		s.version, s.pending = p.plan.To, nil
		a.m.reshards.WithLabelValues("committed").Inc()
		return ack(0), nil
	case kvsp.ReshardAbort:
		switch {
		case s.pending != nil && s.pending.plan.To == r.Abort && !samePlan(r.Plan, s.pending.plan.Plan):
			return nil, kvsp.NewProblem(kvsp.ErrPlanConflict, "the open plan for this version is another one").With("version", s.version)
		case s.pending != nil && s.pending.plan.To == r.Abort:
			a.discard(s)
			a.m.reshards.WithLabelValues("aborted").Inc()
			return ack(0), nil
		case s.pending == nil && s.version < r.Abort && s.planned >= r.Abort: // aborted already, or never loaded
			return ack(0), nil
		}
		return nil, kvsp.NewProblem(kvsp.ErrPlanConflict, "no open plan for this version").With("version", s.version)
	}

	// A plan. An instance that holds nothing of the map (a new member, or
	// one that released all) joins at the plan's version.
	joining := len(s.owned) == 0 && r.From > s.version
	if (r.From != s.version && !joining) || r.To != r.From+1 {
		return nil, kvsp.NewProblem(kvsp.ErrPlanConflict, "the plan does not go from this instance's version to the next").With("version", s.version)
	}
	if s.pending != nil {
		if reflect.DeepEqual(&s.pending.plan, r) {
			return ack(s.pending.moved), nil // the same plan again
		}
		if r.Term < s.pending.plan.Term { // a deposed PC's: its successor's plan stays
			return nil, kvsp.NewProblem(kvsp.ErrPlanConflict, "a plan of a later controller term is open for this version").With("version", s.version)
		}
		a.discard(s) // a new plan for the same version replaces it (a PC that restarted, or took over)
	}
	if err := a.checkPlan(s, r); err != nil {
		return nil, err
	}
	s.planned = max(s.planned, r.To)
	deadline := received.Add(kvsp.Millis(r.DeadlineMs * (100 - reshardMargin) / 100)) // deadline_ms <= 2^53: no overflow
	fctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	p, err := a.fetchRanges(fctx, r)
	if err != nil {
		a.m.reshards.WithLabelValues("failed").Inc()
		return nil, err
	}
	s.pending = p
	a.m.reshards.WithLabelValues("acknowledged").Inc()
	return ack(p.moved), nil
}

func (a *Agent) blockTokens() uint64 { return uint64(a.g.BlockTokens) }

// samePlan: a message that names no plan (another PC's, or a commit sent
// again) applies to the open one; one that names a plan, only to it.
func samePlan(msg, open kvsp.UUID) bool { return msg.IsZero() || msg == open }

// checkPlan: ranges are multiples of B; retain and release are
// exactly the ranges held at the current version, so that nothing held is
// left unaccounted (409 otherwise: the plan is for another map state); a
// fetch needs the kvsp extension members that name its blocks.
func (a *Agent) checkPlan(s *shard, r *kvsp.Reshard) error {
	if err := r.ValidateFor(int(a.g.BlockTokens)); err != nil {
		return err
	}
	if r.CompatID != a.compat {
		return fmt.Errorf("%w: this instance serves compat_id %s", kvsp.ErrIncompatible, a.compat)
	}
	b := a.blockTokens()
	seen := map[uint64]bool{}
	for _, set := range [][]kvsp.TokenRange{r.Retain, r.Release} {
		for _, x := range set {
			for i := x[0] / b; i < x[1]/b; i++ {
				if _, ok := s.owned[i]; !ok {
					return kvsp.NewProblem(kvsp.ErrPlanConflict, "the plan retains or releases tokens this instance does not hold").With("version", s.version)
				}
				seen[i] = true
			}
		}
	}
	if len(seen) != len(s.owned) {
		return kvsp.NewProblem(kvsp.ErrPlanConflict, "the plan neither retains nor releases some tokens this instance holds").With("version", s.version)
	}
	// A range to fetch is named by Block Keys, which the instance cannot
	// compute without the tokens: kvsp's extension members carry them.
	// Without them the plan cannot be carried out: 400 at once, well
	// before its deadline.
	for i, f := range r.Fetch {
		switch {
		case f.BlockKeys == nil:
			return fmt.Errorf("%w: reshard plan: fetch[%d].block_keys: required to fetch a range (a kvsp extension member: the Block Keys of its blocks)", kvsp.ErrInvalid, i)
		case r.ScopeID.IsZero():
			return fmt.Errorf("%w: reshard plan: scope_id: required to fetch a range (this instance holds no map of that identifier and serves more than one scope)", kvsp.ErrInvalid)
		}
	}
	return nil
}

// fetchRanges loads the plan's fetch ranges (block GETs at the source's
// holder, then at any holder the IS names; verified layer by layer) and
// pins them. Retained ranges are never touched (R-RSH-6).
func (a *Agent) fetchRanges(ctx context.Context, r *kvsp.Reshard) (*openPlan, error) {
	p := &openPlan{plan: *r, fetched: map[uint64]kvsp.BlockKey{}, cached: map[kvsp.BlockKey]bool{}}
	x := &directive{d: kvsp.PrefetchDirective{Directive: kvsp.NewUUID(), ScopeID: r.ScopeID, CompatID: r.CompatID, LeaseMs: max(r.DeadlineMs, 1000)},
		pending: true, purpose: "reshard"}
	var index []uint64
	for _, f := range r.Fetch {
		for j, k := range f.BlockKeys {
			blk := kvsp.PrefetchBlock{BlockKey: k}
			if f.Holder != "" {
				blk.Sources = []string{f.Holder}
			}
			x.d.Blocks = append(x.d.Blocks, blk)
			index = append(index, f.Tokens[0]/a.blockTokens()+uint64(j))
		}
	}
	if len(x.d.Blocks) == 0 {
		return p, nil
	}
	kv := a.cfg.Engine.KV()
	for _, b := range x.d.Blocks {
		if kv.Has(b.BlockKey) {
			p.cached[b.BlockKey] = true // no transfer; and the engine's, not this plan's, to drop
		}
	}
	a.addIndexSources(ctx, &x.d)
	a.run(ctx, x)
	p.moved = x.moved.Load()
	st := x.status()
	for i, b := range x.d.Blocks {
		if i >= len(st.Loaded) || !kv.Pin(b.BlockKey) {
			for j := range i {
				k := x.d.Blocks[j].BlockKey
				release(kv, k, p.cached[k])
			}
			if ctx.Err() != nil {
				return nil, fmt.Errorf("%w: the plan's ranges could not be loaded before its deadline", kvsp.ErrUnavailable)
			}
			return nil, fmt.Errorf("%w: the plan's ranges could not be loaded", kvsp.ErrUnavailable)
		}
		p.fetched[index[i]] = b.BlockKey
	}
	return p, nil
}

// addIndexSources appends the holders the IS names for each block to its
// sources (after the source instance's holder).
func (a *Agent) addIndexSources(ctx context.Context, d *kvsp.PrefetchDirective) {
	if a.cfg.Index == "" {
		return
	}
	keys := make([]kvsp.BlockKey, len(d.Blocks))
	for i, b := range d.Blocks {
		keys[i] = b.BlockKey
	}
	resp, err := a.cfg.Client.Index(a.cfg.Index).Lookup(ctx, &kvsp.LookupRequest{ScopeID: d.ScopeID, CompatID: d.CompatID, BlockKeys: keys})
	if err != nil {
		return
	}
	for i, reps := range resp.Replicas {
		for _, r := range reps {
			if len(d.Blocks[i].Sources) == 0 || d.Blocks[i].Sources[0] != r.Holder {
				d.Blocks[i].Sources = append(d.Blocks[i].Sources, r.Holder)
			}
		}
	}
}

// discard forgets an open plan and the blocks it fetched (R-RSH-12).
func (a *Agent) discard(s *shard) {
	kv := a.cfg.Engine.KV()
	for _, k := range s.pending.fetched {
		release(kv, k, s.pending.cached[k])
	}
	s.pending = nil
}

// ShardPlanOpen reports a plan for map m that this instance acknowledged
// and has not seen committed or aborted yet (its fetched blocks pinned).
func (a *Agent) ShardPlanOpen(scope kvsp.ScopeID, m string) bool {
	s := a.shardOf(scope, m)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pending != nil
}

// ShardRanges returns the token ranges this instance holds of a map at its
// current version, in order, merged.
func (a *Agent) ShardRanges(scope kvsp.ScopeID, m string) (version uint64, ranges []kvsp.TokenRange) {
	s := a.shardOf(scope, m)
	s.mu.Lock()
	defer s.mu.Unlock()
	b := a.blockTokens()
	var idx []uint64
	for i := range s.owned {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	for _, i := range idx {
		if n := len(ranges); n > 0 && ranges[n-1][1] == i*b {
			ranges[n-1][1] += b
			continue
		}
		ranges = append(ranges, kvsp.TokenRange{i * b, (i + 1) * b})
	}
	return s.version, ranges
}

func (a *Agent) postReshard(w http.ResponseWriter, r *http.Request) error {
	var q kvsp.Reshard
	if err := server.DecodeJSON(r, &q); err != nil {
		return err
	}
	ack, err := a.reshard(r.Context(), &q, server.PrincipalFrom(r.Context()).MayUseScope)
	if err != nil {
		return err
	}
	w.Header().Set("Cache-Control", "no-store")
	return server.WriteJSON(w, http.StatusOK, ack)
}

package placement

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/failpoint"
)

// ShardContext is a sequence-sharded context (spec "Sequence-Sharded Caches
// and Resharding"): its Shard Map at the authoritative version and the
// Block Keys of its tokens (key i covers tokens [i*B, (i+1)*B)), so that
// plans can name the blocks of the ranges they move.
type ShardContext struct {
	Map      kvsp.ShardMap
	ScopeID  kvsp.ScopeID
	CompatID kvsp.CompatID
	Keys     []kvsp.BlockKey
}

// ReshardRequest asks the PC to move a context to its next map.
type ReshardRequest struct {
	// Next is the new map: its version is the current one plus one (1 for
	// a context that never had a map, A-26), its shards cover the
	// context's complete blocks, in multiples of B.
	Next     kvsp.ShardMap
	ScopeID  kvsp.ScopeID
	CompatID kvsp.CompatID
	// Tokens are the context's tokens: required for its first map, and
	// whenever it grew (the keys of the known prefix must not change).
	Tokens []uint32
	// Deadline is each plan's deadline_ms; default 2s.
	Deadline time.Duration
}

// ReshardResult is a committed reshard.
type ReshardResult struct {
	Version uint64
	// Plans are the plans sent, by instance.
	Plans map[string]*kvsp.Reshard
	// FetchedBytes are the octets each member reported it transferred.
	FetchedBytes map[string]uint64
}

// MaxReshardDeadline bounds a plan's deadline_ms: below the PC's client
// timeout, so that a member's answer (or its absence) is what decides.
const MaxReshardDeadline = 8 * time.Second

// ErrReshardAborted: a member did not acknowledge its plan in time; every
// member was sent an abort and the map stays at its version (R-RSH-11).
var ErrReshardAborted = fmt.Errorf("%w: the reshard was aborted", kvsp.ErrUnavailable)

// shardEntry serializes the reshards of one map; its current context is
// read without waiting for a reshard under way.
type shardEntry struct {
	mu  sync.Mutex
	ctx atomic.Pointer[ShardContext] // nil: no map yet; written with mu held
}

// mapKey names a sequence-sharded context: its map identifier within its
// scope. A map identifier another scope uses names nothing in yours
// (RELIABILITY S11): not its version, not its members.
type mapKey struct {
	scope kvsp.ScopeID
	m     string
}

func (c *Controller) shardEntry(scope kvsp.ScopeID, m string) *shardEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := mapKey{scope, m}
	e := c.maps[k]
	if e == nil {
		e = &shardEntry{}
		c.maps[k] = e
	}
	return e
}

// ShardMap returns a context's map at its authoritative version.
func (c *Controller) ShardMap(scope kvsp.ScopeID, m string) (kvsp.ShardMap, bool) {
	cur := c.shardEntry(scope, m).ctx.Load()
	if cur == nil {
		return kvsp.ShardMap{}, false
	}
	return cur.Map, true
}

// Reshard moves a context from version v to v+1 by two-phase commit: it
// sends every instance of either version its plan (retain what stays,
// fetch what moves to it, release what leaves it; R-RSH-3..6), waits up
// to the deadline for all of them to acknowledge (each does once its
// fetches are loaded, R-RSH-7), records v+1 durably, and sends commit to
// all (R-RSH-9). If any member does not acknowledge in time, all are sent
// abort and v stays authoritative (R-RSH-8, R-RSH-11).
func (c *Controller) Reshard(ctx context.Context, q *ReshardRequest) (*ReshardResult, error) {
	if c.standby.Load() {
		return nil, ErrNotLeader
	}
	if err := q.Next.Validate(); err != nil {
		return nil, err
	}
	if _, ok := c.keys[q.ScopeID]; !ok {
		return nil, fmt.Errorf("%w: the PC holds no key for this scope", kvsp.ErrScopeDenied)
	}
	bt := c.cfg.BlockTokens[q.CompatID]
	if bt == 0 {
		return nil, fmt.Errorf("%w: no instance serves this compat_id", kvsp.ErrIncompatible)
	}
	if q.Deadline <= 0 {
		q.Deadline = 2 * time.Second
	}
	if q.Deadline > MaxReshardDeadline {
		return nil, fmt.Errorf("%w: deadline_ms: at most %d", kvsp.ErrInvalid, MaxReshardDeadline.Milliseconds())
	}
	e := c.shardEntry(q.ScopeID, q.Next.Map)
	if !e.mu.TryLock() { // one at a time: a second would find its version taken, or a member's plan open
		var v uint64
		if cur := e.ctx.Load(); cur != nil {
			v = cur.Map.Version
		}
		return nil, kvsp.NewProblem(kvsp.ErrPlanConflict, "a reshard of this map is under way").With("version", v)
	}
	defer e.mu.Unlock()

	cur := &ShardContext{Map: kvsp.ShardMap{Map: q.Next.Map}, ScopeID: q.ScopeID, CompatID: q.CompatID}
	if x := e.ctx.Load(); x != nil {
		cur = x
	}
	if q.Next.Version != cur.Map.Version+1 {
		return nil, kvsp.NewProblem(kvsp.ErrPlanConflict, "the new map's version is not the current one plus one").With("version", cur.Map.Version)
	}
	if cur.CompatID != q.CompatID {
		return nil, fmt.Errorf("%w: the context is of another model", kvsp.ErrIncompatible)
	}
	keys := cur.Keys
	if q.Tokens != nil {
		k, err := kvsp.BlockKeys(c.keys[q.ScopeID], q.CompatID, bt, q.Tokens)
		if err != nil {
			return nil, err
		}
		if len(k) < len(keys) || !slices.Equal(k[:len(keys)], keys) {
			return nil, fmt.Errorf("%w: the tokens are not the context's", kvsp.ErrConflict)
		}
		keys = k
	}
	b := uint64(bt)
	last := q.Next.Shards[len(q.Next.Shards)-1].Tokens[1]
	for _, s := range q.Next.Shards {
		if s.Tokens[0]%b != 0 || s.Tokens[1]%b != 0 {
			return nil, fmt.Errorf("%w: shard map: token ranges must be multiples of block_tokens (%d)", kvsp.ErrInvalid, bt)
		}
	}
	if last != uint64(len(keys))*b {
		return nil, fmt.Errorf("%w: shard map: the shards must cover the context's %d complete blocks", kvsp.ErrInvalid, len(keys))
	}
	for i, s := range q.Next.Shards { // S12: a scope's blocks go only to its instances
		if !c.authorizedURI(s.Instance, q.ScopeID) {
			return nil, fmt.Errorf("%w: shard map: shards[%d].instance is not an instance of this scope", kvsp.ErrScopeDenied, i)
		}
	}

	// The decisions outlive the request that asked for them: a commit or
	// abort not sent would leave members with an open plan.
	dctx := context.WithoutCancel(ctx)
	// A member that missed the commit of the current version (a lost
	// message) gets it again first: commits are idempotent.
	if cur.Map.Version > 0 {
		var members []string
		for _, s := range cur.Map.Shards {
			if !slices.Contains(members, s.Instance) {
				members = append(members, s.Instance)
			}
		}
		// One short try each: a member that cannot take it fails the plan anyway.
		c.send(dctx, members, &kvsp.Reshard{Kind: kvsp.ReshardCommit, Map: cur.Map.Map, ScopeID: cur.ScopeID, Commit: cur.Map.Version}, 1, time.Second)
	}

	plans := PlanReshard(cur.Map, q.Next)
	deadlineMs := uint64(max(1, q.Deadline.Milliseconds()))
	planID := kvsp.NewUUID()
	term := uint64(c.planTerm.Load())
	for inst, p := range plans {
		p.DeadlineMs, p.ScopeID, p.CompatID, p.Plan, p.Term = deadlineMs, q.ScopeID, q.CompatID, planID, term
		for i := range p.Fetch {
			f := &p.Fetch[i]
			f.BlockKeys = keys[f.Tokens[0]/b : f.Tokens[1]/b]
			if f.From != inst {
				if st, ok := c.reg.Get(f.From); ok {
					f.Holder = st.Status.Holder
				}
			}
		}
	}

	// Phase one: every member acknowledges within deadline_ms.
	pctx, cancel := context.WithTimeout(ctx, q.Deadline)
	defer cancel()
	res := &ReshardResult{Version: q.Next.Version, Plans: plans, FetchedBytes: map[string]uint64{}}
	var (
		mu     sync.Mutex
		failed error
		wg     sync.WaitGroup
	)
	for inst, p := range plans {
		wg.Go(func() {
			ack, err := c.cfg.Instances.Reshard(pctx, inst, p)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if failed == nil {
					failed = fmt.Errorf("%s: %w", inst, err)
				}
				return
			}
			res.FetchedBytes[inst] = ack.FetchedBytes
		})
	}
	wg.Wait()
	failpoint.Eval("pc/reshard-acked") // F12: a crash between the acknowledgements and the decision
	members := make([]string, 0, len(plans))
	for inst := range plans {
		members = append(members, inst)
	}
	slices.Sort(members)
	if failed != nil {
		c.m.reshards.WithLabelValues("aborted").Inc()
		c.log.Warn("reshard aborted", "map", q.Next.Map, "to", q.Next.Version, "err", failed)
		c.broadcast(dctx, members, &kvsp.Reshard{Kind: kvsp.ReshardAbort, Map: q.Next.Map, ScopeID: q.ScopeID, Abort: q.Next.Version, Plan: planID})
		return nil, fmt.Errorf("%w: %w", ErrReshardAborted, failed)
	}

	// The decision is recorded before any member hears it.
	next := &ShardContext{Map: q.Next, ScopeID: q.ScopeID, CompatID: q.CompatID, Keys: keys}
	if c.cfg.State != nil {
		if err := c.cfg.State.PutShardMap(next); err != nil {
			c.log.Error("controller state not written; aborting the reshard", "err", err)
			c.broadcast(dctx, members, &kvsp.Reshard{Kind: kvsp.ReshardAbort, Map: q.Next.Map, ScopeID: q.ScopeID, Abort: q.Next.Version, Plan: planID})
			return nil, fmt.Errorf("%w: the controller's state could not be written", kvsp.ErrUnavailable)
		}
	}
	e.ctx.Store(next)
	failpoint.Eval("pc/reshard-recorded") // F12: a crash between the decision and the commits
	c.broadcast(dctx, members, &kvsp.Reshard{Kind: kvsp.ReshardCommit, Map: q.Next.Map, ScopeID: q.ScopeID, Commit: q.Next.Version, Plan: planID})
	c.m.reshards.WithLabelValues("committed").Inc()
	return res, nil
}

// resolveMaps ends what a crash of the previous PC (or of the deposed
// leader) left open, once after a start with saved state or a takeover:
// the stored version of each map is the decision, so its commit is sent
// to its members (a member that missed it catches up), and any plan still
// open for the version after it is aborted at every instance known (its
// decision was never recorded, so no member can have heard a commit of
// it). Without this, members kept an open plan, and the blocks it fetched
// pinned, until the next reshard of the map (RELIABILITY F12).
func (c *Controller) resolveMaps(ctx context.Context) {
	c.mu.Lock()
	entries := make([]*shardEntry, 0, len(c.maps))
	for _, e := range c.maps {
		entries = append(entries, e)
	}
	c.mu.Unlock()
	known := c.reg.URIs()
	for _, e := range entries {
		if !e.mu.TryLock() {
			continue // a reshard of this map is under way here: its plan replaces the open one, its decision ends it
		}
		cur := e.ctx.Load()
		if cur != nil && cur.Map.Version > 0 {
			var members, all []string
			for _, s := range cur.Map.Shards {
				if !slices.Contains(members, s.Instance) {
					members = append(members, s.Instance)
				}
			}
			for _, uri := range known {
				// S12: never to an instance known to be outside the map's
				// scope; one known only from saved state (not reported
				// since the restart, its identity not known yet) gets it,
				// since the plan to abort may have reached it.
				if st, _ := c.reg.Get(uri); st.Status.Instance == "" || c.authorized(st, cur.ScopeID) {
					all = append(all, uri)
				}
			}
			c.send(ctx, members, &kvsp.Reshard{Kind: kvsp.ReshardCommit, Map: cur.Map.Map, ScopeID: cur.ScopeID, Commit: cur.Map.Version}, 2, time.Second)
			c.send(ctx, all, &kvsp.Reshard{Kind: kvsp.ReshardAbort, Map: cur.Map.Map, ScopeID: cur.ScopeID, Abort: cur.Map.Version + 1}, 1, time.Second)
		}
		e.mu.Unlock()
	}
}

// broadcast sends a commit or abort to every member, retrying each a few
// times (both are idempotent, A-26).
func (c *Controller) broadcast(ctx context.Context, members []string, m *kvsp.Reshard) {
	c.send(ctx, members, m, 4, 2*time.Second)
}

// send delivers m to every member at once, each with up to tries tries of
// timeout each.
func (c *Controller) send(ctx context.Context, members []string, m *kvsp.Reshard, tries int, timeout time.Duration) {
	var wg sync.WaitGroup
	for _, inst := range members {
		wg.Go(func() {
			var err error
			for try := range tries {
				if try > 0 {
					select {
					case <-ctx.Done():
						return
					case <-time.After(time.Duration(try) * 50 * time.Millisecond):
					}
				}
				cctx, cancel := context.WithTimeout(ctx, timeout)
				_, err = c.cfg.Instances.Reshard(cctx, inst, m)
				cancel()
				if err == nil || errors.Is(err, kvsp.ErrPlanConflict) {
					break
				}
			}
			if err != nil {
				c.log.Warn("reshard message not delivered", "instance", inst, "map", m.Map, "err", err)
			}
		})
	}
	wg.Wait()
}

// PlanReshard computes each member's plan from version cur to next (both
// valid maps of the same context; cur may have no shards): a range held
// by the same instance in both is retained (R-RSH-5) and never fetched
// (R-RSH-6); a range an instance gains is fetched from its owner in cur
// (from the instance itself, through the IS, where cur had no owner); a
// range it loses is released. Every instance of either version gets a
// plan (R-RSH-3). Deadline and extension members are the caller's.
func PlanReshard(cur, next kvsp.ShardMap) map[string]*kvsp.Reshard {
	plans := map[string]*kvsp.Reshard{}
	member := func(inst string) *kvsp.Reshard {
		p := plans[inst]
		if p == nil {
			p = &kvsp.Reshard{Kind: kvsp.ReshardPlan, Map: next.Map, From: cur.Version, To: next.Version,
				Retain: []kvsp.TokenRange{}, Fetch: []kvsp.ReshardFetch{}, Release: []kvsp.TokenRange{}}
			plans[inst] = p
		}
		return p
	}
	for _, s := range cur.Shards {
		member(s.Instance)
	}
	for _, s := range next.Shards {
		member(s.Instance)
	}
	for inst, p := range plans {
		had, has := rangesOf(cur, inst), rangesOf(next, inst)
		p.Retain = intersect(had, has)
		p.Release = subtract(had, has)
		for _, gain := range subtract(has, had) {
			for _, piece := range owners(cur, gain) {
				from := piece.Instance
				if from == "" {
					from = inst
				}
				p.Fetch = append(p.Fetch, kvsp.ReshardFetch{Tokens: piece.Tokens, From: from})
			}
		}
	}
	return plans
}

func rangesOf(m kvsp.ShardMap, inst string) []kvsp.TokenRange {
	var out []kvsp.TokenRange
	for _, s := range m.Shards {
		if s.Instance != inst {
			continue
		}
		if n := len(out); n > 0 && out[n-1][1] == s.Tokens[0] {
			out[n-1][1] = s.Tokens[1]
			continue
		}
		out = append(out, s.Tokens)
	}
	return out
}

// intersect and subtract work on sorted, disjoint range lists.
func intersect(a, b []kvsp.TokenRange) []kvsp.TokenRange {
	out := []kvsp.TokenRange{}
	for _, x := range a {
		for _, y := range b {
			if lo, hi := max(x[0], y[0]), min(x[1], y[1]); lo < hi {
				out = append(out, kvsp.TokenRange{lo, hi})
			}
		}
	}
	return out
}

func subtract(a, b []kvsp.TokenRange) []kvsp.TokenRange {
	out := []kvsp.TokenRange{}
	for _, x := range a {
		lo := x[0]
		for _, y := range b {
			if y[1] <= lo || y[0] >= x[1] {
				continue
			}
			if y[0] > lo {
				out = append(out, kvsp.TokenRange{lo, y[0]})
			}
			lo = max(lo, y[1])
		}
		if lo < x[1] {
			out = append(out, kvsp.TokenRange{lo, x[1]})
		}
	}
	return out
}

// owners splits r by the shards of m that cover it; parts no shard covers
// have no instance.
func owners(m kvsp.ShardMap, r kvsp.TokenRange) []kvsp.Shard {
	var out []kvsp.Shard
	lo := r[0]
	for _, s := range m.Shards {
		a, b := max(lo, s.Tokens[0]), min(r[1], s.Tokens[1])
		if a >= b {
			continue
		}
		if a > lo {
			out = append(out, kvsp.Shard{Tokens: kvsp.TokenRange{lo, a}})
		}
		out = append(out, kvsp.Shard{Tokens: kvsp.TokenRange{a, b}, Instance: s.Instance})
		lo = b
	}
	if lo < r[1] {
		out = append(out, kvsp.Shard{Tokens: kvsp.TokenRange{lo, r[1]}})
	}
	return out
}

package instance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// Prefetch directives (R-PF-*): accepted, run on the agent's transfer
// slots in prefix order, leased per holder, and the loaded blocks pinned
// for the request they were sent for.

// directive is a prefetch directive being executed or done.
type directive struct {
	d       kvsp.PrefetchDirective
	body    []byte        // as received, for idempotent re-POSTs
	purpose string        // "prefetch" or "reshard", for the metrics
	moved   atomic.Uint64 // octets of KV received

	done chan struct{} // closed when it finished

	mu        sync.Mutex
	pending   bool
	anyFailed bool
	firstErr  error // the first block's failure: the directive's reason
	loaded    []kvsp.BlockKey
	failed    []kvsp.BlockKey
	doneAt    time.Time
	// pins are the loaded blocks a prefetch directive keeps resident for
	// the request it was sent for (within the agent's pin budget): the
	// request takes them over when it starts (takePins), or they go
	// lease_ms after the directive finished (hold).
	pins  []kvsp.BlockKey
	taken bool // the request took the pins: no more are added
	hold  *time.Timer
	// received is when a PC's directive came (zero for the agent's own,
	// whose transfers stop at their deadline; late says how a PC's go on);
	// heard lists the holders a layer came from (links: the round trip).
	received time.Time
	heard    map[string]bool
}

// late is how long the transfers under way at a PC's directive's deadline
// may go on: to the lease's end. The directive ends at its deadline as the
// spec says, and the request starts, but a block already moving still
// lands, and the engine uses it if its prefill has not reached it yet
// (issue 47). Zero (the agent's own directives): transfers stop at the
// deadline.
func (d *directive) late() time.Time {
	if d.received.IsZero() {
		return time.Time{}
	}
	return d.received.Add(time.Duration(max(d.d.DeadlineMs, d.d.LeaseMs)) * time.Millisecond)
}

// firstFrom reports whether this is the directive's first layer from
// holder, and since when to count its round trip: the directive's receipt,
// or start (the GET's) for a directive of the agent's own.
func (d *directive) firstFrom(holder string, start time.Time) (since time.Time, first bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.heard[holder] {
		return time.Time{}, false
	}
	if d.heard == nil {
		d.heard = map[string]bool{}
	}
	d.heard[holder] = true
	if d.received.IsZero() {
		return start, true
	}
	return d.received, true
}

// takePins hands the directive's pins to the caller, who unpins them.
func (d *directive) takePins() []kvsp.BlockKey {
	d.mu.Lock()
	defer d.mu.Unlock()
	pins := d.pins
	d.pins, d.taken = nil, true
	if d.hold != nil {
		d.hold.Stop()
	}
	return pins
}

func (d *directive) status() kvsp.PrefetchStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	st := kvsp.PrefetchStatus{Directive: d.d.Directive, Loaded: append([]kvsp.BlockKey{}, d.loaded...), Failed: append([]kvsp.BlockKey{}, d.failed...)}
	switch {
	case d.pending:
		st.State = kvsp.PrefetchPending
	case len(d.failed) == 0:
		st.State = kvsp.PrefetchComplete
	case len(d.loaded) > 0:
		st.State = kvsp.PrefetchPartial // the leading prefix loaded
	default:
		st.State = kvsp.PrefetchFailed
	}
	return st
}

func (d *directive) finishedBefore(t time.Time) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return !d.pending && d.doneAt.Before(t)
}

// ErrPendingQuota: too many directives pending (R-PF-13).
var ErrPendingQuota = fmt.Errorf("%w: too many prefetch directives pending", kvsp.ErrTooManyRequests)

// Prefetch accepts a directive (R-PF-2): it starts loading at once and
// returns; body is the request body as received. A directive with the
// same id and body is accepted again without effect; another body with
// that id is 409. A draining or sleeping instance refuses (409
// kvsp-invalid-state, R-ST-14, A-36).
func (a *Agent) Prefetch(d *kvsp.PrefetchDirective, body []byte) error {
	if _, ok := a.keys[d.ScopeID]; !ok { // R-PF-16: before any lease, GET or lookup
		return fmt.Errorf("%w: this instance holds no key for the directive's scope", kvsp.ErrScopeDenied)
	}
	if d.CompatID != a.compat {
		return fmt.Errorf("%w: this instance serves compat_id %s", kvsp.ErrIncompatible, a.compat)
	}
	received := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if old := a.directives[d.Directive]; old != nil {
		if !bytes.Equal(old.body, body) {
			return fmt.Errorf("%w: directive %s exists with another body", kvsp.ErrConflict, d.Directive)
		}
		return nil
	}
	if a.state != kvsp.StateActive {
		return fmt.Errorf("%w: the instance is %s", kvsp.ErrInvalidState, a.state)
	}
	pending := 0
	for id, x := range a.directives {
		st := x.status()
		if st.State == kvsp.PrefetchPending {
			pending++
		} else if x.finishedBefore(received.Add(-kvsp.Millis(x.d.LeaseMs))) {
			delete(a.directives, id) // kept lease_ms after completion
		}
	}
	if pending >= a.cfg.MaxPending {
		return ErrPendingQuota
	}
	x := &directive{d: *d, body: bytes.Clone(body), pending: true, purpose: "prefetch", done: make(chan struct{})}
	a.directives[d.Directive] = x
	// deadline_ms counts from receipt. Transfers under way at the
	// deadline may finish within the lease (run says why).
	ctx, cancel := context.WithDeadline(context.Background(), received.Add(kvsp.Millis(d.DeadlineMs)))
	x.received = received
	go func() {
		defer cancel()
		a.run(ctx, x)
	}()
	return nil
}

// pinKey pins a resident block within the pin budget: a quarter of the
// engine's KV (nothing is pinned when its capacity is not known), so that
// running requests always have room.
func (a *Agent) pinKey(k kvsp.BlockKey) bool {
	if a.pinned.Load() >= int64(a.cfg.Engine.Stats().KVBlocks/4) || !a.cfg.Engine.KV().Pin(k) {
		return false
	}
	a.pinned.Add(1)
	return true
}

// unpinKeys undoes pinKey for each of keys.
func (a *Agent) unpinKeys(keys []kvsp.BlockKey) {
	kv := a.cfg.Engine.KV()
	for _, k := range keys {
		kv.Unpin(k)
	}
	a.pinned.Add(-int64(len(keys)))
}

// pinReady pins the leading resident blocks of keys (those the prefill
// will use) and returns their count and a function that unpins them
// (once). held are pins taken over from the request's prefetch
// directives: they become the request's where keys use them and are
// released otherwise, so that what a directive loaded stays resident from
// its load to the prefill.
func (a *Agent) pinReady(keys, held []kvsp.BlockKey) (int, func()) {
	kv := a.cfg.Engine.KV()
	own := make(map[kvsp.BlockKey]int, len(held))
	for _, k := range held {
		own[k]++
	}
	var pinned []kvsp.BlockKey
	ready := 0
	for _, k := range keys {
		switch {
		case own[k] > 0:
			own[k]--
			pinned = append(pinned, k)
		case a.pinKey(k):
			pinned = append(pinned, k)
		case !kv.Has(k):
			return ready, a.unpinOnce(pinned, own)
		}
		ready++
	}
	return ready, a.unpinOnce(pinned, own)
}

// unpinOnce releases what pinReady did not use at once and returns the
// function that releases the rest (once).
func (a *Agent) unpinOnce(pinned []kvsp.BlockKey, unused map[kvsp.BlockKey]int) func() {
	for k, n := range unused {
		for ; n > 0; n-- {
			a.unpinKeys([]kvsp.BlockKey{k})
		}
	}
	return sync.OnceFunc(func() { a.unpinKeys(pinned) })
}

// awaitPrefetch waits until the prefetch directives sent for a request
// (request_ref: its session; of its scope) have finished, within their
// own deadlines, so the request's prefill finds what they loaded, and
// returns the pins they hold for it (the caller's to release). Another
// scope's directives are never waited for (S11: no timing tells a session
// id of another scope).
func (a *Agent) awaitPrefetch(ctx context.Context, scope kvsp.ScopeID, session kvsp.UUID) []kvsp.BlockKey {
	ref := session.String()
	a.mu.Lock()
	var waits []*directive
	for _, x := range a.directives {
		if x.d.RequestRef == ref && x.d.ScopeID == scope && x.done != nil {
			waits = append(waits, x)
		}
	}
	a.mu.Unlock()
	var pins []kvsp.BlockKey
	for _, x := range waits {
		select {
		case <-x.done:
		case <-ctx.Done():
		}
		pins = append(pins, x.takePins()...) // one still running (ctx ended) pins nothing more
	}
	return pins
}

// prefetchStatus reads a directive's state and scope: its status
// goes only to a caller authorized for that scope.
func (a *Agent) prefetchStatus(id kvsp.UUID) (kvsp.PrefetchStatus, kvsp.ScopeID, bool) {
	a.mu.Lock()
	x := a.directives[id]
	a.mu.Unlock()
	if x == nil {
		return kvsp.PrefetchStatus{}, kvsp.ScopeID{}, false
	}
	return x.status(), x.d.ScopeID, true
}

// run loads a directive's blocks, up to Workers at once, started in
// prefix order. Only the leading run of loaded blocks counts (keys chain):
// loaded lists it as it grows, and everything after the first block that
// could not be loaded (or the deadline) is failed. Blocks whose first
// source is the same holder are leased together, one request per holder
// (per-block leases when that fails).
func (a *Agent) run(ctx context.Context, x *directive) {
	d := &x.d
	// xctx bounds the transfers: the deadline, or for a prefetch the
	// lease's end (late), by which transfers under way at the deadline
	// have landed or stopped.
	xctx, xcancel := ctx, context.CancelFunc(func() {})
	late := x.late()
	if !late.IsZero() {
		xctx, xcancel = context.WithDeadline(context.WithoutCancel(ctx), late)
	}
	// The IS's layer digests and the holders' leases are asked for at
	// once: each is a round trip out of the directive's deadline, and
	// neither needs the other's answer.
	looked := make(chan layerSet, 1)
	go func() { looked <- a.layerDigests(ctx, d) }()
	covered, release := a.leaseGroups(ctx, d)
	digests := <-looked
	n := len(d.Blocks)
	ok := make([]bool, n)
	mine := make([]bool, n) // transferred by this directive, for no other
	var (
		mu    sync.Mutex
		next  int // first block not yet known loaded
		wg    sync.WaitGroup
		ended bool // the directive ended: transfers still under way are late
	)
	for i, b := range d.Blocks {
		taken := false
		select { // a transfer slot, taken in prefix order
		case a.work <- struct{}{}:
			taken = true
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			// Both were ready (the deadline passed with a slot free, and
			// select chose the slot): the slot goes back. Kept, it was
			// lost for good, and once every slot was, no directive loaded
			// anything again (issue 47: fetching stopped a minute into a
			// longer workload).
			if taken {
				<-a.work
			}
			break
		}
		mu.Lock()
		stop := next < i && !ok[next] && x.hasFailed()
		mu.Unlock()
		if stop {
			<-a.work
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			own, err := a.load(xctx, x, b, digests, covered[b.BlockKey])
			<-a.work
			mu.Lock()
			defer mu.Unlock()
			if ended {
				// Past the deadline: the directive is over (this block is
				// listed failed), but the block is resident, and a prefill
				// that has not reached it yet uses it.
				if err == nil && a.cfg.Engine.KV().Has(b.BlockKey) {
					a.m.blocks.WithLabelValues("late").Inc()
				}
				return
			}
			if err != nil {
				a.log.Info("prefetch block not loaded", "directive", d.Directive.String(), "block", i, "err", err)
				x.markFailed(err)
				return
			}
			ok[i], mine[i] = true, own
			if x.purpose == "prefetch" && d.RequestRef != "" {
				x.mu.Lock()
				if !x.taken && a.pinKey(b.BlockKey) {
					x.pins = append(x.pins, b.BlockKey)
				}
				x.mu.Unlock()
			}
			for next < n && ok[next] {
				x.mu.Lock()
				x.loaded = append(x.loaded, d.Blocks[next].BlockKey)
				x.mu.Unlock()
				next++
			}
		}()
	}
	// The directive ends when its transfers have, or at its deadline:
	// those still under way then go on (xctx) and give back their slots
	// and leases when they end.
	all := make(chan struct{})
	go func() {
		wg.Wait()
		xcancel()
		release()
		close(all)
	}()
	if late.IsZero() {
		<-all
	}
	select {
	case <-all:
	case <-ctx.Done():
	}
	mu.Lock()
	ended = true
	// What a transfer under way may still load lands after the run below
	// decided: it stays resident for the engine, listed failed here.
	loadedNow := slices.Clone(ok)
	mu.Unlock()
	x.mu.Lock()
	kv := a.cfg.Engine.KV()
	// Only the leading run of pinned blocks is sure to be used (keys
	// chain): pins past it, or past the loaded prefix, go now, to leave the
	// budget to other requests' prefixes.
	pinned := make(map[kvsp.BlockKey]int, len(x.pins)) // counted: a key listed twice is pinned twice
	for _, k := range x.pins {
		pinned[k]++
	}
	var kept []kvsp.BlockKey
	for _, k := range x.loaded {
		if pinned[k] == 0 {
			break
		}
		kept = append(kept, k)
		pinned[k]--
	}
	for k, n := range pinned {
		for ; n > 0; n-- {
			a.unpinKeys([]kvsp.BlockKey{k})
		}
	}
	x.pins = kept
	if len(kept) > 0 { // the request that does not come does not hold them long
		x.hold = time.AfterFunc(kvsp.Millis(d.LeaseMs), func() { a.unpinKeys(x.takePins()) })
	}
	for i, b := range d.Blocks[len(x.loaded):] {
		x.failed = append(x.failed, b.BlockKey)
		// Loaded past a block that was not, it cannot be used (keys
		// chain): it goes, unless a request holds it.
		if j := len(x.loaded) + i; loadedNow[j] && mine[j] && kv.Pin(b.BlockKey) && !kv.Unpin(b.BlockKey) {
			kv.Drop(b.BlockKey)
		}
	}
	x.pending, x.doneAt = false, time.Now()
	// A holder that was some failed block's first source and sent
	// nothing by the end (its deadline) took at least this long: the
	// links learn it, or a deadline too short for it would never grow.
	var unheard []string
	if !x.received.IsZero() && ctx.Err() != nil {
		for _, b := range d.Blocks[len(x.loaded):] {
			if len(b.Sources) > 0 && !x.heard[b.Sources[0]] && !slices.Contains(unheard, b.Sources[0]) {
				unheard = append(unheard, b.Sources[0])
			}
		}
	}
	x.mu.Unlock()
	for _, h := range unheard {
		a.links.roundTrip(h, x.doneAt.Sub(x.received))
	}
	if x.done != nil {
		close(x.done)
	}
	if x.purpose == "prefetch" {
		st := x.status()
		a.m.directives.WithLabelValues(string(st.State)).Inc()
		if len(st.Failed) > 0 {
			x.mu.Lock()
			first := x.firstErr
			x.mu.Unlock()
			a.m.directiveFailures.WithLabelValues(failureReason(first, ctx)).Inc()
		}
		if a.log.Enabled(ctx, slog.LevelDebug) { // its arguments are not built for nothing
			a.log.Debug("directive ended", "directive", d.Directive.String(), "scope", d.ScopeID, "state", st.State, "loaded", len(st.Loaded), "failed", len(st.Failed))
		}
	}
	a.settle()
}

func (d *directive) markFailed(err error) {
	d.mu.Lock()
	d.anyFailed = true
	if d.firstErr == nil {
		d.firstErr = err
	}
	d.mu.Unlock()
}

func (d *directive) hasFailed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.anyFailed
}

// leaseGroups leases, at each holder that is some blocks' first source,
// all those blocks in one request. It returns the keys so covered and a
// function that releases the leases (A-18: they only cover the transfer).
func (a *Agent) leaseGroups(ctx context.Context, d *kvsp.PrefetchDirective) (map[kvsp.BlockKey]bool, func()) {
	groups := map[string][]kvsp.BlockKey{}
	var order []string
	kv := a.cfg.Engine.KV()
	for _, b := range d.Blocks {
		if len(b.Sources) == 0 || kv.Has(b.BlockKey) {
			continue
		}
		s := b.Sources[0]
		if groups[s] == nil {
			order = append(order, s)
		}
		groups[s] = append(groups[s], b.BlockKey)
	}
	covered := map[kvsp.BlockKey]bool{}
	type held struct{ src, id string }
	var leases []held
	for _, s := range order {
		ls, err := a.cfg.Client.Holder(s).Lease(ctx, &kvsp.LeaseRequest{ScopeID: d.ScopeID, CompatID: d.CompatID, BlockKeys: groups[s], TTLMs: d.LeaseMs})
		if err != nil {
			continue // per-block leases then
		}
		leases = append(leases, held{s, ls.Lease})
		for _, k := range groups[s] {
			covered[k] = true
		}
	}
	return covered, func() {
		rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		for _, l := range leases {
			a.cfg.Client.Holder(l.src).ReleaseLease(rctx, l.id)
		}
	}
}

// failureReason names why a directive did not load all its blocks, from
// the first block's failure (err; nil when no block failed and the
// directive stopped at its deadline before reaching the rest).
func failureReason(err error, ctx context.Context) string {
	var p *kvsp.Problem
	switch {
	case err == nil && ctx.Err() != nil, errors.Is(err, context.DeadlineExceeded):
		return "deadline"
	case err == nil:
		return "not_started"
	case errors.Is(err, context.Canceled):
		return "cancelled"
	case errors.Is(err, container.ErrDigestMismatch) || errors.Is(err, kvsp.ErrDigestMismatch):
		return "digest"
	case errors.Is(err, kvsp.ErrLeaseQuota):
		return "lease_quota"
	case errors.Is(err, errLease) && errors.Is(err, kvsp.ErrNotFound):
		return "lease_not_found" // the holder no longer has the block
	case errors.Is(err, errLease):
		return "lease_failed"
	case errors.Is(err, kvsp.ErrNotFound):
		return "not_found" // the GET: evicted at the holder since the lookup
	case errors.Is(err, kvsp.ErrLayersUnavailable):
		return "layers_unavailable"
	case errors.Is(err, kvsp.ErrTooManyRequests):
		return "too_many_requests"
	case errors.Is(err, kvsp.ErrUnavailable):
		return "holder_unavailable"
	case errors.As(err, &p):
		return "refused"
	case errors.Is(err, errEngine):
		return "engine"
	}
	return "transport" // no answer: a connection refused, reset or cut
}

// Package instance is kvsp's inference instance (II) agent: it runs beside
// an engine (package engine), reports the instance's status to the PC
// every ttl/3 (spec "Instance Status and Lifecycle"; R-ST-*), follows the
// lifecycle the PC sets (PUT state, A-19), and executes prefetch
// directives ("Prefetch Directives"; R-PF-*, A-17, A-18): for each block
// it does not hold, a lease at one of the sources, a GET verified layer by
// layer, each layer placed into the engine's KV memory as it arrives, the
// block stored at the instance's holder (which publishes it), the lease
// released. Directives run on their own bounded workers and never block
// the requests the engine is running.
package instance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine"
)

// Config configures an agent.
type Config struct {
	// Base is the instance's base URI (its status records' "instance").
	Base   string
	Engine engine.Engine
	// Client calls the PC, the IS and holders with the instance's
	// identity.
	Client *client.Client
	// RDMA, when set, fetches blocks by one-sided RDMA READ (holders that
	// serve rdma/reads), falling back to GET for the others.
	RDMA client.RDMAReader
	// Controller and Index are the PC and IS base URIs; Holder, when set,
	// is the holder that stores the blocks this instance loads.
	Controller, Index, Holder string
	// Controllers are the other PCs of the Controller's high-availability
	// group, to fail over to.
	Controllers []string
	// Links are the instance's links to holders, reported in its status.
	Links []kvsp.Link
	// Scopes are the scope keys of the requests it runs (Block Keys).
	Scopes []kvsp.ScopeKey
	// StatusTTL is the ttl_ms of its status records; default 3s.
	StatusTTL time.Duration
	// Workers bounds the blocks being transferred at once (the transfer
	// budget shared by all directives); default 16 (kvsp demo --speed 24, prefix hit ratio of one run each: 0.145 with 4, 0.193 with 16, 0.216 with 32; at 8x 0.95 of the bound with 16, 0.93 with 32).
	Workers int
	// MaxPending bounds the directives pending at once (R-PF-13, 429);
	// default 64 (kvsp demo --speed 24, prefix hit ratio over three runs
	// each: 0.244-0.255 with 16, 0.263-0.275 with 64; the transfers stay
	// bounded by Workers).
	MaxPending int
	// OffloadBuffer bounds the octets of computed blocks copied out of
	// the engine and waiting for their PUT to the instance's holder (a
	// block offered beyond it is skipped, and counted); default 16 MiB
	// (defaultOffloadBuffer says why), and at least 16 blocks.
	OffloadBuffer int64
	// EpochFile, when set, keeps the instance's epoch above the previous
	// start's even if the clock went back (R-ST-5's persisted counter).
	EpochFile string
	// Now is the wall clock that gives the epoch; default time.Now.
	Now        func() time.Time
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Agent is an instance agent.
type Agent struct {
	cfg    Config
	compat kvsp.CompatID
	g      container.Geometry
	keys   map[kvsp.ScopeID]kvsp.ScopeKey
	epoch  uint64
	log    *slog.Logger
	m      *metrics
	work   chan struct{} // transfer slots
	off    *offloader
	pinned atomic.Int64  // blocks pinned by pinReady
	kick   chan struct{} // a status record is due before the next tick (kickStatus)
	ctl    *client.Controller

	mu         sync.Mutex
	state      kvsp.InstanceState
	directives map[kvsp.UUID]*directive
	resumes    map[sessionKey]*resumed
	shards     map[shardKey]*shard
	flights    map[kvsp.BlockKey]*flight // blocks being transferred now (load)
	running    int                       // generations in progress
	occ        occupancy                 // of the engine's batch by running, over time
	closed     bool                      // Close was called: it serves nothing more
	stop       context.CancelFunc
	stopCtx    context.Context
}

// New returns an agent.
func New(cfg Config) (*Agent, error) {
	if cfg.Engine == nil || cfg.Client == nil {
		return nil, errors.New("instance: engine and client required")
	}
	if err := kvsp.ValidateBaseURI("instance: base", cfg.Base); err != nil {
		return nil, err
	}
	d := cfg.Engine.Descriptor()
	compat, err := d.CompatID()
	if err != nil {
		return nil, err
	}
	if cfg.StatusTTL == 0 {
		cfg.StatusTTL = 3 * time.Second
	}
	if cfg.Workers == 0 {
		cfg.Workers = 16
	}
	if cfg.MaxPending == 0 {
		cfg.MaxPending = 64
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	epoch, err := startEpoch(cfg.EpochFile, cfg.Now())
	if err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, compat: compat, g: cfg.Engine.Geometry(), keys: map[kvsp.ScopeID]kvsp.ScopeKey{}, kick: make(chan struct{}, 1),
		epoch: epoch, log: cfg.Logger, m: newMetrics(cfg.Registerer),
		work: make(chan struct{}, cfg.Workers), state: kvsp.StateActive, directives: map[kvsp.UUID]*directive{}, resumes: map[sessionKey]*resumed{}, shards: map[shardKey]*shard{},
		flights: map[kvsp.BlockKey]*flight{}}
	a.stopCtx, a.stop = context.WithCancel(context.Background())
	a.occ.batch = int(max(1, cfg.Engine.Stats().BatchSize))
	if reg := cfg.Registerer; reg != nil {
		eng := cfg.Engine
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_instance_engine_prefilled_tokens_total",
			Help: "Prompt tokens the engine computed, by its own count."}, func() float64 { return float64(eng.Stats().Prefilled) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_instance_engine_prefill_seconds_total",
				Help: "Time the engine's prefill steps took (prefilled tokens over this: the prefill rate it reached)."}, func() float64 { return eng.Stats().PrefillTime.Seconds() }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_instance_batch_slots",
				Help: "Requests the engine runs at once (its batch)."}, func() float64 { return float64(a.occ.batch) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_instance_busy_slot_seconds_total",
				Help: "Batch slots held by accepted requests, integrated over time (over the batch and the time: how busy the engine's batch was)."},
				func() float64 { b, _ := a.occupancy(); return b.Seconds() }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_instance_waiting_request_seconds_total",
				Help: "Accepted requests beyond the batch (waiting for a slot), integrated over time."},
				func() float64 { _, w := a.occupancy(); return w.Seconds() }))
	}
	if a.off, err = newOffloader(a.g, cfg.OffloadBuffer); err != nil {
		return nil, err
	}
	a.ctl = cfg.Client.Controller(cfg.Controller, cfg.Controllers...)
	for _, k := range cfg.Scopes {
		a.keys[k.ID()] = k
	}
	return a, nil
}

// occupancy integrates how many of the engine's batch slots accepted
// requests hold, and how many wait beyond them, over time: the figures
// that say whether the engine's batch is what saturated.
type occupancy struct {
	batch        int
	at           time.Time
	busy, queued time.Duration
}

// change accounts for the time since the last change at running n, as
// of now (under a.mu).
func (o *occupancy) change(n int, now time.Time) {
	if !o.at.IsZero() {
		d := now.Sub(o.at)
		o.busy += time.Duration(min(n, o.batch)) * d
		o.queued += time.Duration(max(0, n-o.batch)) * d
	}
	o.at = now
}

// occupancy returns the slot-time held by accepted requests and the
// request-time waiting beyond the batch, up to now; the first over the
// batch and a wall time is the batch's utilisation.
func (a *Agent) occupancy() (busy, queued time.Duration) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.occ.change(a.running, a.cfg.Now())
	return a.occ.busy, a.occ.queued
}

// CompatID is the Compatibility ID of the engine's model.
func (a *Agent) CompatID() kvsp.CompatID { return a.compat }

// State returns the instance's lifecycle state.
func (a *Agent) State() kvsp.InstanceState {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.state
}

// Status is the instance's status record now.
//
// Queued counts every request the agent has accepted that the engine is
// not running yet: those waiting for their prefetch as well as those in
// the engine's queue (the PC sizes an instance's queue by it).
func (a *Agent) Status() *kvsp.InstanceStatus {
	st := a.cfg.Engine.Stats()
	a.mu.Lock()
	state, accepted := a.state, uint64(a.running)
	a.mu.Unlock()
	queued := st.Queued
	if accepted > st.Running+queued {
		queued = accepted - st.Running
	}
	return &kvsp.InstanceStatus{Instance: a.cfg.Base, Epoch: a.epoch, State: state, Running: st.Running, Queued: queued,
		BatchSize: st.BatchSize, KVUtilization: min(1, st.KVUtilization), PrefillTokensPerS: st.PrefillTokensPerS, DecodeTokensPerS: st.DecodeTokensPerS,
		Links: append([]kvsp.Link{}, a.cfg.Links...), TTLMs: uint64(a.cfg.StatusTTL.Milliseconds()), CompatID: a.compat, Holder: a.cfg.Holder}
}

// Close stops the agent as a crash would, for tests and shutdown: running
// generations are cut (their streams end without a done line), no status
// is sent any more, and new requests are refused with 503.
func (a *Agent) Close() {
	a.mu.Lock()
	a.closed = true
	a.mu.Unlock()
	a.stop()
}

// statusGap is the least time between two status records: a request
// ending sends one early (kickStatus), at most this often.
const statusGap = 20 * time.Millisecond

// kickStatus has Run send a status record now (within statusGap of the
// last), rather than at the next tick: a request ended, so the PC, which
// places no more than an instance's batch can take, may place another.
func (a *Agent) kickStatus() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// Run sends status records to the PC every ttl/3 (R-ST-1), and soon after
// a request ends, until ctx ends, applying the state the PC answers
// (R-ST-10), and moves a draining instance with nothing left to do to
// sleeping (R-ST-15).
func (a *Agent) Run(ctx context.Context) {
	t := time.NewTicker(a.cfg.StatusTTL / 3)
	defer t.Stop()
	var last time.Time
	for {
		if wait := time.Until(last.Add(statusGap)); wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
		}
		last = time.Now()
		a.settle()
		if a.stopCtx.Err() != nil {
			return
		}
		if a.cfg.Controller != "" {
			pctx, cancel := context.WithTimeout(ctx, a.cfg.StatusTTL/3)
			got, err := a.ctl.PutStatus(pctx, a.Status())
			cancel()
			switch {
			case err != nil:
				a.log.Warn("status not accepted by the PC", "err", err)
			case got.State == kvsp.StateDraining:
				a.setState(kvsp.StateDraining)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-a.stopCtx.Done():
			return
		case <-t.C:
		case <-a.kick:
		}
	}
}

// settle moves draining to sleeping once no generation or directive is
// in progress.
func (a *Agent) settle() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.state != kvsp.StateDraining || a.running > 0 {
		return
	}
	for _, d := range a.directives {
		if d.status().State == kvsp.PrefetchPending {
			return
		}
	}
	a.state = kvsp.StateSleeping
}

// setState applies a state change: sleeping cannot go to draining;
// failed is never set from outside.
func (a *Agent) setState(s kvsp.InstanceState) error {
	a.mu.Lock()
	switch {
	case s == kvsp.StateFailed || !s.Valid():
		a.mu.Unlock()
		return fmt.Errorf("%w: state %q cannot be set", kvsp.ErrInvalid, s)
	case a.state == kvsp.StateSleeping && s == kvsp.StateDraining:
		a.mu.Unlock()
		return fmt.Errorf("%w: a sleeping instance cannot drain", kvsp.ErrInvalidState)
	}
	a.state = s
	a.mu.Unlock()
	a.settle()
	return nil
}

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
		} else if x.finishedBefore(received.Add(-time.Duration(x.d.LeaseMs) * time.Millisecond)) {
			delete(a.directives, id) // kept lease_ms after completion
		}
	}
	if pending >= a.cfg.MaxPending {
		return ErrPendingQuota
	}
	x := &directive{d: *d, body: bytes.Clone(body), pending: true, purpose: "prefetch", done: make(chan struct{})}
	a.directives[d.Directive] = x
	// deadline_ms counts from receipt.
	ctx, cancel := context.WithDeadline(context.Background(), received.Add(time.Duration(d.DeadlineMs)*time.Millisecond))
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
	digests := a.layerDigests(ctx, d)
	covered, release := a.leaseGroups(ctx, d)
	defer release()
	n := len(d.Blocks)
	ok := make([]bool, n)
	mine := make([]bool, n) // transferred by this directive, for no other
	var (
		mu   sync.Mutex
		next int // first block not yet known loaded
		wg   sync.WaitGroup
	)
	for i, b := range d.Blocks {
		select { // a transfer slot, taken in prefix order
		case a.work <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
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
			own, err := a.load(ctx, x, b, digests, covered[b.BlockKey])
			<-a.work
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				a.log.Info("prefetch block not loaded", "directive", d.Directive.String(), "block", i, "err", err)
				x.markFailed()
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
	wg.Wait()
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
		x.hold = time.AfterFunc(time.Duration(d.LeaseMs)*time.Millisecond, func() { a.unpinKeys(x.takePins()) })
	}
	for i, b := range d.Blocks[len(x.loaded):] {
		x.failed = append(x.failed, b.BlockKey)
		// Loaded past a block that was not, it cannot be used (keys
		// chain): it goes, unless a request holds it.
		if mine[len(x.loaded)+i] && kv.Pin(b.BlockKey) && !kv.Unpin(b.BlockKey) {
			kv.Drop(b.BlockKey)
		}
	}
	x.pending, x.doneAt = false, time.Now()
	x.mu.Unlock()
	if x.done != nil {
		close(x.done)
	}
	if x.purpose == "prefetch" {
		st := x.status()
		a.m.directives.WithLabelValues(string(st.State)).Inc()
		if a.log.Enabled(ctx, slog.LevelDebug) { // its arguments are not built for nothing
			a.log.Debug("directive ended", "directive", d.Directive.String(), "scope", d.ScopeID, "state", st.State, "loaded", len(st.Loaded), "failed", len(st.Failed))
		}
	}
	a.settle()
}

func (d *directive) markFailed() {
	d.mu.Lock()
	d.anyFailed = true
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

// layerSet is what the IS's records say of a directive's blocks' layer
// digests: each (holder, key)'s own, and for each key the one list every
// record of it agrees on (with the IS's producer_digests, the producer's).
type layerSet struct {
	of     map[string][]container.Digest // holder|key
	agreed map[kvsp.BlockKey][]container.Digest
	differ map[kvsp.BlockKey]bool // records disagree: no agreed list
}

// forSource gives the layer digests to check src's replica of key with:
// its own record's, or, for a source the IS has no record of (a
// directive may name any holder), the digests the key's records agree
// on, so that an unrecorded holder's self-consistent bytes are held to
// what the recorded replicas are (RELIABILITY S8). Nil: none known, the
// block is verified whole (Repr-Digest) before any layer is placed.
func (s layerSet) forSource(src string, key kvsp.BlockKey) []container.Digest {
	if ds, ok := s.of[src+"|"+key.String()]; ok {
		return ds
	}
	return s.agreed[key]
}

// layerDigests looks the directive's keys up at the IS for the layer
// digests of each (holder, key), so layers are verified as they arrive;
// without them (IS unreachable), blocks are verified whole (Repr-Digest)
// before any layer is placed.
func (a *Agent) layerDigests(ctx context.Context, d *kvsp.PrefetchDirective) layerSet {
	out := layerSet{of: map[string][]container.Digest{}, agreed: map[kvsp.BlockKey][]container.Digest{}, differ: map[kvsp.BlockKey]bool{}}
	if a.cfg.Index == "" {
		return out
	}
	keys := make([]kvsp.BlockKey, len(d.Blocks))
	for i, b := range d.Blocks {
		keys[i] = b.BlockKey
	}
	resp, err := a.cfg.Client.Index(a.cfg.Index).Lookup(ctx, &kvsp.LookupRequest{ScopeID: d.ScopeID, CompatID: d.CompatID, BlockKeys: keys})
	if err != nil {
		a.log.Warn("lookup for layer digests failed; verifying whole blocks", "err", err)
		return out
	}
	for _, reps := range resp.Replicas {
		for _, r := range reps {
			ds := make([]container.Digest, len(r.LayerDigests))
			for i, l := range r.LayerDigests {
				ds[i] = container.Digest(l)
			}
			out.of[r.Holder+"|"+r.BlockKey.String()] = ds
			k := r.BlockKey
			switch prev, seen := out.agreed[k]; {
			case len(ds) == 0 || out.differ[k]:
			case !seen:
				out.agreed[k] = ds
			case !slices.Equal(prev, ds):
				delete(out.agreed, k)
				out.differ[k] = true
			}
		}
	}
	return out
}

// flight is one block's transfer in progress, which other directives
// wanting the block wait for instead of fetching it again.
type flight struct {
	done    chan struct{} // closed when the transfer ended
	waiters int           // directives that waited for it (under Agent.mu)
}

// load makes one block resident: already there, by the transfer of it
// in progress for another directive (waited for: however many
// directives want a block at once, it is fetched once), or from the first
// source that serves it verified. own reports that this call transferred
// the block and no other directive waited for it.
func (a *Agent) load(ctx context.Context, x *directive, b kvsp.PrefetchBlock, digests layerSet, leased bool) (own bool, err error) {
	kv := a.cfg.Engine.KV()
	for !kv.Has(b.BlockKey) {
		a.mu.Lock()
		f := a.flights[b.BlockKey]
		if f == nil {
			f = &flight{done: make(chan struct{})}
			a.flights[b.BlockKey] = f
			a.mu.Unlock()
			err := a.transfer(ctx, x, b, digests, leased)
			a.mu.Lock()
			delete(a.flights, b.BlockKey)
			shared := f.waiters > 0
			a.mu.Unlock()
			close(f.done)
			return err == nil && !shared, err
		}
		f.waiters++
		a.mu.Unlock()
		select {
		case <-f.done: // resident now, or this call tries itself
		case <-ctx.Done():
			a.m.blocks.WithLabelValues("failed").Inc()
			return false, ctx.Err()
		}
		if kv.Has(b.BlockKey) {
			a.m.blocks.WithLabelValues("shared").Inc()
		}
	}
	return false, nil
}

// transfer fetches one block from the first of its sources that serves
// it verified.
func (a *Agent) transfer(ctx context.Context, x *directive, b kvsp.PrefetchBlock, digests layerSet, leased bool) error {
	kv := a.cfg.Engine.KV()
	var errs []error
	for i, src := range b.Sources {
		err := a.fetch(ctx, x, b.BlockKey, src, digests.forSource(src, b.BlockKey), leased && i == 0)
		if err == nil {
			a.m.blocks.WithLabelValues("loaded").Inc()
			return nil
		}
		kv.Drop(b.BlockKey) // nothing unverified stays
		if errors.Is(err, container.ErrDigestMismatch) || errors.Is(err, kvsp.ErrDigestMismatch) {
			a.m.digestFailures.Inc()
			a.log.Error("a replica failed verification; trying the next source", "holder", src)
		}
		errs = append(errs, fmt.Errorf("%s: %w", src, err))
		if ctx.Err() != nil {
			break
		}
	}
	a.m.blocks.WithLabelValues("failed").Inc()
	return errors.Join(errs...)
}

// fetch loads one block from one source under a lease (its own, unless
// the block is covered by its group's).
func (a *Agent) fetch(ctx context.Context, x *directive, key kvsp.BlockKey, src string, layerDigests []container.Digest, leased bool) error {
	d := &x.d
	h := a.cfg.Client.Holder(src)
	if !leased {
		ls, err := h.Lease(ctx, &kvsp.LeaseRequest{ScopeID: d.ScopeID, CompatID: d.CompatID, BlockKeys: []kvsp.BlockKey{key}, TTLMs: d.LeaseMs})
		if err != nil {
			return fmt.Errorf("lease: %w", err)
		}
		defer func() { // the lease only covers the transfer
			rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			h.ReleaseLease(rctx, ls.Lease)
		}()
	}
	ref := client.BlockRef{Compat: d.CompatID, Scope: d.ScopeID, Key: key}
	if a.cfg.RDMA != nil {
		err := a.fetchRDMA(ctx, x, src, h, ref, layerDigests)
		// A holder without rdma/reads answers 404 like a missing block:
		// either way, GET (which says which).
		if err == nil || ctx.Err() != nil || errors.Is(err, kvsp.ErrDigestMismatch) {
			return err
		}
		a.log.Debug("RDMA read failed; fetching by GET", "holder", src, "err", err)
	}
	s, err := h.GetBlock(ctx, ref, a.g, client.GetOptions{LayerDigests: layerDigests, ReplicaCodec: container.CodecRaw})
	if err != nil {
		return err
	}
	defer s.Close()
	kv := a.cfg.Engine.KV()
	var held []container.Layer // without layer digests: placed once the whole block verified
	for {
		l, err := s.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		n := uint64(len(l.K) + len(l.V))
		x.moved.Add(n)
		a.m.fetched.WithLabelValues(x.purpose).Add(float64(n))
		if layerDigests != nil {
			if err := kv.WriteLayer(key, l.Index, l.K, l.V); err != nil {
				return err
			}
			continue
		}
		held = append(held, container.Layer{Index: l.Index, K: bytes.Clone(l.K), V: bytes.Clone(l.V)})
	}
	for _, l := range held {
		if err := kv.WriteLayer(key, l.Index, l.K, l.V); err != nil {
			return err
		}
	}
	return a.loaded(src, client.BlockRef{Compat: d.CompatID, Scope: d.ScopeID, Key: key})
}

// loaded finishes a block fetched from src: every layer must be resident,
// and a copy goes to the instance's own holder when that is closer than
// src (copyCloser), for the next request here.
func (a *Agent) loaded(src string, ref client.BlockRef) error {
	if !a.cfg.Engine.KV().Has(ref.Key) {
		return fmt.Errorf("%w: the block's layers are not all resident", kvsp.ErrLayersUnavailable)
	}
	if src == a.cfg.Holder || a.cfg.Holder == "" {
		return nil
	}
	if !a.copyCloser(src) {
		a.m.offloads.WithLabelValues("not_closer").Inc()
		return nil
	}
	a.offload(ref.Scope, ref.Compat, ref.Key, copyPosition)
	return nil
}

// copyCloser reports whether a block loaded from src is worth a copy at
// the instance's own holder: that holder's link (as configured) moves a
// block faster than src's, or the links are not both known. A copy over
// a link no faster is a PUT (a body sent, hashed twice, stored, published)
// for no quicker load: in kvsp demo --speed 24, whose instances reach
// both holders over one loopback, those copies took the CPU that the
// first copies of computed blocks needed.
func (a *Agent) copyCloser(src string) bool {
	var own, from *kvsp.Link
	for i := range a.cfg.Links {
		switch l := &a.cfg.Links[i]; l.Holder {
		case a.cfg.Holder:
			own = l
		case src:
			from = l
		}
	}
	if own == nil || from == nil || own.MbitPerS == 0 || from.MbitPerS == 0 {
		return true
	}
	bits := float64(8 * a.off.blockOctets)
	us := func(l *kvsp.Link) float64 { return float64(l.RTTUs) + bits/float64(l.MbitPerS) }
	return us(own) < us(from)
}

// fetchRDMA loads one block by RDMA READ, verified whole before any of
// it reaches the engine.
func (a *Agent) fetchRDMA(ctx context.Context, x *directive, src string, h *client.Holder, ref client.BlockRef, layerDigests []container.Digest) error {
	blk, release, err := h.ReadBlockRDMA(ctx, ref, a.g, client.GetOptions{LayerDigests: layerDigests, ReplicaCodec: container.CodecRaw}, a.cfg.RDMA)
	if err != nil {
		return err
	}
	defer release() // the layers are copied into the engine's pages below
	kv := a.cfg.Engine.KV()
	for l := blk.Header().FirstLayer; l <= blk.Header().LastLayer(); l++ {
		k, v, _ := blk.Layer(l)
		if err := kv.WriteLayer(ref.Key, l, k, v); err != nil {
			return err
		}
		n := uint64(len(k) + len(v))
		x.moved.Add(n)
		a.m.fetched.WithLabelValues(x.purpose).Add(float64(n))
	}
	a.m.rdmaBlocks.Inc()
	return a.loaded(src, ref)
}

type metrics struct {
	checkpoints    *prometheus.CounterVec
	directives     *prometheus.CounterVec
	blocks         *prometheus.CounterVec
	digestFailures prometheus.Counter
	fetched        *prometheus.CounterVec
	rdmaBlocks     prometheus.Counter
	prompt         *prometheus.CounterVec
	offloads       *prometheus.CounterVec
	offloadDelay   prometheus.Histogram
	lost           prometheus.Counter
	reshards       *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		checkpoints: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_checkpoints_total",
			Help: "Session checkpoints sent, by outcome (acknowledged, failed, superseded)."}, []string{"outcome"}),
		directives: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_directives_total",
			Help: "Prefetch directives finished, by final state."}, []string{"state"}),
		blocks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_prefetch_blocks_total",
			Help: "Blocks a prefetch loaded (fetched), shared (loaded meanwhile by another directive's transfer, waited for) or failed to load."}, []string{"outcome"}),
		digestFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_instance_digest_failures_total",
			Help: "Replicas that failed verification during a prefetch."}),
		fetched: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_fetched_bytes_total",
			Help: "Octets of KV received from holders, by purpose (prefetch, resume, reshard)."}, []string{"purpose"}),
		rdmaBlocks: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_instance_rdma_blocks_total",
			Help: "Blocks loaded by one-sided RDMA READ (the rest came by GET)."}),
		prompt: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_prompt_tokens_total",
			Help: "Prompt tokens of generate requests, by source: cached (KV resident, local or fetched) or computed (prefill)."}, []string{"source"}),
		offloads: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_offloads_total",
			Help: "Blocks of the engine's KV offered to the instance's holder, by outcome: stored, exists (the holder had it), duplicate (offered already, not sent again), skipped (the offload buffer was full), evicted (gone from the engine before it was copied), failed; not_closer: loaded from a holder whose link is no slower than the own holder's, not copied."}, []string{"outcome"}),
		offloadDelay: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvsp_instance_offload_delay_seconds",
			Help:    "From a block's offer to its holder's answer (stored or exists): how late the cache learns of what this instance computed.",
			Buckets: []float64{.001, .005, .02, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_instance_prompt_blocks_lost_total",
			Help: "Prompt blocks resident (local or loaded) when a request's wait for its directives ended, evicted before its prefill began (recomputed)."}),
		reshards: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_reshard_messages_total",
			Help: "Reshard messages handled, by outcome (acknowledged, failed, committed, aborted)."}, []string{"outcome"}),
	}
	if reg != nil {
		reg.MustRegister(m.checkpoints, m.directives, m.blocks, m.digestFailures, m.fetched, m.rdmaBlocks, m.prompt, m.offloads, m.offloadDelay, m.lost, m.reshards)
	}
	return m
}

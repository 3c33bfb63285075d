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
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	// Fetcher brings blocks from holders; default GetFetcher{Client}.
	// cmd chooses it: GET, GET over quicbulk, or RDMAFetcher.
	Fetcher Fetcher
	// Controller and Index are the PC and IS base URIs; Holder, when set,
	// is the holder that stores the blocks this instance loads.
	Controller, Index, Holder string
	// Controllers are the other PCs of the Controller's high-availability
	// group, to fail over to.
	Controllers []string
	// Links are the instance's links to holders as configured: its status
	// reports them until its own transfers measure them (links.go).
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
	// ProducerDigests states, at the IS, the digest of each block the
	// engine computed before the block goes to the instance's holder
	// (PUT producers/{key}): an IS with producer_digests accepts its
	// holders' records of the block only with that digest (R-SEC-8,
	// RELIABILITY S13). Set it where the IS runs with producer_digests.
	ProducerDigests bool
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
	cfg     Config
	compat  kvsp.CompatID
	g       container.Geometry
	limits  engine.Limits // what the engine can run, reported in its status
	keys    map[kvsp.ScopeID]kvsp.ScopeKey
	epoch   uint64
	log     *slog.Logger
	m       *metrics
	work    chan struct{} // transfer slots
	off     *offloader
	pinned  atomic.Int64  // blocks pinned by pinReady
	kick    chan struct{} // a status record is due before the next tick (kickStatus)
	ctl     *client.Controller
	fetcher Fetcher
	grants  grants
	links   *links // to holders, as measured (the status record)

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
		flights: map[kvsp.BlockKey]*flight{}, links: newLinks(cfg.Links, time.Now)}
	a.stopCtx, a.stop = context.WithCancel(context.Background())
	if b, ok := cfg.Engine.(engine.Bounded); ok {
		a.limits = b.Limits()
	}
	a.occ.batch = int(max(1, cfg.Engine.Stats().BatchSize))
	if reg := cfg.Registerer; reg != nil {
		eng := cfg.Engine
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_instance_engine_prefilled_tokens_total",
			Help: "Prompt tokens the engine computed, by its own count."}, func() float64 { return float64(eng.Stats().Prefilled) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_instance_engine_prefill_seconds_total",
				Help: "Time the engine's prefill steps took (prefilled tokens over this: the prefill rate it reached)."}, func() float64 { return eng.Stats().PrefillTime.Seconds() }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_instance_batch_slots",
				Help: "Requests the engine runs at once (its batch)."}, func() float64 { return float64(a.occ.batch) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_instance_engine_requests",
				Help: "Requests the engine runs or queues now, by its own count (a cancelled one leaves at once)."},
				func() float64 { st := eng.Stats(); return float64(st.Running + st.Queued) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_instance_engine_kv_utilization",
				Help: "The engine's KV memory in use, 0 to 1, as its status record reports it."}, func() float64 { return min(1, eng.Stats().KVUtilization) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_instance_transfer_slots_busy",
				Help: "Block transfers under way, of the agent's Workers (its transfer slots)."}, func() float64 { return float64(len(a.work)) }),
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
	if a.fetcher = cfg.Fetcher; a.fetcher == nil {
		a.fetcher = GetFetcher{Client: cfg.Client}
	}
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
		Links: a.links.report(), TTLMs: uint64(a.cfg.StatusTTL.Milliseconds()), CompatID: a.compat, Holder: a.cfg.Holder,
		VocabSize: a.limits.VocabSize, ContextTokens: a.limits.ContextTokens, MaxOutputTokens: a.limits.MaxOutputTokens,
		Started: a.startedGrants()}
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
			st := a.Status()
			got, err := a.ctl.PutStatus(pctx, st)
			cancel()
			switch {
			case err != nil:
				a.log.Warn("status not accepted by the PC", "err", err)
			case got.State == kvsp.StateDraining:
				a.setState(kvsp.StateDraining)
			}
			if err == nil {
				a.ackStarted(st.Started)
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

type metrics struct {
	checkpoints *prometheus.CounterVec
	directives  *prometheus.CounterVec
	// directiveFailures counts the directives that did not load all
	// their blocks, by the reason of the first block that failed.
	directiveFailures *prometheus.CounterVec
	blocks            *prometheus.CounterVec
	digestFailures    prometheus.Counter
	fetched           *prometheus.CounterVec
	rdmaBlocks        prometheus.Counter
	prompt            *prometheus.CounterVec
	offloads          *prometheus.CounterVec
	offloadDelay      prometheus.Histogram
	lost              prometheus.Counter
	reshards          *prometheus.CounterVec
	grants            *prometheus.CounterVec
	notReading        prometheus.Counter
	finished          *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		checkpoints: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_checkpoints_total",
			Help: "Session checkpoints sent, by outcome (acknowledged, failed, superseded)."}, []string{"outcome"}),
		directives: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_directives_total",
			Help: "Prefetch directives finished, by final state."}, []string{"state"}),
		directiveFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_directive_failures_total",
			Help: "Prefetch directives that did not load all their blocks (state failed or partial), by the reason of the first block that failed: deadline, digest, lease_quota, lease_not_found, lease_failed, not_found (GET 404), layers_unavailable, too_many_requests, holder_unavailable, refused (another problem), engine, transport (no answer), cancelled, not_started."}, []string{"reason"}),
		blocks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_prefetch_blocks_total",
			Help: "Blocks a prefetch loaded (fetched), shared (loaded meanwhile by another directive's transfer, waited for) or failed to load; late: loaded by a transfer under way at the directive's deadline, after it (listed failed; used if the prefill has not reached it yet)."}, []string{"outcome"}),
		digestFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_instance_digest_failures_total",
			Help: "Replicas that failed verification during a prefetch."}),
		fetched: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_fetched_bytes_total",
			Help: "Octets of KV received from holders, by purpose (prefetch, resume, reshard)."}, []string{"purpose"}),
		rdmaBlocks: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_instance_rdma_blocks_total",
			Help: "Blocks loaded by one-sided RDMA READ (the rest came by GET)."}),
		prompt: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_prompt_tokens_total",
			Help: "Prompt tokens of generate requests, by source: cached (KV resident, local or fetched) or computed (prefill)."}, []string{"source"}),
		offloads: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_offloads_total",
			Help: "Blocks of the engine's KV offered to the instance's holder, by outcome: stored, exists (the holder had it), duplicate (offered already, not sent again), skipped (the offload buffer was full), evicted (gone from the engine before it was copied), failed; other_producer (with producer digests: another producer stated another digest for it, not sent); not_closer: loaded from a holder whose link is no slower than the own holder's, not copied."}, []string{"outcome"}),
		offloadDelay: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvsp_instance_offload_delay_seconds",
			Help:    "From a block's offer to its holder's answer (stored or exists): how late the cache learns of what this instance computed.",
			Buckets: []float64{.001, .005, .02, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_instance_prompt_blocks_lost_total",
			Help: "Prompt blocks resident (local or loaded) when a request's wait for its directives ended, evicted before its prefill began (recomputed)."}),
		grants: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_grants_total",
			Help: "Generate requests by their placement grant: taken (the PC placed it here; it runs), refused (403: none, not the PC's, for another instance, session, prompt or epoch, expired or taken before), before any engine work."}, []string{"outcome"}),
		finished: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_generations_finished_total",
			Help: "Generations ended, by why (A-39): stop (the model's end-of-generation token), length (max_tokens), cancelled (the front end went away)."}, []string{"finish"}),
		notReading: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_instance_generations_unread_total",
			Help: "Generations cut because their token stream failed: the front end stopped reading (its write deadline passed, or its unread tokens passed the bound) or went away; their sequences and pins freed."}),
		reshards: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_instance_reshard_messages_total",
			Help: "Reshard messages handled, by outcome (acknowledged, failed, committed, aborted)."}, []string{"outcome"}),
	}
	for _, r := range []string{"deadline", "digest", "lease_quota", "lease_not_found", "lease_failed", "not_found", "layers_unavailable",
		"too_many_requests", "holder_unavailable", "refused", "engine", "transport", "cancelled", "not_started"} {
		m.directiveFailures.WithLabelValues(r) // every reason's series exists from the start, at 0
	}
	if reg != nil {
		reg.MustRegister(m.checkpoints, m.directives, m.directiveFailures, m.blocks, m.digestFailures, m.fetched, m.rdmaBlocks, m.prompt, m.offloads, m.offloadDelay, m.lost, m.reshards, m.grants, m.notReading, m.finished)
	}
	return m
}

package placement

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/server"
)

// Index is the Index Service as the PC uses it: client.Index, or an
// in-process adapter.
type Index interface {
	Lookup(ctx context.Context, q *kvsp.LookupRequest) (*kvsp.LookupResponse, error)
}

// Instances sends directives and state changes to instances.
type Instances interface {
	Prefetch(ctx context.Context, base string, d *kvsp.PrefetchDirective) error
	SetState(ctx context.Context, base string, s kvsp.InstanceState) error
	Resume(ctx context.Context, base string, r *kvsp.ResumeRequest) error
	Reshard(ctx context.Context, base string, r *kvsp.Reshard) (*kvsp.ReshardAck, error)
}

// ClientInstances is Instances over a kvsp client (mutual TLS with the
// PC's identity).
type ClientInstances struct{ C *client.Client }

// Prefetch implements Instances.
func (c ClientInstances) Prefetch(ctx context.Context, base string, d *kvsp.PrefetchDirective) error {
	_, err := c.C.Instance(base).Prefetch(ctx, d)
	return err
}

// SetState implements Instances.
func (c ClientInstances) SetState(ctx context.Context, base string, s kvsp.InstanceState) error {
	_, err := c.C.Instance(base).SetState(ctx, s)
	return err
}

// Resume implements Instances.
func (c ClientInstances) Resume(ctx context.Context, base string, r *kvsp.ResumeRequest) error {
	return c.C.Instance(base).Resume(ctx, r)
}

// Reshard implements Instances.
func (c ClientInstances) Reshard(ctx context.Context, base string, r *kvsp.Reshard) (*kvsp.ReshardAck, error) {
	return c.C.Instance(base).Reshard(ctx, r)
}

// Config configures a Controller.
type Config struct {
	// Scopes are the scope keys the PC computes Block Keys with.
	Scopes []kvsp.ScopeKey
	// BlockTokens gives each compat_id's tokens per block (from its
	// descriptor).
	BlockTokens map[kvsp.CompatID]int
	Index       Index
	Instances   Instances
	// MaxPending bounds the directives pending at one instance (R-PF-13);
	// default 64, the instance agent's own default. A directive counts
	// until its deadline (the PC is not told when it ends), so this is
	// above what an instance has pending at once: at 16, kvsp demo
	// --speed 24 left 578 directives unsent, at 64 132-167.
	MaxPending int
	// LeaseMs is the lease_ms of directives; default 2000.
	LeaseMs uint64
	// CapacityWait is how long a request waits at the PC for an instance
	// with room (the next status record that shows one) before it is
	// refused with 503 and Retry-After; default 1s, negative: not at all.
	// Waiting here, the request is decoded and its prompt hashed once:
	// refused at once, a front end resends the whole prompt until it is
	// placed (in kvsp demo --speed 24, twice as many refused places as
	// requests, each a prompt of 15,000 tokens on the wire).
	CapacityWait time.Duration
	// MaxDeadline caps a directive's deadline_ms (the longer of twice the
	// estimated fetch and the recomputation of the matched prefix, at
	// least MinDeadline); default 2s.
	MaxDeadline time.Duration
	// PlacementTTL is how long a placement's grant is taken by its
	// instance, and how long a placement whose generate the instance has
	// not reported started holds its room (RELIABILITY L5: placements
	// never generated are released after it); default 10s.
	PlacementTTL time.Duration
	// MaxShare is the share of an instance's room (its batch running and
	// a batch queued) that one principal, and one scope, may hold in
	// placements not started yet, and of its pending directives: past
	// it, a place is refused with 429 and Retry-After once CapacityWait
	// has passed (the room of another principal's flood of unused
	// placements is never all of it, RELIABILITY L5), and a directive is
	// not sent (the request recomputes). Default 0.5; 1 turns it off.
	MaxShare float64
	// MinDeadline is the least deadline_ms a directive is given; default
	// 10 ms. The estimates come from the links' declared rates and round
	// trips: where the instances' real round trips to holders are longer
	// or vary (a loaded node, TLS on a busy CPU), a directive of a few
	// blocks would be recomputed for want of a few milliseconds.
	MinDeadline time.Duration
	// State, when set, keeps instance epochs and sessions across restarts
	// (OpenBoltStore); nil keeps them in memory only.
	State Store
	// Self is the PC's base URI: a standby redirects to the leader's.
	Self string
	// Standby starts the controller as a standby of a high-availability
	// group: it serves nothing (503, or 307 to the leader) until RunHA
	// wins the election and loads the group's state.
	Standby bool
	// RestartGrace is how long after a start with saved state the PC waits
	// for instances to report before it migrates their sessions; default
	// 10s.
	RestartGrace time.Duration
	// SessionRetention is how long a finished session (its last checkpoint
	// covers max_tokens) is kept; default a minute. SessionIdle drops a
	// session with no placement or checkpoint for that long (its front end
	// and instance are gone); default 15 minutes. Without them the PC's
	// sessions, and its state, would grow with every request (found by L2).
	SessionRetention, SessionIdle time.Duration
	// OnStatus, when set, receives every accepted status record: a
	// co-located IS's status table, so lookups with targets get
	// estimates.
	OnStatus   func(kvsp.InstanceStatus)
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Controller is a Placement Controller.
type Controller struct {
	started atomic.Int64 // unix ns of the start, or of the last takeover
	// beat is when the migration sweep last ran (unix ns; 0 while Run is
	// not running) and awake when the PC last came back from a stall: see
	// stalled.
	beat       atomic.Int64
	awake      atomic.Int64
	unresolved atomic.Bool  // stored maps whose open plans a crash may have left: resolveMaps
	stallAfter atomic.Int64 // a sweep later than this (ns) is a stall
	planTerm   atomic.Int64 // orders this PC's reshard plans after its predecessors'
	standby    atomic.Bool  // a standby of an HA group: serves nothing
	// policy is the policy of the server the PC is mounted on: an
	// instance is a candidate for a scope's requests only if the identity
	// that reports it may use that scope (nil: not mounted, no check).
	policy   atomic.Pointer[server.PolicyStore]
	leader   atomic.Pointer[string]
	cfg      Config
	keys     map[kvsp.ScopeID]kvsp.ScopeKey
	reg      *Registry
	log      *slog.Logger
	m        *metrics
	mu       sync.Mutex
	sessions map[SessionKey]*Session
	maps     map[mapKey]*shardEntry // sequence-sharded contexts by scope and map identifier
}

// SessionKey names a session: its id within its scope. Sessions of two
// scopes never meet, even under one id (a front end may choose the id of
// a new session): whatever names another scope's session finds nothing,
// exactly as for an id nobody uses (RELIABILITY S11).
type SessionKey struct {
	Scope kvsp.ScopeID
	ID    kvsp.UUID
}

// Session is a session the PC placed.
type Session struct {
	ID       kvsp.UUID
	Epoch    uint64
	ScopeID  kvsp.ScopeID
	CompatID kvsp.CompatID
	// Prompt is the prompt's kvsp.PromptDigest: a place or a checkpoint
	// naming the session must carry this prompt (zero: not known, for
	// state stored before it was kept).
	Prompt   [32]byte
	Instance string
	// InstanceEpoch is the instance's epoch when the session was placed
	// there: a higher one means it restarted and lost the session.
	InstanceEpoch uint64
	Created       time.Time
	MaxTokens     uint64
	// Checkpoint is the one with the highest output_offset of the
	// current epoch (nil until the first).
	Checkpoint *kvsp.Checkpoint
	// Active is when it was last placed, migrated or checkpointed (not
	// stored: a restarted PC counts from its start).
	Active time.Time
	// resumePending: the instance of the current epoch (above 1) may not
	// have been sent its resume yet (refused, or the PC restarted between
	// persisting the epoch and sending it): the next place sends it
	// before answering, since an instance serves an epoch above 1 only
	// once resumed at it.
	resumePending bool
}

// Finished reports a session whose instance said its output ended
// stop, length or cancelled, sent once the front end had the whole
// output, or had gone): it is never resumed or migrated, and a front end
// that places it again is told so.
func (s *Session) Finished() bool {
	return s.Checkpoint != nil && s.Checkpoint.Finish != ""
}

// complete reports a session with nothing left to generate: finished, or
// checkpointed up to max_tokens. The sweep does not migrate it (a front
// end that lacks the last tokens places it again, and is resumed from the
// checkpoint), and it is forgotten after the retention.
func (s *Session) complete() bool {
	return s.Finished() || (s.Checkpoint != nil && s.Checkpoint.OutputOffset >= s.MaxTokens)
}

// New returns a Controller.
func New(cfg Config) (*Controller, error) {
	if cfg.Index == nil || cfg.Instances == nil {
		return nil, errors.New("placement: index and instances required")
	}
	if cfg.MinDeadline < 0 || cfg.MaxDeadline < 0 || cfg.PlacementTTL < 0 {
		return nil, errors.New("placement: MinDeadline, MaxDeadline and PlacementTTL must not be negative")
	}
	if cfg.MaxShare < 0 || cfg.MaxShare > 1 {
		return nil, errors.New("placement: MaxShare must be in (0, 1]")
	}
	if cfg.MaxShare == 0 {
		cfg.MaxShare = 0.5
	}
	if cfg.PlacementTTL == 0 {
		cfg.PlacementTTL = 10 * time.Second
	}
	if cfg.MaxPending == 0 {
		cfg.MaxPending = 64 // the instance agent's default
	}
	if cfg.LeaseMs == 0 {
		cfg.LeaseMs = 2000
	}
	if cfg.MaxDeadline == 0 {
		cfg.MaxDeadline = 2 * time.Second
	}
	if cfg.MinDeadline == 0 {
		cfg.MinDeadline = 10 * time.Millisecond
	}
	if cfg.CapacityWait == 0 {
		cfg.CapacityWait = time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.RestartGrace == 0 {
		cfg.RestartGrace = 10 * time.Second
	}
	if cfg.SessionRetention == 0 {
		cfg.SessionRetention = time.Minute
	}
	if cfg.SessionIdle == 0 {
		cfg.SessionIdle = 15 * time.Minute
	}
	c := &Controller{cfg: cfg, keys: map[kvsp.ScopeID]kvsp.ScopeKey{}, reg: &Registry{m: map[string]*instance{}, onStatus: cfg.OnStatus}, log: cfg.Logger,
		m: newMetrics(cfg.Registerer), sessions: map[SessionKey]*Session{}, maps: map[mapKey]*shardEntry{}}
	for _, k := range cfg.Scopes {
		c.keys[k.ID()] = k
	}
	c.started.Store(time.Now().UnixNano())
	c.planTerm.Store(time.Now().UnixMilli()) // a restarted PC's plans come after its former self's
	if cfg.State != nil {
		c.reg.persist = cfg.State.PutInstanceEpoch
	}
	if cfg.Standby {
		c.standby.Store(true)
		return c, nil
	}
	c.m.leader.Set(1)
	if cfg.State != nil {
		st, err := cfg.State.Load()
		if err != nil {
			return nil, err
		}
		c.load(st)
	}
	return c, nil
}

// load replaces what the PC knows by stored state (at start, or when it
// takes over as leader): instances are known by their highest epoch only,
// failed until they report again, with RestartGrace to do so.
func (c *Controller) load(st *State) {
	c.reg.mu.Lock()
	c.reg.m = map[string]*instance{}
	for uri, e := range st.Epochs {
		c.reg.m[uri] = &instance{maxEpoch: e}
	}
	c.reg.mu.Unlock()
	c.mu.Lock()
	c.sessions = map[SessionKey]*Session{}
	now := time.Now()
	for _, s := range st.Sessions {
		s.Active = now
		s.resumePending = s.Epoch > 1 // whether the resume went out before the stop is not known
		c.sessions[s.key()] = s
	}
	c.maps = map[mapKey]*shardEntry{}
	for _, m := range st.Maps {
		e := &shardEntry{}
		e.ctx.Store(m)
		c.maps[mapKey{m.ScopeID, m.Map.Map}] = e
	}
	c.mu.Unlock()
	c.started.Store(time.Now().UnixNano())
	c.unresolved.Store(len(st.Maps) > 0)
	c.log.Info("controller state loaded", "instances", len(st.Epochs), "sessions", len(st.Sessions), "maps", len(st.Maps))
}

// persist writes a session (with c.mu held) before the PC answers.
func (c *Controller) persist(s *Session) error {
	if c.cfg.State == nil {
		return nil
	}
	if err := c.cfg.State.PutSession(s); err != nil {
		if errors.Is(err, ErrNotLeader) { // deposed: the group's clients try the new leader
			return ErrNotLeader
		}
		c.log.Error("controller state not written", "err", err)
		return fmt.Errorf("%w: the controller's state could not be written", kvsp.ErrUnavailable)
	}
	return nil
}

// Registry returns the instance registry.
func (c *Controller) Registry() *Registry { return c.reg }

func (s *Session) key() SessionKey { return SessionKey{s.ScopeID, s.ID} }

// Session returns a placed session of a scope.
func (c *Controller) Session(scope kvsp.ScopeID, id kvsp.UUID) (Session, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.sessions[SessionKey{scope, id}]
	if s == nil {
		return Session{}, false
	}
	return *s, true
}

// ErrNoCapacity: no active instance has capacity and none could be woken
// (503 with Retry-After).
var ErrNoCapacity = fmt.Errorf("%w: no instance of this model has capacity", kvsp.ErrUnavailable)

// maxRaces bounds the times a request chooses again after errRoomTaken
// before it waits for a status record.
const maxRaces = 4

// ErrShare refuses a place whose principal, or scope, holds its share of
// the room of every instance that has room, in placements not started
// yet (429 with Retry-After, RELIABILITY L5).
var ErrShare = fmt.Errorf("%w: this principal or scope holds its share of the instances' room in placements not yet generated; retry once they start or expire", kvsp.ErrTooManyRequests)

// errShare is ErrShare while the request may wait for room.
var errShare = fmt.Errorf("%w: share", ErrNoCapacity)

// errRoomTaken: the room of the instance chosen went to requests placed
// meanwhile; the request chooses again.
var errRoomTaken = fmt.Errorf("%w: the instance chosen filled meanwhile", ErrNoCapacity)

// candidate is an instance considered for a request.
type candidate struct {
	snap Snapshot
	cost Cost
}

// SessionSummary is a session as an operator sees it: no tokens, no
// scope.
type SessionSummary struct {
	ID           kvsp.UUID
	Epoch        uint64
	Instance     string
	Created      time.Time
	MaxTokens    uint64
	OutputOffset uint64 // of its last checkpoint
}

// Sessions lists the sessions the PC keeps, newest first.
func (c *Controller) Sessions() []SessionSummary {
	c.mu.Lock()
	out := make([]SessionSummary, 0, len(c.sessions))
	for _, s := range c.sessions {
		x := SessionSummary{ID: s.ID, Epoch: s.Epoch, Instance: s.Instance, Created: s.Created, MaxTokens: s.MaxTokens}
		if s.Checkpoint != nil {
			x.OutputOffset = s.Checkpoint.OutputOffset
		}
		out = append(out, x)
	}
	c.mu.Unlock()
	slices.SortFunc(out, func(a, b SessionSummary) int { return b.Created.Compare(a.Created) })
	return out
}

// Place chooses the instance for a request and sends it the directive
// for the cached prefix it lacks (spec "Placement Inputs", "Prefetch
// Directives"). A request naming a session of its scope continues it; a
// session id its scope does not have (unknown, or another scope's) names
// a new session of the caller's scope.
func (c *Controller) Place(ctx context.Context, q *kvsp.PlaceRequest) (*kvsp.PlaceResponse, error) {
	if _, ok := c.keys[q.ScopeID]; !ok {
		return nil, fmt.Errorf("%w: the PC holds no key for this scope", kvsp.ErrScopeDenied)
	}
	if q.Session != nil {
		c.mu.Lock()
		s := c.sessions[SessionKey{q.ScopeID, *q.Session}]
		c.mu.Unlock()
		if s != nil {
			out, err := c.continueSession(ctx, s, q)
			if err != nil {
				return nil, err
			}
			return c.withGrant(out, q)
		}
	}
	var timeout <-chan time.Time
	who := requesterOf(ctx, q.ScopeID)
	for races := 0; ; {
		changed := c.reg.changed()
		out, err := c.placeOn(ctx, q, nil, who)
		if err == errRoomTaken && races < maxRaces { // another instance may have room yet
			races++
			continue
		}
		share := err == errShare
		if errors.Is(err, ErrNoCapacity) {
			err = ErrNoCapacity
		}
		if err != ErrNoCapacity || c.cfg.CapacityWait < 0 {
			return out, err
		}
		if timeout == nil {
			t := time.NewTimer(c.cfg.CapacityWait)
			defer t.Stop()
			timeout = t.C
		}
		select { // until a status record may show room
		case <-changed:
			c.m.placements.WithLabelValues("waited").Inc()
		case <-timeout:
			return nil, c.refuse(share, who)
		case <-ctx.Done():
			return nil, c.refuse(share, who)
		}
	}
}

// refuse counts a place refused for want of room: 503, or 429 when what
// the principal or its scope already holds was in the way.
func (c *Controller) refuse(share bool, who Requester) error {
	if !share {
		c.m.placements.WithLabelValues("no_capacity").Inc()
		return ErrNoCapacity
	}
	c.m.placements.WithLabelValues("share").Inc()
	c.m.shareRefused.WithLabelValues(who.Principal).Inc()
	return ErrShare
}

// requesterOf is who a request is placed for: the principal of the request
// ctx carries (the HTTP route's) and the scope.
func requesterOf(ctx context.Context, scope kvsp.ScopeID) Requester {
	who := Requester{Scope: scope}
	if p := server.PrincipalFrom(ctx); p != nil {
		who.Principal = p.ID
	}
	return who
}

// withGrant seals the grant of a continued session's answer: for the
// session at the instance and epoch where it continues (its room was
// taken when it was first placed).
func (c *Controller) withGrant(out *kvsp.PlaceResponse, q *kvsp.PlaceRequest) (*kvsp.PlaceResponse, error) {
	c.mu.Lock()
	s := c.sessions[SessionKey{q.ScopeID, out.Session}]
	var prompt [32]byte
	var instEpoch uint64
	if s != nil {
		prompt = s.Prompt
		if s.Instance == out.Instance {
			instEpoch = s.InstanceEpoch
		}
	}
	c.mu.Unlock()
	if prompt == [32]byte{} { // stored before prompts were kept: the place's, which continueSession checked against nothing
		_, _, d, err := c.prompt(q.ScopeID, q.CompatID, q.Tokens)
		if err != nil {
			return nil, err
		}
		prompt = d
	}
	if instEpoch == 0 {
		if st, ok := c.reg.Get(out.Instance); ok {
			instEpoch = st.Status.Epoch
		}
	}
	g := kvsp.Grant{ID: kvsp.NewGrantID(), Session: out.Session, Epoch: out.Epoch, ScopeID: q.ScopeID, CompatID: q.CompatID, Prompt: prompt,
		MaxTokens: q.MaxTokens, Instance: out.Instance, InstanceEpoch: instEpoch, Expires: time.Now().Add(c.cfg.PlacementTTL)}
	var err error
	if out.Grant, err = g.Seal(c.keys[q.ScopeID]); err != nil {
		return nil, err
	}
	return out, nil
}

// prompt returns a request's Block Keys and tail, and their digest.
func (c *Controller) prompt(scope kvsp.ScopeID, compat kvsp.CompatID, tokens []uint32) ([]kvsp.BlockKey, []uint32, [32]byte, error) {
	bt := c.cfg.BlockTokens[compat]
	if bt == 0 {
		return nil, nil, [32]byte{}, fmt.Errorf("%w: no instance serves this compat_id", kvsp.ErrIncompatible)
	}
	keys, err := kvsp.BlockKeys(c.keys[scope], compat, bt, tokens)
	if err != nil {
		return nil, nil, [32]byte{}, err
	}
	tail := tokens[len(keys)*bt:]
	return keys, tail, kvsp.PromptDigest(keys, tail), nil
}

// continueSession answers a place for a known session: where it continues
// now (its instance and epoch), after migrating it if its instance failed
// (R-SES-10). The front end that lost its token stream asks this. The
// answer is one state of the session, taken at one instant: the
// migration's own result, not a later read that another migration may
// have moved on since (RELIABILITY F14: a place is one operation on the
// session's epoch).
func (c *Controller) continueSession(ctx context.Context, s *Session, q *kvsp.PlaceRequest) (*kvsp.PlaceResponse, error) {
	if s.CompatID != q.CompatID {
		return nil, fmt.Errorf("%w: the session runs another model", kvsp.ErrIncompatible)
	}
	c.mu.Lock()
	finished, epoch := s.Finished(), s.Epoch
	var why kvsp.FinishReason
	if finished {
		why = s.Checkpoint.Finish
	}
	if why == kvsp.FinishCancelled {
		// The instance took a cut stream for its front end leaving, but
		// the front end is here, asking where the session continues (a
		// network fault, not a departure): it continues. The PC itself
		// never resumes a cancelled session (the sweep skips it).
		cp := *s.Checkpoint
		cp.Finish = ""
		s.Checkpoint = &cp
		finished = false
		c.m.checkpoints.WithLabelValues("uncancelled").Inc()
	}
	c.mu.Unlock()
	if finished { // nothing continues a finished session
		return nil, kvsp.NewProblem(kvsp.ErrInvalidState, "the session finished ("+string(why)+")").With("finish", string(why)).With("epoch", epoch)
	}
	if _, _, digest, err := c.prompt(q.ScopeID, q.CompatID, q.Tokens); err != nil {
		return nil, err
	} else if s.Prompt != [32]byte{} && digest != s.Prompt {
		return nil, fmt.Errorf("%w: the tokens are not the session's prompt", kvsp.ErrConflict)
	}
	if from, epoch, lost, _ := c.lost(s); lost {
		return c.migrate(ctx, s.key(), q, from, epoch)
	}
	return c.current(ctx, s, q)
}

// current answers where a session is now, once its instance has accepted
// the resume of its current epoch: a place never names an epoch above 1
// that its instance may not serve yet. Two migrations of one session can
// run at once (the sweep's and a front end's place): the one that finds
// the session moved meanwhile answers only after the resume went out, and
// sends it again if it has not been accepted yet (the instance takes the
// same resume twice as once). Answering at once let a front end ask the
// new instance before the resume reached it, be told 404 (not resumed
// here at this epoch), and then be told the same instance and epoch by
// every later place: the session stopped (RELIABILITY F14, found by
// TestChaosSessionsSurviveRandomKills).
func (c *Controller) current(ctx context.Context, s *Session, q *kvsp.PlaceRequest) (*kvsp.PlaceResponse, error) {
	c.mu.Lock()
	out := &kvsp.PlaceResponse{Session: s.ID, Epoch: s.Epoch, Instance: s.Instance}
	pending, cp, fromEpoch := s.resumePending, s.Checkpoint, s.InstanceEpoch
	c.mu.Unlock()
	if !pending {
		return out, nil
	}
	if cp == nil {
		var err error
		if cp, err = c.startCheckpoint(s, q); err != nil {
			return nil, err
		}
	}
	if err := c.cfg.Instances.Resume(ctx, out.Instance, &kvsp.ResumeRequest{Epoch: out.Epoch, Checkpoint: *cp}); err != nil {
		c.log.Warn("resume not accepted; the session moves", "instance", out.Instance, "err", err)
		return c.migrate(ctx, s.key(), q, out.Instance, fromEpoch)
	}
	c.mu.Lock()
	if s.Epoch == out.Epoch {
		s.resumePending = false
	}
	c.mu.Unlock()
	return out, nil
}

// inGrace reports an instance known only from saved state, shortly after
// a restart: it has not had the time to report yet, and is presumed to
// still serve its sessions.
func (c *Controller) inGrace(uri string) bool {
	st, ok := c.reg.Get(uri)
	return ok && st.Status.Instance == "" && time.Since(time.Unix(0, c.started.Load())) < c.cfg.RestartGrace
}

// lost reports a session whose instance failed (its status expired) or
// restarted (a higher epoch: the incarnation that ran the session is
// gone, R-ST-5) since the session was placed there, with the instance
// and epoch it was placed on. An instance known only from saved state is
// given RestartGrace to report.
func (c *Controller) lost(s *Session) (from string, epoch uint64, lost, failed bool) {
	c.mu.Lock()
	from, epoch, scope := s.Instance, s.InstanceEpoch, s.ScopeID
	c.mu.Unlock()

	if c.inGrace(from) {
		return from, epoch, false, false
	}
	st, ok := c.reg.Get(from)
	failed = !ok || st.State == kvsp.StateFailed
	if failed && ok && c.stalled(time.Now(), kvsp.Millis(st.Status.TTLMs)) {
		return from, epoch, false, false // no fresh evidence yet: the PC's silence, not the instance's
	}
	restarted := ok && epoch != 0 && st.Status.Instance != "" && st.Status.Epoch != epoch
	// S12: an instance whose identity the policy no longer authorizes for
	// the session's scope is not sent its resumes or directives: the
	// session moves, as off a failed instance.
	unauthorized := ok && st.Status.Instance != "" && !c.authorized(st, scope)
	return from, epoch, failed || restarted || unauthorized, failed || unauthorized
}

// migrate moves a session whose instance failed (spec "Session Checkpoints
// and Migration", R-SES-10): the epoch goes up first (so the failed
// instance's messages are refused from now on, R-SES-15), the cheapest
// active instance is chosen, and it is sent POST resume with the latest
// checkpoint and the new epoch. A session without a checkpoint
// starts over there (the front end keeps what it delivered: nothing was
// released for a non-deterministic sampler, and a deterministic one
// regenerates the same tokens).
//
// It returns where the session is: where it was moved to, or, if another
// migration moved it first, where that one put it.
func (c *Controller) migrate(ctx context.Context, id SessionKey, q *kvsp.PlaceRequest, from string, fromEpoch uint64) (*kvsp.PlaceResponse, error) {
	c.mu.Lock()
	s := c.sessions[id]
	if s == nil { // forgotten meanwhile
		c.mu.Unlock()
		return nil, fmt.Errorf("%w: session", kvsp.ErrNotFound)
	}
	if s.Instance != from || s.InstanceEpoch != fromEpoch {
		out := &kvsp.PlaceResponse{Session: s.ID, Epoch: s.Epoch, Instance: s.Instance}
		c.mu.Unlock()
		return c.moved(ctx, s, q, out) // the sweep and a front end both noticed
	}
	cp := s.Checkpoint
	c.mu.Unlock()
	var pq kvsp.PlaceRequest
	switch {
	case q != nil:
		pq = *q
		if cp == nil {
			// No output checkpointed yet: the session starts over at the
			// new instance from its prompt, resumed like any other (an
			// instance serves an epoch above 1 only when resumed at it).
			var err error
			if cp, err = c.startCheckpoint(s, q); err != nil {
				return nil, err
			}
		}
	case cp != nil: // the background sweep: the request is the checkpoint's
		pq = kvsp.PlaceRequest{ScopeID: s.ScopeID, CompatID: s.CompatID, Tokens: make([]uint32, 0), MaxTokens: max(1, s.MaxTokens)}
	default:
		return nil, fmt.Errorf("%w: session %s has no checkpoint to resume from", kvsp.ErrUnavailable, id.ID)
	}
	mig := &migration{session: s, from: from, fromEpoch: fromEpoch, cp: cp}
	if _, _, _, failed := c.lost(s); failed {
		mig.exclude = from // a restarted instance may take its session back
	}
	out, err := c.placeOn(ctx, &pq, mig, Requester{})
	if err != nil {
		return nil, err
	}
	if mig.movedMeanwhile {
		return c.moved(ctx, s, q, out)
	}
	c.m.migrations.Inc()
	c.log.Info("session migrated", "session", id.ID.String(), "from", from, "to", out.Instance, "epoch", out.Epoch)
	return &kvsp.PlaceResponse{Session: out.Session, Epoch: out.Epoch, Instance: out.Instance}, nil
}

// migration is what place does differently for a migrating session.
type migration struct {
	session   *Session
	from      string // the instance (and its epoch) the session was lost on
	fromEpoch uint64
	exclude   string // not a candidate (failed)
	cp        *kvsp.Checkpoint
	// movedMeanwhile: another migration moved the session while this one
	// chose an instance; placeOn's answer is where that one put it.
	movedMeanwhile bool
}

// moved answers a migration that found its session moved by another: a
// front end's place (q) gets the session's current instance and epoch
// once that epoch's resume is accepted (current); the sweep, which has no
// front end waiting, the session as it is.
func (c *Controller) moved(ctx context.Context, s *Session, q *kvsp.PlaceRequest, out *kvsp.PlaceResponse) (*kvsp.PlaceResponse, error) {
	if q == nil {
		return out, nil
	}
	return c.current(ctx, s, q)
}

// stalled reports whether the PC cannot tell yet an instance whose
// status (of time to live ttl) expired from its own stall (RELIABILITY F8:
// a PC that was stopped, swapped out or starved sees every status expire
// at once when it resumes, though the instances reported all along and
// their records are on the way). It is while the sweep is overdue (the PC
// is stalled now, or resuming), and for one ttl after it resumed: every
// instance gets a full period to report before it is judged failed.
func (c *Controller) stalled(now time.Time, ttl time.Duration) bool {
	beat := c.beat.Load()
	if beat == 0 {
		return false // no sweep runs: nothing measures the PC's own pauses
	}
	return now.Sub(time.Unix(0, beat)) > time.Duration(c.stallAfter.Load()) || now.Sub(time.Unix(0, c.awake.Load())) < ttl
}

// Run migrates the sessions of failed instances as their failure is
// detected (status TTL), until ctx ends. A sweep that comes late (the PC
// was stalled: more than four periods, and at least half a second) gives
// the instances a status TTL to report before any of them is judged
// failed.
func (c *Controller) Run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	c.stallAfter.Store(int64(max(4*every, 500*time.Millisecond)))
	c.beat.Store(time.Now().UnixNano())
	defer c.beat.Store(0)
	var bg sync.WaitGroup
	defer bg.Wait()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		failpoint.Eval("pc/sweep") // F8: a stall of the controller
		now := time.Now()
		if gap := now.Sub(time.Unix(0, c.beat.Swap(now.UnixNano()))); gap > time.Duration(c.stallAfter.Load()) {
			c.awake.Store(now.UnixNano())
			c.m.stalls.Inc()
			c.log.Warn("controller stalled: every instance gets its status TTL to report before it is judged failed", "stalled", gap.Round(time.Millisecond))
		}
		if c.standby.Load() {
			continue
		}
		if c.unresolved.CompareAndSwap(true, false) {
			bg.Go(func() { c.resolveMaps(ctx) }) // its messages take seconds: not in the way of migrations
		}
		c.forget(now)
		c.mu.Lock()
		var todo []*Session
		for _, s := range c.sessions {
			if s.Checkpoint == nil || s.complete() {
				continue // nothing to resume from, or nothing left to generate
			}
			todo = append(todo, s)
		}
		c.mu.Unlock()
		for _, s := range todo {
			from, epoch, lost, _ := c.lost(s)
			if !lost {
				continue
			}
			if _, err := c.migrate(ctx, s.key(), nil, from, epoch); err != nil {
				c.log.Warn("session not migrated", "session", s.ID.String(), "err", err)
			}
		}
	}
}

// forget drops the sessions finished for SessionRetention and those idle
// for SessionIdle, from memory and from the stored state.
func (c *Controller) forget(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, s := range c.sessions {
		finished := s.complete()
		if idle := now.Sub(s.Active); !(finished && idle >= c.cfg.SessionRetention) && idle < c.cfg.SessionIdle {
			continue
		}
		if c.cfg.State != nil {
			if err := c.cfg.State.DeleteSession(id.Scope, id.ID); err != nil {
				c.log.Warn("session not forgotten: the controller's state could not be written", "session", id.ID.String(), "err", err)
				continue // kept, tried again at the next sweep
			}
		}
		delete(c.sessions, id)
		c.m.forgotten.WithLabelValues(map[bool]string{true: "finished", false: "idle"}[finished]).Inc()
	}
}

func (c *Controller) placeOn(ctx context.Context, q *kvsp.PlaceRequest, mig *migration, who Requester) (*kvsp.PlaceResponse, error) {
	key, ok := c.keys[q.ScopeID]
	if !ok {
		return nil, fmt.Errorf("%w: the PC holds no key for this scope", kvsp.ErrScopeDenied)
	}
	bt := c.cfg.BlockTokens[q.CompatID]
	var active, sleeping []candidate
	lim := limitCheck{q: q}
	var refused error // what the limits of the instances passed over refuse
	fits, atShareOnly := false, false
	for _, s := range c.reg.AllFor(&who) {
		if s.Status.CompatID != q.CompatID || (mig != nil && s.Status.Instance == mig.exclude) {
			continue
		}
		if !c.authorized(s, q.ScopeID) { // S12: never a scope's requests (or its directives) to an instance outside it
			c.m.unauthorized.Inc()
			continue
		}
		if mig == nil { // B14: only to an instance that can run it (a migration's checkpoint ran already)
			if err := lim.check(&s.Status); err != nil {
				refused = cmp.Or(refused, err)
				continue
			}
			fits = true
		}
		switch s.State {
		case kvsp.StateActive:
			// Capacity: the queue as last reported and what was placed
			// since, below a batch (R-PLC-7): a burst between two status
			// records does not pile onto one instance.
			if s.QueuedNow() >= max(1, s.Status.BatchSize) {
				break
			}
			// L5: never past the share of its room that the principal
			// or its scope may hold in placements not started.
			if mig == nil && atShare(s.held.placements, s.held.placementsScope, c.cfg.MaxShare, room(&s.Status)) {
				atShareOnly = true
				break
			}
			active = append(active, candidate{snap: s})
		case kvsp.StateSleeping:
			sleeping = append(sleeping, candidate{snap: s})
		}
	}
	if refused != nil && !fits { // no instance of the model can run it: 400, before any is chosen
		c.m.placements.WithLabelValues("beyond_limits").Inc()
		return nil, refused
	}
	if bt == 0 || (len(active) == 0 && len(sleeping) == 0 && !c.served(q.CompatID, q.ScopeID)) {
		c.m.placements.WithLabelValues("incompatible").Inc()
		return nil, fmt.Errorf("%w: no instance serves this compat_id", kvsp.ErrIncompatible)
	}
	if len(active) == 0 && len(sleeping) == 0 && mig == nil {
		// Nothing has room: known before any key is computed or looked up,
		// so the requests waiting for room (Place) cost the IS nothing
		// each time a status record wakes them.
		if atShareOnly {
			return nil, errShare
		}
		return nil, ErrNoCapacity
	}

	// The cached prefix: Block Keys computed here, looked up by key only.
	var replicas [][]kvsp.ReplicaRecord
	keys, err := kvsp.BlockKeys(key, q.CompatID, bt, q.Tokens)
	if err != nil {
		return nil, err
	}
	total := len(q.Tokens)
	if mig != nil && mig.cp != nil { // the checkpoint's prompt blocks, then its tail and output
		keys = mig.cp.PromptBlocks
		total = len(keys)*bt + len(mig.cp.PromptTail) + len(mig.cp.Generated)
	}
	if len(keys) > 0 {
		resp, err := c.cfg.Index.Lookup(ctx, &kvsp.LookupRequest{ScopeID: q.ScopeID, CompatID: q.CompatID, BlockKeys: keys})
		if err != nil {
			c.m.lookups.WithLabelValues("failed").Inc()
			c.log.Warn("lookup failed; placing without the cache", "err", err)
		} else {
			c.m.lookups.WithLabelValues("ok").Inc()
			replicas = resp.Replicas
		}
	}

	var chosen *candidate
	plan := index.NewPlan(replicas)
	pick := func(cands []candidate) *candidate {
		var best *candidate
		for i := range cands {
			cd := &cands[i]
			// The queue as it stands now, with the requests placed since
			// the instance's last status record (R-PLC-7).
			st := cd.snap.Status
			st.Queued = cd.snap.QueuedNow()
			cd.cost = costWith(&st, c.serviceUs(cd.snap, total, q.MaxTokens), plan, len(replicas), bt, total)
			// Ties go to the least loaded, then the smallest URI.
			if best == nil || cd.cost.Total < best.cost.Total ||
				(cd.cost.Total == best.cost.Total && (cd.snap.Load() < best.snap.Load() ||
					cd.snap.Load() == best.snap.Load() && cd.snap.Status.Instance < best.snap.Status.Instance)) {
				best = cd
			}
		}
		return best
	}
	if chosen = pick(active); chosen == nil {
		// Wake the cheapest sleeping instance; its prefetch goes at once,
		// so loading overlaps its start (R-PLC-10, R-PLC-11).
		for len(sleeping) > 0 && chosen == nil {
			cd := pick(sleeping)
			uri := cd.snap.Status.Instance
			if err := c.cfg.Instances.SetState(ctx, uri, kvsp.StateActive); err != nil {
				c.log.Warn("could not wake an instance", "instance", uri, "err", err)
				sleeping = slices.DeleteFunc(sleeping, func(x candidate) bool { return x.snap.Status.Instance == uri })
				continue
			}
			c.reg.setState(uri, kvsp.StateActive)
			c.m.wakeups.Inc()
			chosen = cd
		}
	}
	if chosen == nil {
		if mig != nil { // a new request counts its refusal once, when it stops waiting
			c.m.placements.WithLabelValues("no_capacity").Inc()
		}
		return nil, ErrNoCapacity
	}
	uri := chosen.snap.Status.Instance
	grant := kvsp.Grant{ID: kvsp.NewGrantID(), Instance: uri, InstanceEpoch: chosen.snap.Status.Epoch, ScopeID: q.ScopeID, CompatID: q.CompatID,
		MaxTokens: q.MaxTokens, Expires: time.Now().Add(c.cfg.PlacementTTL)}
	if mig == nil {
		if err := c.reg.admit(uri, c.estimateServiceUs(&chosen.snap.Status, len(q.Tokens), q.MaxTokens), grant.ID, who, c.cfg.MaxShare, grant.Expires); err != nil {
			return nil, err
		}
	}

	out := &kvsp.PlaceResponse{Epoch: 1, Instance: uri, Matched: len(replicas)}
	if mig != nil {
		// Two migrations of one session may both have chosen by now (the
		// test of current pauses them here).
		failpoint.Eval("pc/migration-chosen")
		// The epoch goes up, durably, before the resume is sent (R-SES-15).
		c.mu.Lock()
		s := mig.session
		if s.Instance != mig.from || s.InstanceEpoch != mig.fromEpoch { // moved meanwhile
			out.Session, out.Epoch, out.Instance = s.ID, s.Epoch, s.Instance
			mig.movedMeanwhile = true
			c.mu.Unlock()
			return out, nil
		}
		s.Epoch++
		s.Instance, s.InstanceEpoch, s.Active, s.resumePending = uri, chosen.snap.Status.Epoch, time.Now(), true
		out.Session, out.Epoch = s.ID, s.Epoch
		err := c.persist(s)
		if err == nil {
			failpoint.Eval("pc/epoch-persisted") // F15: a crash before anyone hears of the epoch
		}
		c.mu.Unlock()
		if err != nil {
			return nil, err
		}
		if mig.cp != nil {
			if err := c.cfg.Instances.Resume(ctx, uri, &kvsp.ResumeRequest{Epoch: out.Epoch, Checkpoint: *mig.cp}); err != nil {
				// Sent again by the next place, which moves the session
				// if it is refused again.
				c.log.Warn("resume not accepted; sent again at the session's next place", "instance", uri, "err", err)
			} else {
				c.mu.Lock()
				if s.Epoch == out.Epoch {
					s.resumePending = false
				}
				c.mu.Unlock()
			}
		}
		c.m.placements.WithLabelValues("migrated").Inc()
		return out, nil
	}
	if q.Session != nil {
		out.Session = *q.Session
	} else {
		out.Session = kvsp.NewUUID()
	}
	c.mu.Lock()
	if s := c.sessions[SessionKey{q.ScopeID, out.Session}]; s != nil { // placed meanwhile by a retry of this request
		out.Epoch, out.Instance = s.Epoch, s.Instance
		c.mu.Unlock()
		return out, nil
	}
	s := &Session{ID: out.Session, Epoch: 1, ScopeID: q.ScopeID, CompatID: q.CompatID, Prompt: kvsp.PromptDigest(keys, q.Tokens[len(keys)*bt:]),
		Instance: uri, InstanceEpoch: chosen.snap.Status.Epoch, Created: time.Now(), MaxTokens: q.MaxTokens}
	s.Active = s.Created
	if err := c.persist(s); err != nil {
		c.mu.Unlock()
		return nil, err
	}
	c.sessions[s.key()] = s
	c.mu.Unlock()
	grant.Session, grant.Epoch, grant.Prompt = s.ID, s.Epoch, s.Prompt
	if out.Grant, err = grant.Seal(key); err != nil {
		return nil, err
	}

	if chosen.cost.Fetch {
		out.Directive = c.prefetch(ctx, uri, q, out.Session, keys[:len(replicas)], replicas, chosen.cost, who)
	} else if len(replicas) > 0 { // a cached prefix left to recompute: counted, so that it shows
		c.m.directives.WithLabelValues("recompute").Inc()
	}
	c.m.placements.WithLabelValues("placed").Inc()
	c.m.matched.Observe(float64(len(replicas)))
	return out, nil
}

// served reports that compat is served here for scope: an instance
// authorized for the scope reported it (failed ones too: they may come
// back), or one known only from saved state has yet to report.
func (c *Controller) served(compat kvsp.CompatID, scope kvsp.ScopeID) bool {
	for _, s := range c.reg.All() {
		// A failed instance may come back (503 until then, not 409); one
		// known only from saved state has not said its model yet.
		if s.Status.Instance == "" || (s.Status.CompatID == compat && c.authorized(s, scope)) {
			return true
		}
	}
	return false
}

// authorized reports whether the instance s may be sent a scope's
// requests and directives (RELIABILITY S12): the identity that reports it
// holds the instance role, speaks for it and may use the scope, in the
// policy in force now. A PC used without a server (its Go API) has no
// policy to consult.
func (c *Controller) authorized(s Snapshot, scope kvsp.ScopeID) bool {
	ps := c.policy.Load()
	if ps == nil {
		return true
	}
	p := ps.Policy().Lookup(s.Reporter)
	return p.Has(server.RoleInstance) && p.SpeaksFor(s.Status.Instance) && p.MayUseScope(scope)
}

// authorizedURI is authorized for an instance known by its base URI.
func (c *Controller) authorizedURI(uri string, scope kvsp.ScopeID) bool {
	if c.policy.Load() == nil {
		return true
	}
	s, ok := c.reg.Get(uri)
	return ok && c.authorized(s, scope)
}

// serviceUs is the mean service time used for wait_us: the instance's
// running estimate, or this request's own estimate before it has one.
func (c *Controller) serviceUs(s Snapshot, tokens int, maxTokens uint64) float64 {
	if s.ServiceUs > 0 {
		return s.ServiceUs
	}
	return c.estimateServiceUs(&s.Status, tokens, maxTokens)
}

// estimateServiceUs is a request's service time from the instance's rates:
// its prefill plus its decode (A-22: the PC's own estimate).
func (c *Controller) estimateServiceUs(st *kvsp.InstanceStatus, tokens int, maxTokens uint64) float64 {
	us := 0.0
	if st.PrefillTokensPerS > 0 {
		us += 1e6 * float64(tokens) / st.PrefillTokensPerS
	}
	if st.DecodeTokensPerS > 0 {
		batch := max(1, float64(st.BatchSize))
		us += 1e6 * float64(maxTokens) * batch / st.DecodeTokensPerS // decode rate is shared by the batch
	}
	return us
}

// prefetch sends the instance a directive for the matched blocks it does
// not hold, and returns its id (nil when nothing was sent).
func (c *Controller) prefetch(ctx context.Context, uri string, q *kvsp.PlaceRequest, session kvsp.UUID, keys []kvsp.BlockKey, replicas [][]kvsp.ReplicaRecord, cost Cost, who Requester) *kvsp.UUID {
	d := &kvsp.PrefetchDirective{Directive: kvsp.NewUUID(), RequestRef: session.String(), ScopeID: q.ScopeID, CompatID: q.CompatID,
		LayerOrder: kvsp.LayerOrderAscending, LeaseMs: c.cfg.LeaseMs}
	for i, reps := range replicas {
		var sources []string
		resident := false
		for _, r := range reps {
			if r.Holder == uri {
				resident = true
				break
			}
			if !slices.Contains(sources, r.Holder) {
				sources = append(sources, r.Holder)
			}
		}
		if resident {
			continue
		}
		d.Blocks = append(d.Blocks, kvsp.PrefetchBlock{BlockKey: keys[i], Sources: sources})
	}
	if len(d.Blocks) == 0 {
		return nil
	}
	// Loading is worth waiting for as long as recomputing the matched
	// prefix would take (and at least twice the estimated fetch): past
	// that, the instance recomputes what has not arrived.
	deadline := max(time.Duration(max(2*cost.FetchUs, cost.RecomputeAllUs-cost.RecomputeUnmatchedUs))*time.Microsecond, c.cfg.MinDeadline)
	deadline = min(deadline, c.cfg.MaxDeadline)
	d.DeadlineMs = uint64((deadline + time.Millisecond - 1) / time.Millisecond)
	// Pending at the instance until done, at the latest its deadline.
	switch err := c.reg.reserve(uri, c.cfg.MaxPending, c.cfg.MaxShare, who, time.Now().Add(kvsp.Millis(d.DeadlineMs))); err {
	case nil:
	case errShare: // L5: the principal or scope holds its share of them
		c.m.directives.WithLabelValues("share").Inc()
		return nil
	default:
		c.m.directives.WithLabelValues("quota").Inc()
		return nil // R-PF-13: the request recomputes instead
	}
	if err := c.cfg.Instances.Prefetch(ctx, uri, d); err != nil {
		c.m.directives.WithLabelValues("failed").Inc()
		c.log.Warn("prefetch directive not accepted", "instance", uri, "err", err)
		return nil
	}
	c.m.directives.WithLabelValues("sent").Inc()
	return &d.Directive
}

type metrics struct {
	leader       prometheus.Gauge
	reshards     *prometheus.CounterVec
	migrations   prometheus.Counter
	stalls       prometheus.Counter
	forgotten    *prometheus.CounterVec
	checkpoints  *prometheus.CounterVec
	placements   *prometheus.CounterVec
	directives   *prometheus.CounterVec
	wakeups      prometheus.Counter
	lookups      *prometheus.CounterVec
	matched      prometheus.Histogram
	unauthorized prometheus.Counter
	shareRefused *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		migrations: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_pc_migrations_total", Help: "Sessions moved off a failed instance."}),
		forgotten:  prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_pc_sessions_forgotten_total", Help: "Sessions dropped: finished (after the retention) or idle."}, []string{"why"}),
		stalls:     prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_pc_stalls_total", Help: "Times the controller's sweep ran late (a stall): instances then get a status TTL before being judged failed."}),
		checkpoints: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_pc_checkpoints_total",
			Help: "Session checkpoints accepted: recorded (a higher offset, or the final one, A-39), ignored (not newer, or after the final one); uncancelled: a session its instance said cancelled whose front end came back for it."}, []string{"outcome"}),
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_pc_placements_total",
			Help: "Placement requests by outcome (placed, migrated, incompatible, beyond_limits: refused with 400, past every instance's vocabulary, context or output limit; share: refused with 429, the principal or scope holding its share of the room; no_capacity: refused with 503 once CapacityWait ran out; waited: a status record came while the request waited for room, and it looked again)."}, []string{"outcome"}),
		directives: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_pc_directives_total",
			Help: "Prefetch directives by outcome: sent; failed (the instance did not accept it); quota (not sent: the instance's pending directives at the limit); share (not sent: the principal or scope of the request holds its share of them); recompute (not sent: a cached prefix matched, and recomputing it was estimated cheaper than loading it, or no link to its sources is known)."}, []string{"outcome"}),
		wakeups: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_pc_wakeups_total", Help: "Sleeping instances woken for a request."}),
		lookups: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_pc_lookups_total",
			Help: "IS lookups of placements, by outcome (ok; failed: placed without the cache)."}, []string{"outcome"}),
		unauthorized: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_pc_unauthorized_candidates_total",
			Help: "Instances passed over for a request because the identity reporting them is not authorized for its scope."}),
		matched: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvsp_pc_matched_blocks",
			Help: "Cached prefix length of placed requests, in blocks.", Buckets: prometheus.ExponentialBuckets(1, 2, 12)}),
		reshards: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_pc_reshards_total",
			Help: "Reshards by outcome (committed, aborted)."}, []string{"outcome"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsp_pc_leader",
			Help: "1 while this controller serves (the leader of its group, or alone), 0 while a standby."}),
	}
	m.shareRefused = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_pc_share_refused_total",
		Help: "Places refused with 429 because the principal (label), or its scope, held its share of every instance's room in placements not yet generated."}, []string{"principal"})
	for _, o := range []string{"sent", "failed", "quota", "share", "recompute"} {
		m.directives.WithLabelValues(o) // each series exists from the start, at 0
	}
	if reg != nil {
		reg.MustRegister(m.migrations, m.stalls, m.forgotten, m.checkpoints, m.placements, m.directives, m.wakeups, m.lookups, m.matched, m.reshards, m.leader, m.unauthorized, m.shareRefused)
	}
	return m
}

// startCheckpoint is the checkpoint of a session that has output nothing
// yet (R-REC-16..21 at offset 0): its prompt, and the sampler it asked for
// at step 0. A migration resumes it like any other, so that the new
// instance knows the session, its scope and its prompt.
func (c *Controller) startCheckpoint(s *Session, q *kvsp.PlaceRequest) (*kvsp.Checkpoint, error) {
	keys, tail, _, err := c.prompt(q.ScopeID, q.CompatID, q.Tokens)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	epoch := s.Epoch
	c.mu.Unlock()
	cp := &kvsp.Checkpoint{Session: s.ID, Epoch: epoch, CompatID: s.CompatID, ScopeID: s.ScopeID,
		PromptBlocks: keys, PromptTail: append([]uint32{}, tail...), Generated: []uint32{},
		Sampler: kvsp.Sampler{Method: kvsp.SamplerGreedy, Params: map[string]any{}, Deterministic: true}}
	if sp := q.Sampler; sp != nil {
		cp.Sampler.Method, cp.Sampler.Seed, cp.Sampler.Deterministic = sp.Method, sp.Seed, sp.Method == kvsp.SamplerGreedy
		if sp.Params != nil {
			cp.Sampler.Params = sp.Params
		}
	}
	return cp, nil
}

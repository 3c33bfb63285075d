package placement

import (
	"container/heap"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// instance is what the PC knows of one instance.
type instance struct {
	st       kvsp.InstanceStatus // the last record accepted
	reporter string              // the identity that sent it ("" through the Go API)
	expires  time.Time
	maxEpoch uint64
	// draining is set when the PC accepted the instance's request to sleep
	// and the instance has not reported a state other than active since.
	draining bool
	pending  expiries // of the directives sent to it (R-PF-13)
	// serviceUs is the running estimate of a request's service time at
	// the instance (EWMA), for wait_us.
	serviceUs float64
	// placements are the requests placed on it whose generate it has not
	// reported started (status "started"), until their grant expires:
	// its status records do not show them, so they hold room beside its
	// running and queued (RELIABILITY L5: a placement never generated
	// releases its room when its grant expires, not before).
	placements map[kvsp.GrantID]placed
}

// placed is one placement holding room at an instance, and who holds it.
type placed struct {
	who     Requester
	expires time.Time
}

// Requester is who a placement or a directive is held for: the principal
// that asked for it and its scope. Each holds at most the PC's share of an
// instance's room and of its pending directives (RELIABILITY L5).
type Requester struct {
	Principal string // "" through the Go API
	Scope     kvsp.ScopeID
}

// live drops the placements whose grant expired and returns how many
// remain, and how many of them who holds by principal and by scope.
func (in *instance) live(now time.Time, who Requester) (all, principal, scope int) {
	for id, p := range in.placements {
		if !now.Before(p.expires) {
			delete(in.placements, id)
			continue
		}
		if p.who.Principal == who.Principal {
			principal++
		}
		if p.who.Scope == who.Scope {
			scope++
		}
	}
	return len(in.placements), principal, scope
}

// state is the state the PC assigns at now: failed once the record
// expired (R-ST-3).
func (in *instance) state(now time.Time) kvsp.InstanceState {
	switch {
	case !now.Before(in.expires):
		return kvsp.StateFailed
	case in.draining && in.st.State == kvsp.StateActive:
		return kvsp.StateDraining
	}
	return in.st.State
}

// pendingAt counts the directives not yet past their deadline, dropping
// the others (O(expired)).
func (in *instance) pendingAt(now time.Time) int {
	for len(in.pending) > 0 && !now.Before(in.pending[0].deadline) {
		heap.Pop(&in.pending)
	}
	return len(in.pending)
}

// heldDirectives counts the pending directives (past the expired, which
// pendingAt dropped) who holds, by principal and by scope.
func (in *instance) heldDirectives(who Requester) (principal, scope int) {
	for _, d := range in.pending {
		if d.who.Principal == who.Principal {
			principal++
		}
		if d.who.Scope == who.Scope {
			scope++
		}
	}
	return principal, scope
}

func (in *instance) snapshot(now time.Time, who *Requester) Snapshot {
	s := Snapshot{Status: in.st, State: in.state(now), Pending: in.pendingAt(now), ServiceUs: in.serviceUs, Reporter: in.reporter}
	if who != nil {
		s.Placed, s.held.placements, s.held.placementsScope = in.live(now, *who)
		s.held.directives, s.held.directivesScope = in.heldDirectives(*who)
	} else {
		s.Placed, _, _ = in.live(now, Requester{})
	}
	return s
}

// expiries is a min-heap of pending directives by deadline.
type expiries []directiveHeld

type directiveHeld struct {
	deadline time.Time
	who      Requester
}

func (h expiries) Len() int           { return len(h) }
func (h expiries) Less(i, j int) bool { return h[i].deadline.Before(h[j].deadline) }
func (h expiries) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiries) Push(x any)        { *h = append(*h, x.(directiveHeld)) }
func (h *expiries) Pop() any {
	old := *h
	t := old[len(old)-1]
	*h = old[:len(old)-1]
	return t
}

// Registry holds instance status records.
type Registry struct {
	mu       sync.Mutex
	m        map[string]*instance
	onStatus func(kvsp.InstanceStatus)
	persist  func(instance string, epoch uint64) error // a higher epoch, before it is accepted
	// update is closed (and replaced) when a status record is accepted:
	// requests waiting for capacity look again.
	update chan struct{}
}

// changed returns a channel closed at the next status record accepted.
func (r *Registry) changed() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.update == nil {
		r.update = make(chan struct{})
	}
	return r.update
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{m: map[string]*instance{}} }

// Put applies a status record (spec "Instance Status and Lifecycle") and
// returns the state the PC assigns: the reported state, failed
// never (an instance that reports is alive), or draining when the instance
// asks to sleep and another active instance of its model remains to serve
// (otherwise the request is refused: active). A record whose epoch is
// below the highest seen is refused (409 kvsp-stale-epoch, with the
// highest epoch; A-12) and changes nothing.
func (r *Registry) Put(st *kvsp.InstanceStatus) (kvsp.InstanceState, error) {
	return r.PutFrom(st, "")
}

// PutFrom is Put for a record sent by the identity reporter (the PC
// places a scope's requests only on instances whose reporter the policy
// authorizes for that scope, RELIABILITY S12).
func (r *Registry) PutFrom(st *kvsp.InstanceStatus, reporter string) (kvsp.InstanceState, error) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	in := r.m[st.Instance]
	if in == nil {
		in = &instance{}
		r.m[st.Instance] = in
	}
	if st.Epoch < in.maxEpoch {
		return "", kvsp.NewProblem(kvsp.ErrStaleEpoch, fmt.Sprintf("status epoch %d is below %d", st.Epoch, in.maxEpoch)).With("epoch", in.maxEpoch)
	}
	if st.Epoch > in.maxEpoch { // a restart: what it was doing is gone
		if r.persist != nil {
			if err := r.persist(st.Instance, st.Epoch); err != nil {
				return "", fmt.Errorf("%w: the controller's state could not be written", kvsp.ErrUnavailable)
			}
		}
		in.maxEpoch, in.draining, in.pending, in.placements = st.Epoch, false, nil, nil
	}
	for _, id := range st.Started { // in its running and queued from now on
		delete(in.placements, id)
	}
	in.st = *st
	in.st.Started = nil
	in.reporter = reporter
	in.st.Links = append([]kvsp.Link(nil), st.Links...)
	in.expires = now.Add(kvsp.Millis(st.TTLMs))
	if st.State != kvsp.StateActive {
		in.draining = false // it has moved on
	}
	if st.RequestedState != nil && *st.RequestedState == kvsp.StateSleeping && st.State == kvsp.StateActive && !in.draining {
		in.draining = r.othersActive(st.Instance, st.CompatID, now)
	}
	if r.onStatus != nil {
		r.onStatus(in.st)
	}
	if r.update != nil {
		close(r.update)
		r.update = nil
	}
	return in.state(now), nil
}

// othersActive reports another active instance of compat.
func (r *Registry) othersActive(self string, compat kvsp.CompatID, now time.Time) bool {
	for uri, in := range r.m {
		if uri != self && in.st.CompatID == compat && in.state(now) == kvsp.StateActive {
			return true
		}
	}
	return false
}

// Snapshot is an instance as the PC sees it now.
type Snapshot struct {
	Status  kvsp.InstanceStatus
	State   kvsp.InstanceState
	Pending int
	// ServiceUs is the mean service time estimate (0: none yet).
	ServiceUs float64
	// Placed counts the requests placed on it that it has not reported
	// started, their grants unexpired.
	Placed int
	// Reporter is the identity that sent the status record.
	Reporter string
	// held is what the Requester a snapshot was taken for holds there
	// (AllFor): placements not started and pending directives, by
	// principal and by scope.
	held struct{ placements, placementsScope, directives, directivesScope int }
}

// Load estimates the requests at the instance now: running and queued as
// last reported, and those placed since.
func (s *Snapshot) Load() uint64 { return s.Status.Running + s.Status.Queued + uint64(s.Placed) }

// QueuedNow estimates its queue now: the reported queue, or what the
// requests placed since overflow its batch.
func (s *Snapshot) QueuedNow() uint64 {
	if l, b := s.Load(), max(1, s.Status.BatchSize); l > b && l-b > s.Status.Queued {
		return l - b
	}
	return s.Status.Queued
}

// Get returns an instance's snapshot.
func (r *Registry) Get(uri string) (Snapshot, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	in := r.m[uri]
	if in == nil {
		return Snapshot{}, false
	}
	now := time.Now()
	return in.snapshot(now, nil), true
}

// All returns every instance's snapshot.
func (r *Registry) All() []Snapshot { return r.AllFor(nil) }

// AllFor returns every instance's snapshot with what who holds there
// (nil: nobody's).
func (r *Registry) AllFor(who *Requester) []Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	out := make([]Snapshot, 0, len(r.m))
	for _, in := range r.m {
		out = append(out, in.snapshot(now, who))
	}
	return out
}

// URIs lists the instances the registry knows, reported or from saved
// state.
func (r *Registry) URIs() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, 0, len(r.m))
	for uri := range r.m {
		out = append(out, uri)
	}
	slices.Sort(out)
	return out
}

// setState records a state the PC set on the instance (PUT state).
func (r *Registry) setState(uri string, s kvsp.InstanceState) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if in := r.m[uri]; in != nil {
		in.st.State, in.draining = s, false
	}
}

// reserve takes one of the instance's pending-directive slots for who
// until deadline, if fewer than max are taken (R-PF-13) and who holds
// fewer than share of them, by principal and by scope (RELIABILITY L5).
// It returns errShare when who's share is what is full.
func (r *Registry) reserve(uri string, max int, share float64, who Requester, deadline time.Time) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	in := r.m[uri]
	if in == nil || in.pendingAt(time.Now()) >= max {
		return errDirectivesFull
	}
	if p, s := in.heldDirectives(who); atShare(p, s, share, max) {
		return errShare
	}
	heap.Push(&in.pending, directiveHeld{deadline, who})
	return nil
}

// errDirectivesFull: the instance's pending directives are at MaxPending.
var errDirectivesFull = errors.New("placement: the instance's pending directives are at the limit")

// room is the requests an instance takes at once as the PC places them
// (R-PLC-7): its batch running and a batch queued.
func room(st *kvsp.InstanceStatus) int { return 2 * int(max(1, st.BatchSize)) }

// atShare reports that a principal holding p and its scope holding s of a
// limit are at their share of it (at least one each).
func atShare(p, s int, share float64, limit int) bool {
	n := max(1, int(share*float64(limit)))
	return p >= n || s >= n
}

// admit reserves the instance's room for one request (R-PLC-7): under
// the registry's lock, so that requests choosing at once (those a status
// record woke, each having seen the same room) do not all pile onto it.
// It refuses when the queue, counting the placements not started yet, is
// a batch already (errRoomTaken), or when who holds its share of the
// instance's room in placements not started (errShare); otherwise the
// placement id holds room until its generate starts or expires, and the
// request's estimated service time folds into the instance's mean (EWMA,
// weight 1/8).
func (r *Registry) admit(uri string, us float64, id kvsp.GrantID, who Requester, share float64, expires time.Time) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	in := r.m[uri]
	if in == nil {
		return errRoomTaken
	}
	snap := in.snapshot(time.Now(), &who)
	if snap.QueuedNow() >= max(1, snap.Status.BatchSize) {
		return errRoomTaken
	}
	if atShare(snap.held.placements, snap.held.placementsScope, share, room(&snap.Status)) {
		return errShare
	}
	if in.placements == nil {
		in.placements = map[kvsp.GrantID]placed{}
	}
	in.placements[id] = placed{who, expires}
	if in.serviceUs == 0 {
		in.serviceUs = us
	} else {
		in.serviceUs += (us - in.serviceUs) / 8
	}
	return nil
}

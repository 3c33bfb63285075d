package placement

import (
	"container/heap"
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
	// placed counts the requests placed on it since its last status
	// record, which does not show them yet.
	placed int
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
	for len(in.pending) > 0 && !now.Before(in.pending[0]) {
		heap.Pop(&in.pending)
	}
	return len(in.pending)
}

func (in *instance) snapshot(now time.Time) Snapshot {
	return Snapshot{Status: in.st, State: in.state(now), Pending: in.pendingAt(now), ServiceUs: in.serviceUs, Placed: in.placed, Reporter: in.reporter}
}

// expiries is a min-heap of times.
type expiries []time.Time

func (h expiries) Len() int           { return len(h) }
func (h expiries) Less(i, j int) bool { return h[i].Before(h[j]) }
func (h expiries) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiries) Push(x any)        { *h = append(*h, x.(time.Time)) }
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
		in.maxEpoch, in.draining, in.pending = st.Epoch, false, nil
	}
	in.st = *st
	in.reporter = reporter
	in.placed = 0
	in.st.Links = append([]kvsp.Link(nil), st.Links...)
	in.expires = now.Add(time.Duration(st.TTLMs) * time.Millisecond)
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
	// Placed counts the requests placed since its last status record.
	Placed int
	// Reporter is the identity that sent the status record.
	Reporter string
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
	return in.snapshot(now), true
}

// All returns every instance's snapshot.
func (r *Registry) All() []Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	out := make([]Snapshot, 0, len(r.m))
	for _, in := range r.m {
		out = append(out, in.snapshot(now))
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

// reserve takes one of the instance's pending-directive slots until
// deadline, if fewer than max are taken (R-PF-13).
func (r *Registry) reserve(uri string, max int, deadline time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	in := r.m[uri]
	if in == nil || in.pendingAt(time.Now()) >= max {
		return false
	}
	heap.Push(&in.pending, deadline)
	return true
}

// admit reserves the instance's room for one request (R-PLC-7): under
// the registry's lock, so that requests choosing at once (those a status
// record woke, each having seen the same room) do not all pile onto it.
// It reports false when the queue, counting what was placed since the
// last record, is a batch already; otherwise the request counts as placed
// and its estimated service time folds into the instance's mean (EWMA,
// weight 1/8).
func (r *Registry) admit(uri string, us float64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	in := r.m[uri]
	if in == nil {
		return false
	}
	if snap := in.snapshot(time.Now()); snap.QueuedNow() >= max(1, snap.Status.BatchSize) {
		return false
	}
	in.placed++
	if in.serviceUs == 0 {
		in.serviceUs = us
	} else {
		in.serviceUs += (us - in.serviceUs) / 8
	}
	return true
}

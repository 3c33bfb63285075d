package holder

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// LeaseQuota bounds each client's leases (R-LS-5, R-LS-6, R-SEC-11,
// R-SEC-12).
type LeaseQuota struct {
	Octets    int64         // leased octets at once
	MaxTTL    time.Duration // longest lease
	MaxLeases int           // leases at once
}

type lease struct {
	id      string
	owner   string
	keys    []blockID
	octets  int64
	expires time.Time
}

// leases is the lease table: per client identity, with quotas. A lease
// covers its blocks against eviction until it expires or is released.
type leases struct {
	mu      sync.Mutex
	quota   LeaseQuota
	byID    map[string]*lease
	byOwner map[string]map[string]*lease
	pins    map[blockID]int // blocks under at least one live lease
}

func newLeases(q LeaseQuota) *leases {
	return &leases{quota: q, byID: map[string]*lease{}, byOwner: map[string]map[string]*lease{}, pins: map[blockID]int{}}
}

func newLeaseID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// quotaProblem is 429 kvsp-lease-quota with the limits.
func (l *leases) quotaProblem(detail string) error {
	return kvsp.NewProblem(kvsp.ErrLeaseQuota, detail).
		With("max_octets", l.quota.Octets).With("max_ttl_ms", l.quota.MaxTTL.Milliseconds()).With("max_leases", l.quota.MaxLeases)
}

// reapLocked drops the expired leases of owner (all owners when "").
func (l *leases) reapLocked(now time.Time, owner string) {
	for o, m := range l.byOwner {
		if owner != "" && o != owner {
			continue
		}
		for id, ls := range m {
			if !ls.expires.After(now) {
				l.dropLocked(ls)
				delete(m, id)
			}
		}
	}
}

func (l *leases) dropLocked(ls *lease) {
	delete(l.byID, ls.id)
	for _, k := range ls.keys {
		if l.pins[k]--; l.pins[k] <= 0 {
			delete(l.pins, k)
		}
	}
}

// grant creates a lease for owner on keys totalling octets.
func (l *leases) grant(owner string, keys []blockID, octets int64, ttl time.Duration) (*lease, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	l.reapLocked(now, owner)
	if ttl > l.quota.MaxTTL {
		return nil, l.quotaProblem(fmt.Sprintf("ttl_ms above the limit of %d", l.quota.MaxTTL.Milliseconds()))
	}
	mine := l.byOwner[owner]
	if len(mine) >= l.quota.MaxLeases {
		return nil, l.quotaProblem(fmt.Sprintf("at most %d leases at once", l.quota.MaxLeases))
	}
	var held int64
	for _, ls := range mine {
		held += ls.octets
	}
	if held+octets > l.quota.Octets {
		return nil, l.quotaProblem(fmt.Sprintf("leased octets above the limit of %d", l.quota.Octets))
	}
	ls := &lease{id: newLeaseID(), owner: owner, keys: keys, octets: octets, expires: now.Add(ttl)}
	if mine == nil {
		mine = map[string]*lease{}
		l.byOwner[owner] = mine
	}
	mine[ls.id] = ls
	l.byID[ls.id] = ls
	for _, k := range keys {
		l.pins[k]++
	}
	return ls, nil
}

// lookupLocked returns owner's live lease id; another client's lease is
// not found (R-LS-10).
func (l *leases) lookupLocked(owner, id string, now time.Time) (*lease, error) {
	ls := l.byID[id]
	if ls == nil || ls.owner != owner || !ls.expires.After(now) {
		return nil, fmt.Errorf("%w: lease", kvsp.ErrNotFound)
	}
	return ls, nil
}

// renew extends owner's lease id by ttl from now. The owner must still be
// authorized for the lease's scope (may): a lease is not a way to keep
// pinning, and learning the keys of, blocks of a scope taken from its
// owner since; such a lease is not found, as another client's (S11).
func (l *leases) renew(owner, id string, ttl time.Duration, may func(kvsp.ScopeID) bool) (*lease, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	l.reapLocked(now, owner)
	ls, err := l.lookupLocked(owner, id, now)
	if err != nil {
		return nil, err
	}
	if len(ls.keys) > 0 && !may(ls.keys[0].scope) {
		return nil, fmt.Errorf("%w: lease", kvsp.ErrNotFound)
	}
	if ttl > l.quota.MaxTTL {
		return nil, l.quotaProblem(fmt.Sprintf("ttl_ms above the limit of %d", l.quota.MaxTTL.Milliseconds()))
	}
	ls.expires = now.Add(ttl)
	return ls, nil
}

// release drops owner's lease id.
func (l *leases) release(owner, id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	l.reapLocked(now, owner)
	ls, err := l.lookupLocked(owner, id, now)
	if err != nil {
		return err
	}
	l.dropLocked(ls)
	delete(l.byOwner[owner], id)
	return nil
}

// live counts the leases not expired at now and the octets they cover
// (the operator's gauges; RELIABILITY L2 checks they return to zero).
func (l *leases) live(now time.Time) (n int, octets int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reapLocked(now, "")
	for _, ls := range l.byID {
		n++
		octets += ls.octets
	}
	return n, octets
}

// pinned reports whether a live lease covers k.
func (l *leases) pinned(k blockID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reapLocked(time.Now(), "")
	return l.pins[k] > 0
}

package index

import (
	"math"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// StatusSource gives the IS the status and links of instances, when the PC
// is co-located or forwards status records. Without it, lookups
// carry no estimates.
type StatusSource interface {
	Status(instance string) (kvsp.InstanceStatus, bool)
}

// StatusTable is a StatusSource fed with status records; a record is
// forgotten when its ttl_ms has passed (the PC considers the instance
// failed then: R-ST-3).
type StatusTable struct {
	mu sync.RWMutex
	m  map[string]statusEntry
}

type statusEntry struct {
	st      kvsp.InstanceStatus
	expires time.Time
}

// NewStatusTable returns an empty table.
func NewStatusTable() *StatusTable { return &StatusTable{m: make(map[string]statusEntry)} }

// Update records a status (the caller has applied the epoch rules).
func (t *StatusTable) Update(st kvsp.InstanceStatus) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.m[st.Instance] = statusEntry{st, time.Now().Add(time.Duration(st.TTLMs) * time.Millisecond)}
}

// Status implements StatusSource.
func (t *StatusTable) Status(instance string) (kvsp.InstanceStatus, bool) {
	t.mu.RLock()
	e, ok := t.m[instance]
	t.mu.RUnlock()
	if !ok || !e.expires.After(time.Now()) {
		return kvsp.InstanceStatus{}, false
	}
	return e.st, true
}

// Estimate computes a lookup target's fetch_us and recompute_us (spec
// "Placement Inputs", A-21, A-22) for the matched blocks:
//
//   - a block with a replica at the target costs nothing (R-PLC-3);
//   - otherwise each block is taken from the source with the lowest
//     estimate given what is already assigned to it (greedy), where a
//     source's time is rtt_us + sum over tiers of 8 x bytes / min(link,
//     read_mbit_per_s of the tier) (R-PLC-2, R-PLC-5), and the bytes of a
//     tier are size x layers in the tier / layers held;
//   - fetch_us is the largest source time, rounded up (R-PLC-2);
//   - recompute_us = ceil(1e6 x matched x B / prefill_tokens_per_s).
//
// It reports false when the status lacks what is needed: no link to any
// source of some block, no prefill rate, or unknown B.
func Estimate(st *kvsp.InstanceStatus, replicas [][]kvsp.ReplicaRecord, blockTokens int) (fetchUs, recomputeUs uint64, ok bool) {
	if st.PrefillTokensPerS <= 0 || blockTokens <= 0 {
		return 0, 0, false
	}
	links := make(map[string]kvsp.Link, len(st.Links))
	for _, l := range st.Links {
		links[l.Holder] = l
	}
	type srcAcc struct {
		rtt  float64
		xfer float64 // microseconds of transfer assigned
	}
	acc := map[string]*srcAcc{}
	for _, reps := range replicas {
		resident := false
		for i := range reps {
			if reps[i].Holder == st.Instance {
				resident = true
				break
			}
		}
		if resident {
			continue
		}
		best, bestCost, bestXfer := "", math.Inf(1), 0.0
		for i := range reps {
			r := &reps[i]
			l, ok := links[r.Holder]
			if !ok || l.MbitPerS == 0 {
				continue
			}
			xfer := transferUs(r, float64(l.MbitPerS))
			a := acc[r.Holder]
			cost := float64(l.RTTUs) + xfer
			if a != nil {
				cost = a.rtt + a.xfer + xfer
			}
			if cost < bestCost {
				best, bestCost, bestXfer = r.Holder, cost, xfer
			}
		}
		if best == "" {
			return 0, 0, false
		}
		a := acc[best]
		if a == nil {
			a = &srcAcc{rtt: float64(links[best].RTTUs)}
			acc[best] = a
		}
		a.xfer += bestXfer
	}
	var fetch float64
	for _, a := range acc {
		fetch = math.Max(fetch, a.rtt+a.xfer)
	}
	tokens := float64(len(replicas)) * float64(blockTokens)
	return uint64(math.Ceil(fetch)), uint64(math.Ceil(1e6 * tokens / st.PrefillTokensPerS)), true
}

// transferUs is the time to move one replica's octets over a link of
// linkMbit, each tier at most at its read rate.
func transferUs(r *kvsp.ReplicaRecord, linkMbit float64) float64 {
	held := r.HeldLayers()
	if held == 0 {
		return 0
	}
	var us float64
	for _, e := range r.Residency {
		rate := linkMbit
		if e.ReadMbitPerS != 0 && float64(e.ReadMbitPerS) < rate {
			rate = float64(e.ReadMbitPerS)
		}
		bytes := float64(r.Size) * float64(e.Layers.Len()) / float64(held)
		us += 8 * bytes / rate // bits / (Mbit/s) = microseconds
	}
	return us
}

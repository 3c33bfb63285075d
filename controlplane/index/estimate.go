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
	t.m[st.Instance] = statusEntry{st, time.Now().Add(kvsp.Millis(st.TTLMs))}
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
// source of some block, no prefill rate, or unknown B. A caller that
// estimates the same replicas for many instances (the PC) prepares them
// once with NewPlan.
func Estimate(st *kvsp.InstanceStatus, replicas [][]kvsp.ReplicaRecord, blockTokens int) (fetchUs, recomputeUs uint64, ok bool) {
	return NewPlan(replicas).Estimate(st, blockTokens)
}

// Plan is a lookup's replicas prepared for estimates at many instances:
// holders numbered, each replica's tiers reduced to (bits, read rate).
type Plan struct {
	holders []string
	blocks  [][]planReplica
}

type planReplica struct {
	holder int
	tiers  []planTier
}

type planTier struct {
	bits float64 // 8 x the tier's share of the replica's octets
	rate float64 // its read_mbit_per_s; 0: the link's
}

// NewPlan prepares replicas (one non-empty list per matched block).
func NewPlan(replicas [][]kvsp.ReplicaRecord) *Plan {
	p := &Plan{blocks: make([][]planReplica, len(replicas))}
	idx := map[string]int{}
	for i, reps := range replicas {
		p.blocks[i] = make([]planReplica, len(reps))
		for j := range reps {
			r := &reps[j]
			h, ok := idx[r.Holder]
			if !ok {
				h = len(p.holders)
				idx[r.Holder] = h
				p.holders = append(p.holders, r.Holder)
			}
			pr := planReplica{holder: h}
			if held := r.HeldLayers(); held > 0 {
				for _, e := range r.Residency {
					pr.tiers = append(pr.tiers, planTier{bits: 8 * float64(r.Size) * float64(e.Layers.Len()) / float64(held), rate: float64(e.ReadMbitPerS)})
				}
			}
			p.blocks[i][j] = pr
		}
	}
	return p
}

// Estimate is Estimate of the package for the plan's replicas.
func (p *Plan) Estimate(st *kvsp.InstanceStatus, blockTokens int) (fetchUs, recomputeUs uint64, ok bool) {
	if st.PrefillTokensPerS <= 0 || blockTokens <= 0 {
		return 0, 0, false
	}
	// Per holder: the instance's link (rate 0: none), and what is
	// assigned to it so far.
	type src struct {
		link, rtt float64
		xfer      float64
		used      bool
	}
	var buf [32]src
	srcs := buf[:0]
	if len(p.holders) > len(buf) {
		srcs = make([]src, 0, len(p.holders))
	}
	self := -1
	for h, uri := range p.holders {
		s := src{}
		for _, l := range st.Links {
			if l.Holder == uri {
				s.link, s.rtt = float64(l.MbitPerS), float64(l.RTTUs)
				break
			}
		}
		if uri == st.Instance {
			self = h
		}
		srcs = append(srcs, s)
	}
	for _, reps := range p.blocks {
		resident := false
		for _, r := range reps {
			if r.holder == self {
				resident = true
				break
			}
		}
		if resident {
			continue
		}
		best, bestCost, bestXfer := -1, math.Inf(1), 0.0
		for _, r := range reps {
			s := &srcs[r.holder]
			if s.link == 0 {
				continue
			}
			var xfer float64
			for _, t := range r.tiers {
				rate := s.link
				if t.rate != 0 && t.rate < rate {
					rate = t.rate
				}
				xfer += t.bits / rate // bits / (Mbit/s) = microseconds
			}
			if cost := s.rtt + s.xfer + xfer; cost < bestCost {
				best, bestCost, bestXfer = r.holder, cost, xfer
			}
		}
		if best < 0 {
			return 0, 0, false
		}
		srcs[best].xfer += bestXfer
		srcs[best].used = true
	}
	var fetch float64
	for _, s := range srcs {
		if s.used {
			fetch = math.Max(fetch, s.rtt+s.xfer)
		}
	}
	tokens := float64(len(p.blocks)) * float64(blockTokens)
	return uint64(math.Ceil(fetch)), uint64(math.Ceil(1e6 * tokens / st.PrefillTokensPerS)), true
}

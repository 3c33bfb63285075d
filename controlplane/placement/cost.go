package placement

import (
	"math"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/index"
)

// Cost is the estimated cost of serving a request at an instance, in
// microseconds (spec "Placement Inputs", R-PLC-2..8).
type Cost struct {
	WaitUs               float64 // queued x mean service time (R-PLC-7)
	FetchUs              float64 // loading the matched blocks it lacks (R-PLC-2..5)
	RecomputeUnmatchedUs float64 // prefill of the tokens after the matched prefix
	RecomputeAllUs       float64 // prefill of every token (R-PLC-6)
	// Fetch reports whether loading the cached prefix beats recomputing
	// it (and the links to its sources are known).
	Fetch bool
	Total float64 // R-PLC-8
}

// costAt computes the cost of a request of totalTokens tokens whose first
// len(replicas) blocks of blockTokens tokens are cached, at the instance
// whose status is st and mean service time serviceUs.
func costAt(st *kvsp.InstanceStatus, serviceUs float64, replicas [][]kvsp.ReplicaRecord, blockTokens, totalTokens int) Cost {
	return costWith(st, serviceUs, index.NewPlan(replicas), len(replicas), blockTokens, totalTokens)
}

// costWith is costAt with the replicas prepared once for every candidate.
func costWith(st *kvsp.InstanceStatus, serviceUs float64, plan *index.Plan, matched, blockTokens, totalTokens int) Cost {
	c := Cost{WaitUs: float64(st.Queued) * serviceUs}
	if st.PrefillTokensPerS <= 0 {
		c.RecomputeAllUs, c.Total = math.Inf(1), math.Inf(1)
		return c
	}
	matchedTokens := min(matched*blockTokens, totalTokens)
	c.RecomputeAllUs = 1e6 * float64(totalTokens) / st.PrefillTokensPerS
	c.RecomputeUnmatchedUs = 1e6 * float64(totalTokens-matchedTokens) / st.PrefillTokensPerS
	c.Total = c.WaitUs + c.RecomputeAllUs
	if matched == 0 {
		return c
	}
	fetch, _, ok := plan.Estimate(st, blockTokens)
	if !ok {
		return c // no link to some source: recompute
	}
	c.FetchUs = float64(fetch)
	if c.FetchUs+c.RecomputeUnmatchedUs < c.RecomputeAllUs {
		c.Fetch = true
		c.Total = c.WaitUs + c.FetchUs + c.RecomputeUnmatchedUs
	}
	return c
}

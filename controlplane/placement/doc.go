// Package placement is the Placement Controller (PC): it keeps the status
// and lifecycle of inference instances (spec "Instance Status and
// Lifecycle"; R-ST-*, A-12, A-19) and places requests on them by cost
// ("Placement Inputs"; R-PLC-*, A-21, A-22), sending the chosen instance a
// prefetch directive for the cached prefix it lacks ("Prefetch
// Directives"; R-PF-*).
//
// The PC holds the scope keys: it computes a request's Block Keys itself
// and asks the Index Service about keys only (the IS never sees a scope
// key). Costs are the spec's:
//
//	cost(i) = wait_us(i) + min(fetch_us(i) + recompute_us_of_unmatched(i), recompute_us_of_all(i))
//
// with fetch_us from the replicas' holders, tiers and read rates and the
// instance's links (index.Estimate, shared with the IS), recompute times
// from the instance's prefill rate, and wait_us = queued x the PC's running
// estimate of the instance's mean service time.
//
// Instances are failed when their status record expires; records with a
// lower epoch than the highest seen are refused with 409 kvsp-stale-epoch
// . New requests and directives go to active instances only
// (R-ST-12); when none has capacity, a sleeping instance is woken (PUT
// state active) and sent its prefetch at once (R-PLC-11).
package placement

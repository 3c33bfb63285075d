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
//
// Sequence-sharded contexts ("Sequence-Sharded Caches and Resharding";
// R-RSH-*, A-26) move between map versions by two-phase commit
// (Controller.Reshard): PlanReshard gives every member of either version
// its plan (retain, fetch from the old owner, release), all must
// acknowledge within deadline_ms, the new version is stored before any
// commit is sent, and otherwise every member is sent an abort. Plans carry
// kvsp extension members that other implementations ignore: scope_id and
// compat_id of the context, and per fetch the Block Keys of the range and
// the holder of the source instance (which the PC learns from the holder
// member of its status records). A range with no owner in the old
// version (the first map) is fetched "from" the member itself: it loads
// the blocks from the replicas the IS names. Released blocks leave the
// instance's engine memory; the copies it stored at its holder stay as
// ordinary cache replicas under that holder's eviction.
package placement

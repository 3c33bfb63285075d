package kvsp

// The JSON records of the spec (section "Records" and the procedures), with
// the shapes the spec leaves open fixed by the decisions of CONFORMANCE.md
// section 3. Decode them with [Decode]: strict JSON, then Validate. A
// required member that is absent, null, or zero where zero is meaningless is
// invalid; members whose zero is meaningful (counts, offsets, seeds) are
// checked for presence while decoding.
//
// One file per part of the protocol: records_replica.go (replica records
// and residency), records_status.go (instance status), records_lookup.go,
// records_prefetch.go, records_lease.go, records_session.go (samplers,
// checkpoints, resume), records_reshard.go (shard maps and reshards),
// records_place.go (placement and generation) and records_rdma.go;
// required.go decodes the members that must be present.

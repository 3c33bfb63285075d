// Package index is the KVSP Index Service (spec sections "Publishing and
// Withdrawing Replicas", "Lookup" and "Placement Inputs"; CONFORMANCE.md
// R-IS-*, R-PLC-*; decisions ..A-22, A-27, A-28, A-34).
//
// Holders publish Replica Records (PUT replicas/{holder-id}/{block_key});
// records expire after their ttl_ms, capped by the service. A lookup takes
// the Block Keys of a prompt in prefix order and returns the replicas of the
// longest prefix whose every key has at least one unexpired replica, with,
// for target instances whose status the service knows, the estimated time
// to fetch those blocks and to recompute them.
//
// Records live in a [Backend]: [Memory] (default) keeps them in sharded maps
// with per-shard expiry heaps, so expiring costs O(expired) and never holds
// more than one shard for a bounded batch; lookups take one shard's read
// lock per key and never wait on a global lock.
package index

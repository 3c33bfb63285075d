// Package holder is a KVSP holder: it stores KV blocks and serves them, whole
// or by layer range (spec sections "Block Retrieval and Storage", "Leases",
// "Publishing and Withdrawing Replicas"; CONFORMANCE.md R-BLK-*, R-LS-*,
// R-IS-1..8 holder side; decisions ..A-16, A-38).
//
// A PUT streams the container in, validates it against the descriptor's
// geometry and computes its layer and container digests in one pass
// (container.OpenBlock); nothing is visible, served or published before
// the whole block is verified and stored. A GET hands the stored octets to
// the connection without copying them (container.View.WriteTo), with the
// Repr-Digest computed at PUT for whole blocks and once per layer range.
//
// Eviction is least-recently-used over the blocks that no unexpired lease
// covers: LRU because prefix caches are reused by recency (a popular system
// prompt stays hot), and because it costs O(1) per access with a list,
// where frequency-based policies need counters that outlive evictions. A
// block is withdrawn from the Index Service before its memory is released
// (R-IS-7, R-IS-8).
//
// This step of the holder keeps blocks in host memory (the host tier);
// the device and local-storage tiers, and encryption at rest, come next.
package holder

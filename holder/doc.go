// Package holder is a KVSP holder: it stores KV blocks and serves them, whole
// or by layer range (spec sections "Block Retrieval and Storage", "Leases",
// "Publishing and Withdrawing Replicas"; CONFORMANCE.md R-BLK-*, R-LS-*,
// R-IS-1..8 holder side; decisions ..A-16, A-38).
//
// A PUT streams the container into recycled memory (a size-classed pool
// fed by evictions), validates it against the descriptor's geometry and
// computes its layer and container digests while it arrives
// (container.ReadBlockInto); nothing is visible, served or published
// before the whole block is verified and stored. A GET hands the stored
// octets to the connection without copying them (container.View.WriteTo),
// with the Repr-Digest computed at PUT for whole blocks and once per layer
// range; memory in use by a GET is not recycled until it finishes, and
// what GETs hold beyond the host tier's capacity (blocks evicted while
// they are sent, blocks read back from local storage or copied for one
// GET) counts against their client's read allowance (reads.go): past it
// a GET is refused with 429, or cut.
//
// Tiers: device (tier.Device: accelerator memory through package gpu, a
// host-memory stand-in under -tags nogpu) takes the first layers of each
// block while it has room, the rest stay in host memory, and the Replica
// Record's residency says exactly which layers are where; a GET of a split
// block sends the device layers through a staging buffer and the host ones
// straight from memory. host is Go memory. local-storage (tier.Disk)
// holds encrypted files. Blocks move down: device to host to
// local-storage, then out.
//
// Eviction is least-recently-used over the blocks that no unexpired lease
// covers: LRU because prefix caches are reused by recency (a popular system
// prompt stays hot), and because it costs O(1) per access with a list,
// where frequency-based policies need counters that outlive evictions.
// The device tier has its own LRU, over the same leases. A block is
// withdrawn from the Index Service when it is evicted (R-IS-7, R-IS-8) and
// republished with its new residency when it is demoted.
package holder

// Package container is the KVB1 KV Block Container of KVSP (spec section
// "KV Block Container"; CONFORMANCE.md R-CNT-*, decisions ).
//
// A container holds a contiguous range of layers of one block:
//
//	 0                   1                   2                   3
//	 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|                 Magic ("KVB1" = 0x4B564231)                   |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|    Version    |     Flags     |             Codec             |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|                          First Layer                          |
//	|                          Layer Count                          |
//	|                          Token Count                          |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|     Layer Count entries of { K Length (64), V Length (64) }   |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//	|   Data: for each layer in ascending order, K octets, V octets |
//	+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//
// All integers are big-endian; the header is 20 + 16 x Layer Count octets.
// For codec raw (0x0001, layout "kvsp-layout-1") each section holds
// Token Count x kv_heads x head_dim elements, token slowest, dimension
// fastest, each element little-endian.
//
// The layer digest of layer l is SHA-256(K_l || V_l); the replica digest is
// SHA-256 over the raw 32-octet layer digests in ascending order; the
// container digest, sent as Repr-Digest, is SHA-256 of the whole container.
//
// Writing: a [Writer] streams layers to an io.Writer in ascending order,
// from byte slices or readers, hashing each byte once per digest as it
// passes. Reading: a [Reader] yields each layer as soon as its octets have
// arrived and its digest checked, so a consumer can use layer l while l+1 is
// in flight. Serving: a [Block] is a validated stored container whose layer
// ranges ([Block.Range]) are views: a new header plus one contiguous slice
// of the stored octets, in O(1) and without allocation.
//
// This package imports only the standard library; it knows nothing of HTTP
// or of the kvsp records.
package container

//go:build amd64 && !purego

package kvsp

// hexBlocks writes the lowercase hex of n 16-octet blocks of src to dst
// (32n octets), with SSE2 (every amd64 has it): sixteen octets per
// iteration (4x encoding/hex on a 32-octet digest, call included).
//
//go:noescape
func hexBlocks(dst, src *byte, n int)

// appendHex appends the lowercase hex of b.
func appendHex(dst, b []byte) []byte {
	n := len(dst)
	dst = grow(dst, 2*len(b))
	out := dst[n:]
	if blocks := len(b) / 16; blocks > 0 {
		hexBlocks(&out[0], &b[0], blocks)
		b, out = b[16*blocks:], out[32*blocks:]
	}
	appendHexScalar(out, b)
	return dst
}

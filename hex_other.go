//go:build !amd64 || purego

package kvsp

// appendHex appends the lowercase hex of b.
func appendHex(dst, b []byte) []byte {
	n := len(dst)
	dst = grow(dst, 2*len(b))
	appendHexScalar(dst[n:], b)
	return dst
}

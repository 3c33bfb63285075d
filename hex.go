package kvsp

import (
	"encoding/binary"
	"slices"
)

// Ids and digests are most of what a lookup answer is made of (a record
// with 32 layer digests is 2 KiB of hex), so appendHex is fast: SSE2 on
// amd64 (hex_amd64.s), elsewhere a table of digit pairs storing eight
// digits at once (about twice encoding/hex; BenchmarkAppendHex).

// grow extends dst by n octets (contents to be written by the caller).
func grow(dst []byte, n int) []byte {
	l := len(dst)
	return slices.Grow(dst, n)[:l+n]
}

// appendHexScalar writes the lowercase hex of b to out (len 2*len(b)).
func appendHexScalar(out, b []byte) {
	for len(b) >= 4 && len(out) >= 8 {
		v := uint64(hexPairs[b[0]]) | uint64(hexPairs[b[1]])<<16 | uint64(hexPairs[b[2]])<<32 | uint64(hexPairs[b[3]])<<48
		binary.LittleEndian.PutUint64(out, v)
		b, out = b[4:], out[8:]
	}
	for i, c := range b {
		out[2*i], out[2*i+1] = hexDigits[c>>4], hexDigits[c&0xf]
	}
}

const hexDigits = "0123456789abcdef"

// hexPairs holds the two digits of each octet, first digit in the low
// byte (little-endian order, as they are stored).
var hexPairs = func() (t [256]uint16) {
	for i := range t {
		t[i] = uint16(hexDigits[i>>4]) | uint16(hexDigits[i&15])<<8
	}
	return t
}()

package kvsp

import (
	"encoding/binary"
	"slices"
)

// appendHex appends the lowercase hex of b. Ids and digests are most of
// what a lookup answer is made of (a record with 32 layer digests is 2 KiB
// of hex), so it converts four octets per step in a register (SWAR):
// twice the speed of encoding/hex (BenchmarkAppendHex).
func appendHex(dst, b []byte) []byte {
	n := len(dst)
	dst = slices.Grow(dst, 2*len(b))[:n+2*len(b)]
	out := dst[n:]
	for len(b) >= 8 && len(out) >= 16 {
		x := binary.BigEndian.Uint64(b)
		binary.BigEndian.PutUint64(out, hex4(uint32(x>>32)))
		binary.BigEndian.PutUint64(out[8:], hex4(uint32(x)))
		b, out = b[8:], out[16:]
	}
	for len(b) >= 4 && len(out) >= 8 {
		binary.BigEndian.PutUint64(out, hex4(binary.BigEndian.Uint32(b)))
		b, out = b[4:], out[8:]
	}
	for i, c := range b {
		out[2*i], out[2*i+1] = hexDigits[c>>4], hexDigits[c&0xf]
	}
	return dst
}

const hexDigits = "0123456789abcdef"

// hex4 spreads the eight nibbles of x, most significant first, into the
// eight bytes of the result and turns each into its lowercase hex digit.
func hex4(x uint32) uint64 {
	v := uint64(x)
	v = (v | v<<16) & 0x0000ffff0000ffff
	v = (v | v<<8) & 0x00ff00ff00ff00ff
	v = (v&0x00f000f000f000f0)<<4 | v&0x000f000f000f000f
	// Nibbles above 9 get 'a'-'0'-10 = 39 more than '0'+n.
	above9 := ((v + 0x0606060606060606) >> 4) & 0x0101010101010101
	return v + 0x3030303030303030 + above9*39
}

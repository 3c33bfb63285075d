package llamacpp

import (
	"encoding/binary"
	"fmt"
	"unsafe"
)

// littleEndian: the tiles' 64-bit words hold their four 16-bit elements
// lowest first only on a little-endian machine.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// transpose16 transposes a rows × cols matrix of 16-bit elements:
// dst[c*dstStride+r] = src[r*srcStride+c], strides in elements, octets
// little-endian. It moves 4 × 4 tiles through 64-bit words (four loads,
// eight mask-and-shift steps, four stores), which keeps llama.cpp's
// transposed V layout near memory speed; edges that are not multiples of
// 4 go element by element. The extents are checked once, so the tiles
// load and store through unsafe pointers without per-access checks
// (unaligned: the words hold no pointers).
func transpose16(dst []byte, dstStride int, src []byte, srcStride int, rows, cols int) {
	if rows == 0 || cols == 0 {
		return
	}
	if 2*((rows-1)*srcStride+cols) > len(src) || 2*((cols-1)*dstStride+rows) > len(dst) {
		panic(fmt.Sprintf("llamacpp: transpose of %d×%d: %d and %d octets", rows, cols, len(src), len(dst)))
	}
	r4, c4 := rows&^3, cols&^3
	if !littleEndian {
		r4, c4 = 0, 0
	}
	s, d := unsafe.Pointer(unsafe.SliceData(src)), unsafe.Pointer(unsafe.SliceData(dst))
	r8, c8 := rows&^7, cols&^7
	if r8 > 0 && c8 > 0 && tiles8(d, s, dstStride, srcStride, 0, r8, 0, c8) {
		// 8 × 8 tiles in vector registers; the rest in 4 × 4 ones
		if r4 > r8 {
			tile4x4(d, s, dstStride, srcStride, r8, r4, 0, c4)
		}
		if c4 > c8 {
			tile4x4(d, s, dstStride, srcStride, 0, r8, c8, c4)
		}
	} else {
		// In tiles of 16 × 16 elements: a tile's rows of src and of dst
		// stay in the first-level cache, whatever the strides.
		const tile = 16
		for r0 := 0; r0 < r4; r0 += tile {
			for c0 := 0; c0 < c4; c0 += tile {
				tile4x4(d, s, dstStride, srcStride, r0, min(r0+tile, r4), c0, min(c0+tile, c4))
			}
		}
	}
	for r := 0; r < rows; r++ { // the edges
		c0 := c4
		if r >= r4 {
			c0 = 0
		}
		for c := c0; c < cols; c++ {
			i, j := 2*(r*srcStride+c), 2*(c*dstStride+r)
			dst[j], dst[j+1] = src[i], src[i+1]
		}
	}
}

// tile4x4 transposes rows [r0, r1) and columns [c0, c1) of src into dst,
// 4 × 4 elements at a time (bounds checked by the caller).
func tile4x4(d, s unsafe.Pointer, dstStride, srcStride, r0, r1, c0, c1 int) {
	const lo16, hi16, lo32 = 0x0000ffff0000ffff, 0xffff0000ffff0000, 0x00000000ffffffff
	ss, ds := uintptr(2*srcStride), uintptr(2*dstStride)
	for r := r0; r < r1; r += 4 {
		for c := c0; c < c1; c += 4 {
			// Each tile's pointers from its indices: a pointer advanced past
			// the last tile would point beyond dst's allocation, which the
			// collector may find on the stack (a fatal "bad pointer").
			p := unsafe.Add(s, 2*(r*srcStride+c))
			q := unsafe.Add(d, 2*(c*dstStride+r))
			a := *(*uint64)(p)
			b := *(*uint64)(unsafe.Add(p, ss))
			x := *(*uint64)(unsafe.Add(p, 2*ss))
			y := *(*uint64)(unsafe.Add(p, 3*ss))
			t0 := a&lo16 | (b&lo16)<<16 // a0 b0 a2 b2
			t1 := (a>>16)&lo16 | b&hi16 // a1 b1 a3 b3
			t2 := x&lo16 | (y&lo16)<<16 // x0 y0 x2 y2
			t3 := (x>>16)&lo16 | y&hi16 // x1 y1 x3 y3
			*(*uint64)(q) = t0&lo32 | t2<<32
			*(*uint64)(unsafe.Add(q, ds)) = t1&lo32 | t3<<32
			*(*uint64)(unsafe.Add(q, 2*ds)) = t0>>32 | t2&^lo32
			*(*uint64)(unsafe.Add(q, 3*ds)) = t1>>32 | t3&^lo32
		}
	}
}

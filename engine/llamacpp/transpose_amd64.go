//go:build amd64 && !purego

package llamacpp

import "unsafe"

// transpose8x8 transposes tiles 8 × 8 tiles of 16-bit elements, src and
// dst advancing srcStep and dstStep octets a tile; strides in octets
// (SSE2: every amd64 has it).
//
//go:noescape
func transpose8x8(dst *byte, dstStride, dstStep uintptr, src *byte, srcStride, srcStep uintptr, tiles int)

// tiles8 transposes rows [r0, r1) × columns [c0, c1), multiples of 8, of
// src into dst with transpose8x8; it reports false when it cannot. The
// inner run goes along the side whose rows are further apart, so the
// eight rows of that side in flight are written (or read) in sequence,
// not a few octets of each of hundreds of rows that share cache sets.
func tiles8(d, s unsafe.Pointer, dstStride, srcStride, r0, r1, c0, c1 int) bool {
	ds, ss := uintptr(2*dstStride), uintptr(2*srcStride)
	if dstStride > srcStride { // along src's columns: dst's 8 rows in sequence
		for c := c0; c < c1; c += 8 {
			transpose8x8((*byte)(unsafe.Add(d, 2*(c*dstStride+r0))), ds, 16,
				(*byte)(unsafe.Add(s, 2*(r0*srcStride+c))), ss, 8*ss, (r1-r0)/8)
		}
		return true
	}
	for r := r0; r < r1; r += 8 { // along src's rows
		transpose8x8((*byte)(unsafe.Add(d, 2*(c0*dstStride+r))), ds, 8*ds,
			(*byte)(unsafe.Add(s, 2*(r*srcStride+c0))), ss, 16, (c1-c0)/8)
	}
	return true
}

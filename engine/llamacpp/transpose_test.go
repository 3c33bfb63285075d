package llamacpp

import (
	"encoding/binary"
	"fmt"
	"testing"
)

// TestTranspose16 checks the tiled transpose against the definition, for
// shapes with and without edges. The last is the shape kvsp demo's
// read-back of 4-token blocks gave (64 × 4 into a destination exactly its
// size): a tile pointer advanced past the last tile would leave the
// allocation, which -race's checkptr reports (and the collector may find).
func TestTranspose16(t *testing.T) {
	for _, sh := range [][4]int{{4, 4, 4, 4}, {16, 256, 256, 16}, {7, 9, 11, 13}, {256, 256, 1024, 256}, {256, 256, 256, 1024}, {24, 40, 40, 64}, {20, 44, 50, 60}, {1, 3, 5, 1}, {64, 4, 20, 64}} {
		rows, cols, srcStride, dstStride := sh[0], sh[1], max(sh[2], sh[1]), max(sh[3], sh[0])
		src := make([]byte, 2*rows*srcStride)
		for i := 0; i < len(src)/2; i++ {
			binary.LittleEndian.PutUint16(src[2*i:], uint16(i*7919+1))
		}
		dst := make([]byte, 2*cols*dstStride)
		transpose16(dst, dstStride, src, srcStride, rows, cols)
		for r := 0; r < rows; r++ {
			for c := 0; c < cols; c++ {
				if got, want := binary.LittleEndian.Uint16(dst[2*(c*dstStride+r):]), binary.LittleEndian.Uint16(src[2*(r*srcStride+c):]); got != want {
					t.Fatalf("%v: [%d][%d] = %d, want %d", sh, c, r, got, want)
				}
			}
		}
	}
}

func BenchmarkTranspose16(b *testing.B) {
	for _, n := range []int{256} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			src, dst := make([]byte, 2*n*n), make([]byte, 2*n*n)
			b.SetBytes(int64(len(src)))
			for i := 0; i < b.N; i++ {
				transpose16(dst, n, src, n, n, n)
			}
		})
	}
}

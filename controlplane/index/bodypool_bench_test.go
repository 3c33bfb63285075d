package index

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/valyala/bytebufferpool"
)

// BenchmarkBodyPool: the lookup answer's buffer, from the pool the IS
// uses (a sync.Pool of byte slices, buffers past maxPooledBody dropped)
// against github.com/valyala/bytebufferpool (which sizes new buffers and
// drops outliers by calibration; the same cap kept), under the IS's mix
// of answer sizes: most short (a chain's first blocks), a quarter of 64
// records with their layer digests (about 150 KiB), one in twenty past
// the cap. The encoding is an append of that many octets.
func BenchmarkBodyPool(b *testing.B) {
	sizes := make([]int, 100)
	for i := range sizes {
		switch {
		case i%20 == 19:
			sizes[i] = 2 << 20 // past maxPooledBody
		case i%4 == 0:
			sizes[i] = 150 << 10
		default:
			sizes[i] = 3 << 10
		}
	}
	chunk := make([]byte, 4<<10)
	encode := func(dst []byte, n int) []byte {
		for len(dst) < n {
			dst = append(dst, chunk[:min(len(chunk), n-len(dst))]...)
		}
		return dst
	}
	b.Run("sync.Pool", func(b *testing.B) { // the IS's pool before
		b.ReportAllocs()
		pool := sync.Pool{New: func() any { b := make([]byte, 0, 64<<10); return &b }}
		var i atomic.Int64
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				n := sizes[i.Add(1)%int64(len(sizes))]
				bp := pool.Get().(*[]byte)
				*bp = encode((*bp)[:0], n)
				if cap(*bp) <= maxPooledBody {
					pool.Put(bp)
				}
			}
		})
	})
	b.Run("bytebufferpool", func(b *testing.B) {
		b.ReportAllocs()
		var p bytebufferpool.Pool
		var i atomic.Int64
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				n := sizes[i.Add(1)%int64(len(sizes))]
				bb := p.Get()
				bb.B = encode(bb.B[:0], n)
				if cap(bb.B) <= maxPooledBody {
					p.Put(bb)
				}
			}
		})
	})
}

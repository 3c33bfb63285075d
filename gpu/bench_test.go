package gpu

import (
	"fmt"
	"testing"
	"time"
)

// The staging benchmarks: a block of 32 layers read out of device memory
// layer by layer through the Stager (copy of layer l+1 overlapping the
// consumer's handling of layer l) and written in layer by layer, against
// the plain synchronous driver copy of the same sizes in the same run
// (cuMemcpyDtoH / cuMemcpyHtoD into and from Go memory), timed apart:
// ns/op and MB/s are the staged path's, "x_driver" the ratio of its
// throughput to the driver copy's (target: at least 0.8). The staged read
// includes the consumer's copy of each layer (the least a socket write
// costs). On the nogpu stand-in both are memcpy, and the name says so.
func BenchmarkStaging(b *testing.B) {
	d := openDevice(b)
	kind := "gpu"
	if d.Info().StandIn {
		kind = "standin"
	}
	for _, layer := range []int64{256 << 10, 1 << 20, 4 << 20} {
		const layers = 32
		buf, err := d.Alloc(layer * layers)
		if err != nil {
			b.Fatal(err)
		}
		st, err := d.NewStager(layer)
		if err != nil {
			b.Fatal(err)
		}
		host := make([]byte, layer)
		regions := make([]Region, layers)
		for i := range regions {
			regions[i] = Region{int64(i) * layer, layer}
		}
		consume := func(p []byte) error { copy(host, p); return nil } // what a socket write costs at least
		b.Run(fmt.Sprintf("%s/out/layer=%dKiB", kind, layer>>10), func(b *testing.B) {
			b.SetBytes(layer * layers)
			b.ReportAllocs()
			var driver time.Duration
			for b.Loop() {
				b.StopTimer() // the bound, timed apart
				t0 := time.Now()
				for _, r := range regions {
					if err := buf.CopyOut(host, r.Off); err != nil {
						b.Fatal(err)
					}
				}
				driver += time.Since(t0)
				b.StartTimer()
				if err := st.WriteTo(buf, regions, consume); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(driver)/float64(b.Elapsed()), "x_driver")
		})
		b.Run(fmt.Sprintf("%s/in/layer=%dKiB", kind, layer>>10), func(b *testing.B) {
			b.SetBytes(layer * layers)
			b.ReportAllocs()
			var driver time.Duration
			for b.Loop() {
				b.StopTimer()
				t0 := time.Now()
				for _, r := range regions {
					if err := buf.CopyIn(r.Off, host); err != nil {
						b.Fatal(err)
					}
				}
				driver += time.Since(t0)
				b.StartTimer()
				for _, r := range regions {
					if err := st.Upload(buf, r.Off, host); err != nil {
						b.Fatal(err)
					}
				}
				if err := st.Flush(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(driver)/float64(b.Elapsed()), "x_driver")
		})
		st.Close()
		buf.Free()
	}
}

// BenchmarkGather: the paged gather of blocks (32 layers, 16 tokens of
// 8 heads x 128 bf16 rows, pages of 16 tokens in shuffled order) against
// a device-to-device copy of the same octets in the same run, timed apart:
// "x_dtod" is the gather's throughput over the copy's (target: at least
// 0.7). On the stand-in both are host loops.
func BenchmarkGather(b *testing.B) {
	d := openDevice(b)
	kind := "gpu"
	if d.Info().StandIn {
		kind = "standin"
	}
	const layers, tokens, row, pages = 32, 16, 2048, 256
	p := Paged{Layers: layers, PageTokens: tokens, RowBytes: row, PageStride: tokens * row}
	p.VOffset = pages * p.PageStride
	p.LayerStride = 2 * p.VOffset
	pool, err := d.Alloc(layers * p.LayerStride)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Free()
	n := p.SectionsLen(tokens)
	dst, err := d.Alloc(n)
	if err != nil {
		b.Fatal(err)
	}
	defer dst.Free()
	s, err := d.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	// The first gather loads the module (the PTX is compiled for the
	// device then): not part of what is timed.
	if err := d.Gather(dst, pool, p, []int32{0}, 0, tokens, s); err != nil {
		b.Fatal(err)
	}
	b.Run(kind+"/block=2MiB", func(b *testing.B) {
		b.SetBytes(n)
		b.ReportAllocs()
		var dtod time.Duration
		i := 0
		for b.Loop() {
			b.StopTimer()
			t0 := time.Now()
			if err := dst.CopyFrom(0, pool, int64(i%pages)*p.PageStride, n); err != nil {
				b.Fatal(err)
			}
			if err := d.Sync(); err != nil { // a device copy may return before it is done
				b.Fatal(err)
			}
			dtod += time.Since(t0)
			b.StartTimer()
			if err := d.Gather(dst, pool, p, []int32{int32((i * 37) % pages)}, 0, tokens, s); err != nil {
				b.Fatal(err)
			}
			i++
		}
		b.ReportMetric(float64(dtod)/float64(b.Elapsed()), "x_dtod")
	})
}

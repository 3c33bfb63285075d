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

package holder_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
	"github.com/kvsp/kvsp/tier"
)

// BenchmarkDeviceGet: GETs of 2 MiB blocks held whole on the device tier,
// over loopback mutual TLS (HTTP/2), the client verifying Repr-Digest and
// every layer digest as an instance does, with 1, 4 and 16 concurrent
// streams: the device layers leave through the pinned double-buffered
// staging. It reports MB/s and "cpu-s/GB" (this process's CPU, server and
// verifying client together, per GB served); the bound in the same run is
// SHA-256 of the block. The name says whether the device is a GPU or the
// nogpu stand-in (whose "device" memory is host memory).
func BenchmarkDeviceGet(b *testing.B) {
	dev, err := tier.OpenDevice(0)
	if err != nil {
		if os.Getenv("KVSP_REQUIRE_GPU") != "1" {
			b.Skipf("no device: %v", err)
		}
		b.Fatal(err)
	}
	kind := "gpu"
	if dev.StandIn() {
		kind = "standin"
	}
	p := kvsptest.NewPKI(b)
	data, blk := benchBlockBytes()
	h, err := holder.New(holder.Config{Base: "https://127.0.0.1/h1/", Geometries: map[kvsp.CompatID]container.Geometry{{7}: benchGeom},
		Capacity: 1 << 30, Device: dev, DeviceCapacity: 1 << 30, DeviceLayers: 32,
		LeaseQuota: holder.LeaseQuota{Octets: 1 << 30, MaxTTL: time.Minute, MaxLeases: 16}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { h.Close(context.Background()); dev.Close() })
	srv := kvsptest.StartServer(b, p, kvsptest.Options{}, func(s *server.Server) { h.Mount(s.Mount("/h1/")) })
	c, _ := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(kvsptest.ClientA))})
	b.Cleanup(c.Close)
	hc := c.Holder(srv.URL("/h1/"))
	const nblocks = 16
	var refs []client.BlockRef
	for i := range nblocks {
		ref := client.BlockRef{Compat: kvsp.CompatID{7}, Scope: mustScope(), Key: kvsp.BlockKey{byte(i), 2}}
		if err := hc.PutBlock(context.Background(), ref, bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
			b.Fatal(err)
		}
		refs = append(refs, ref)
	}
	b.Run("bound-sha256", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			sha256.Sum256(data)
		}
	})
	for _, streams := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("%s/h2/streams=%d", kind, streams), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			cpu0 := kvsptest.SelfCPU()
			getBlocks(b, hc, refs, blk, streams)
			gb := float64(b.N) * float64(len(data)) / 1e9
			b.ReportMetric((kvsptest.SelfCPU()-cpu0).Seconds()/gb, "cpu-s/GB")
		})
	}
}

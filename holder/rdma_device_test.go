//go:build nogpu

package holder_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/tier"
)

// TestRDMAFromDeviceTier: blocks on the device tier are read by RDMA too
// (GPUDirect RDMA: the NIC reads the device's memory; here the nogpu
// stand-in's, on the in-process fabric): a block split between device and
// host memory is two segments, device then host, and any layer range of
// it (device only, host only, across) arrives verified, byte for byte
// what a GET serves; the keys die with the exposure and no registration
// of device memory outlives it.
func TestRDMAFromDeviceTier(t *testing.T) {
	dev, err := tier.OpenDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	fab := rdma.NewFabric()
	hp := fab.Provider("holder")
	target := rdma.NewTarget(hp)
	t.Cleanup(func() { target.Close() })
	half := 4 * int64(geom.RawSectionLen()) // two layers' K and V
	f := start(t, 8*blockSize(), func(c *holder.Config) {
		c.RDMA = target
		c.Device, c.DeviceCapacity, c.DeviceLayers, c.DeviceReadMbitPerS = dev, 4*half, 2, 2000000
	})
	reader := rdma.NewReader(fab.Provider("instance"))
	t.Cleanup(func() { reader.Close() })
	a := f.hold[kvsptest.ClientA]
	data, blk := makeBlock(77, 0, 4)
	if err := a.PutBlock(context.Background(), ref(7), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	f.residency(t, ref(7).Key, []kvsp.Residency{{Tier: kvsp.TierDevice, Layers: kvsp.LayerRange{0, 1}, ReadMbitPerS: 2000000},
		{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{2, 3}, ReadMbitPerS: 400000}})
	_, live0 := hp.Registrations()
	for _, lr := range []*kvsp.LayerRange{nil, {0, 1}, {1, 2}, {2, 3}, {0, 0}, {3, 3}} {
		got, release, err := a.ReadBlockRDMA(context.Background(), ref(7), geom, client.GetOptions{Layers: lr, LayerDigests: blk.LayerDigests()}, reader)
		if err != nil {
			t.Fatalf("layers %v: %v", lr, err)
		}
		q := ""
		if lr != nil {
			q = fmt.Sprintf("?layers=%d-%d", lr[0], lr[1])
		}
		if st, _, body := f.raw(t, kvsptest.ClientA, "GET", path(ref(7))+q, nil, nil); st != 200 || !bytes.Equal(got.Bytes(), body) {
			t.Fatalf("layers %v: the RDMA read differs from the GET (%d)", lr, st)
		}
		release()
	}
	// The answer for the whole block: a device segment, then a host one.
	code, x := expose(t, f, kvsptest.ClientA, reader, ref(7))
	if code != 201 || len(x.More) != 1 || x.Length != uint64(half) || x.More[0].Length != uint64(half) {
		t.Fatalf("a split block's exposure: %d, %d octets then %+v", code, x.Length, x.More)
	}
	if code, _, _ := f.raw(t, kvsptest.ClientA, "DELETE", "/h1/rdma/reads/"+x.ID, nil, nil); code != 204 {
		t.Fatalf("DELETE: %d", code)
	}
	addr, _ := strconv.ParseUint(x.Addr, 16, 64)
	if err := reader.Read(context.Background(), "h1", make([]byte, x.Length), addr, x.RKey); !errors.Is(err, rdma.ErrRemoteAccess) {
		t.Fatalf("the device segment's key after DELETE: %v", err)
	}
	if _, live := hp.Registrations(); live > live0+1 || hp.Windows() != 0 {
		t.Fatalf("after the reads: %d registrations live (%d before), %d windows", live, live0, hp.Windows())
	}
}

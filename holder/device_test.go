//go:build nogpu

package holder_test

import (
	"bytes"
	"context"
	"io"
	"reflect"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/tier"
)

// residency waits for the IS record of key k to have the wanted residency.
func (f *fixture) residency(t *testing.T, k kvsp.BlockKey, want []kvsp.Residency) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	var got []kvsp.Residency
	for time.Now().Before(deadline) {
		resp, err := f.is.Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{k}})
		if err == nil && resp.Matched == 1 {
			if got = resp.Replicas[0][0].Residency; reflect.DeepEqual(got, want) {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("residency of %x: %+v, want %+v", k[:2], got, want)
}

// readAll GETs layers (nil: the whole block) with a verifying client and
// returns the layer sections received.
func readAll(t *testing.T, hc *client.Holder, r client.BlockRef, blk *container.Block, layers *kvsp.LayerRange) int {
	t.Helper()
	s, err := hc.GetBlock(context.Background(), r, geom, client.GetOptions{Layers: layers, LayerDigests: blk.LayerDigests(), ReplicaCodec: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for n := 0; ; n++ {
		if _, err := s.Next(); err == io.EOF {
			return n
		} else if err != nil {
			t.Fatalf("layers %v: %v", layers, err)
		}
	}
}

// TestDeviceTierSplitResidency (nogpu stand-in): with a device tier taking
// the first two of four layers, a block is split between device and host
// memory and its record says exactly which layers are where; every range
// (device only, spanning, host only, whole, transcoded) reads back
// verified; when the device is full the least recently used unleased
// block is demoted to host memory and republished, and a leased one is
// not.
func TestDeviceTierSplitResidency(t *testing.T) {
	dev, err := tier.OpenDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	half := 4 * int64(geom.RawSectionLen()) // two layers' K and V
	f := start(t, 8*blockSize(), func(c *holder.Config) {
		c.Device, c.DeviceCapacity, c.DeviceLayers, c.DeviceReadMbitPerS = dev, 2*half, 2, 2000000
	})
	ctx := context.Background()
	a := f.hold[kvsptest.ClientA]
	split := []kvsp.Residency{{Tier: kvsp.TierDevice, Layers: kvsp.LayerRange{0, 1}, ReadMbitPerS: 2000000},
		{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{2, 3}, ReadMbitPerS: 400000}}
	hostOnly := []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 3}, ReadMbitPerS: 400000}}

	blocks := map[byte]*container.Block{}
	datas := map[byte][]byte{}
	put := func(k byte) {
		d, b := makeBlock(uint64(k)+500, 0, 4)
		blocks[k], datas[k] = b, d
		if err := a.PutBlock(ctx, ref(k), bytes.NewReader(d), int64(len(d)), b.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
	}
	put(1)
	f.residency(t, ref(1).Key, split)
	// The device's own figures are metrics (the stand-in's: its memory).
	if used, total := gather(t, f.reg, "kvsp_holder_device_memory_used_bytes"), gather(t, f.reg, "kvsp_holder_device_memory_total_bytes"); used < float64(half) || total <= used {
		t.Fatalf("device memory metrics: used %v of %v", used, total)
	}
	for _, lr := range []*kvsp.LayerRange{nil, {0, 1}, {1, 2}, {2, 3}, {0, 0}, {3, 3}} {
		want := 4
		if lr != nil {
			want = int(lr[1]-lr[0]) + 1
		}
		if n := readAll(t, a, ref(1), blocks[1], lr); n != want {
			t.Fatalf("layers %v: %d sections", lr, n)
		}
	}
	if st, _, body := f.raw(t, kvsptest.ClientA, "GET", path(ref(1)), nil, nil); st != 200 || !bytes.Equal(body, datas[1]) {
		t.Fatalf("whole split block: %d, equal %v", st, bytes.Equal(body, datas[1]))
	}
	if st, hdr, body := f.raw(t, kvsptest.ClientA, "GET", path(ref(1))+"?codec=65281", nil, nil); st != 200 ||
		hdr.Get("Repr-Digest") != container.ReprDigest(container.Digest(sha(body))) {
		t.Fatalf("transcoded split block: %d", st)
	}

	// Block 2 fills the device; block 3 makes room by demoting the least
	// recently used: block 1 (read above, but 2 was stored after it).
	put(2)
	f.residency(t, ref(2).Key, split)
	put(3)
	f.residency(t, ref(3).Key, split)
	f.residency(t, ref(1).Key, hostOnly)
	if st, _, body := f.raw(t, kvsptest.ClientA, "GET", path(ref(1)), nil, nil); st != 200 || !bytes.Equal(body, datas[1]) {
		t.Fatal("the demoted block changed")
	}
	if gather(t, f.reg, "kvsp_holder_demotions_total") < 1 {
		t.Fatal("demotion not counted")
	}

	// A leased split block stays on the device: block 4 goes to host.
	if _, err := a.Lease(ctx, &kvsp.LeaseRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{ref(2).Key, ref(3).Key}, TTLMs: 10000}); err != nil {
		t.Fatal(err)
	}
	put(4)
	f.residency(t, ref(4).Key, hostOnly)
	f.residency(t, ref(2).Key, split)
	f.residency(t, ref(3).Key, split)
	for k := byte(1); k <= 4; k++ {
		if n := readAll(t, a, ref(k), blocks[k], nil); n != 4 {
			t.Fatalf("block %d: %d layers", k, n)
		}
	}
	if gather(t, f.reg, "kvsp_holder_device_tier") != 1 {
		t.Fatal("the device tier is not reported in metrics")
	}
}

//go:build rdma && cgo

package rdma

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/kvsp/kvsp/gpu"
)

// TestVerbs: where an RDMA device exists, a READ between two queue pairs
// of it moves the octets; where none does, OpenVerbs says so clearly
// (ibv_get_device_list fails with ENOSYS on machines without RDMA).
func TestVerbs(t *testing.T) {
	v, err := OpenVerbs("")
	if err != nil {
		if !errors.Is(err, ErrNoDevice) || !strings.Contains(err.Error(), "no RDMA") {
			t.Fatalf("OpenVerbs without a device: %v", err)
		}
		t.Skipf("no RDMA device here: %v", err)
	}
	defer v.Close()
	src := bytes.Repeat([]byte("kvsp"), 1<<18)
	dst := make([]byte, len(src))
	smr, err := v.Register(src, AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	defer smr.Close()
	dmr, err := v.Register(dst, AccessLocal)
	if err != nil {
		t.Fatal(err)
	}
	defer dmr.Close()
	a, _ := v.NewQP()
	b, _ := v.NewQP()
	defer a.Close()
	defer b.Close()
	if err := errors.Join(a.Connect(b.Endpoint()), b.Connect(a.Endpoint())); err != nil {
		t.Fatal(err)
	}
	if err := a.Read(context.Background(), dmr, 0, smr.Region()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, dst) {
		t.Fatal("READ moved other octets")
	}
	bad := smr.Region()
	bad.RKey++
	if err := a.Read(context.Background(), dmr, 0, bad); err == nil {
		t.Fatal("a READ with a wrong rkey succeeded")
	}
}

// TestVerbsWindows: where the device has type 2 memory windows, the
// holder's path works on it: memory registered for windows only is read
// through a window bound for the reading pair's peer, and no longer once
// the window is invalidated (the pair is then in the error state, as a
// NIC leaves it, and a new one reads again).
func TestVerbsWindows(t *testing.T) {
	v, err := OpenVerbs("")
	if err != nil {
		t.Skipf("no RDMA device here: %v", err)
	}
	defer v.Close()
	if !v.HasWindows() {
		t.Skipf("%s has no type 2 memory windows: holders register per read", v.Name())
	}
	// One device: the target and the reader are two of its pairs.
	target := NewTarget(v)
	defer target.Close()
	r := NewReader(v)
	defer r.Close()
	mem := bytes.Repeat([]byte("window"), 1<<17)
	buf := mem[4096 : 4096+65536]
	for round := range 2 {
		ep := connect(t, r, "h", target)
		addr, rkey, release, err := target.Expose(ep, mem, buf)
		if err != nil {
			t.Fatal(err)
		}
		dst, rel, _ := r.Buffer(len(buf))
		if err := r.Read(context.Background(), "h", dst, addr, rkey); err != nil || !bytes.Equal(dst, buf) {
			t.Fatalf("round %d: a read through the window: %v", round, err)
		}
		release()
		if err := r.Read(context.Background(), "h", dst, addr, rkey); !errors.Is(err, ErrRemoteAccess) {
			t.Fatalf("round %d: a read after the window was invalidated: %v", round, err)
		}
		rel()
	}
	if s := target.CacheStats(); s.Registrations != 1 {
		t.Fatalf("two exposures of one allocation: %+v", s)
	}
}

// TestVerbsGPUDirect: where an RDMA device and a GPU exist (or, under
// nogpu, the stand-in's host memory), a READ takes a range of device
// memory straight from the accelerator (ibv_reg_dmabuf_mr over the
// buffer's dma-buf), and the key dies with the exposure. A GPU or NIC
// without dma-buf support is reported, not failed.
func TestVerbsGPUDirect(t *testing.T) {
	v, err := OpenVerbs("")
	if err != nil {
		t.Skipf("no RDMA device here: %v", err)
	}
	defer v.Close()
	d, err := gpu.Open(0)
	if err != nil {
		t.Skipf("no GPU here: %v", err)
	}
	defer d.Close()
	buf, err := d.Alloc(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	want := bytes.Repeat([]byte("gpudirect"), (4<<20)/9+1)[:4<<20]
	if err := buf.CopyIn(0, want); err != nil {
		t.Fatal(err)
	}
	target := NewTarget(v)
	defer target.Close()
	r := NewReader(v)
	defer r.Close()
	ep := connect(t, r, "h", target)
	addr, rkey, release, err := target.ExposeDevice(ep, buf, 1<<20, 2<<20)
	if errors.Is(err, gpu.ErrNotSupported) || errors.Is(err, syscall.EOPNOTSUPP) {
		t.Skipf("%s or the GPU has no dma-buf support: %v", v.Name(), err)
	}
	if err != nil {
		t.Fatal(err)
	}
	dst, rel, _ := r.Buffer(2 << 20)
	defer rel()
	if err := r.Read(context.Background(), "h", dst, addr, rkey); err != nil || !bytes.Equal(dst, want[1<<20:3<<20]) {
		t.Fatalf("a READ of device memory: %v", err)
	}
	release()
	if err := r.Read(context.Background(), "h", dst, addr, rkey); err == nil {
		t.Fatal("a READ after the exposure ended succeeded")
	}
}

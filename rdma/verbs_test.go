//go:build rdma && cgo

package rdma

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
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

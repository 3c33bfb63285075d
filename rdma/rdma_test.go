package rdma

import (
	"bytes"
	"context"
	"errors"
	"testing"
)

func TestEndpointText(t *testing.T) {
	e := Endpoint{LID: 0x1a, QPN: 0xabcdef, PSN: 0x123456, GID: [16]byte{0xfe, 0x80, 15: 1}}
	got, err := ParseEndpoint(e.String())
	if err != nil || got != e {
		t.Fatalf("%v -> %q -> %v, %v", e, e.String(), got, err)
	}
	for _, bad := range []string{"", "v2.001a.abcdef.123456.fe800000000000000000000000000001", "v1.1a.abcdef.123456.00", "v1.001a.abcdeg.123456.fe800000000000000000000000000001"} {
		if _, err := ParseEndpoint(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// pair is two loopback providers with connected queue pairs: the reader
// (an instance) and the target (a holder).
func pair(t *testing.T) (reader, target *Loopback, rq QP) {
	f := NewFabric()
	reader, target = f.Provider("instance"), f.Provider("holder")
	rq, _ = reader.NewQP()
	tq, _ := target.NewQP()
	if err := rq.Connect(tq.Endpoint()); err != nil {
		t.Fatal(err)
	}
	if err := tq.Connect(rq.Endpoint()); err != nil {
		t.Fatal(err)
	}
	return reader, target, rq
}

// TestLoopbackRead: a one-sided read copies exactly the region asked for,
// and the checks a NIC makes are made: rkey, bounds, remote-read access,
// deregistration, the local buffer, the connection.
func TestLoopbackRead(t *testing.T) {
	reader, target, rq := pair(t)
	src := []byte("0123456789abcdefghij")
	smr, _ := target.Register(src, AccessRemoteRead)
	dst := make([]byte, 16)
	dmr, _ := reader.Register(dst, AccessLocal)
	r := smr.Region()
	ctx := context.Background()
	if err := rq.Read(ctx, dmr, 2, Region{Addr: r.Addr + 10, RKey: r.RKey, Len: 6}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[2:8], []byte("abcdef")) || dst[0] != 0 || dst[8] != 0 {
		t.Fatalf("read %q", dst)
	}
	private, _ := target.Register(make([]byte, 8), AccessLocal)
	for name, tc := range map[string]struct {
		src  Region
		dst  MR
		off  uint64
		want error
	}{
		"wrong rkey":      {Region{r.Addr, r.RKey + 1, 4}, dmr, 0, ErrRemoteAccess},
		"past the end":    {Region{r.Addr + 18, r.RKey, 4}, dmr, 0, ErrRemoteAccess},
		"before the MR":   {Region{r.Addr - 1, r.RKey, 4}, dmr, 0, ErrRemoteAccess},
		"no remote read":  {private.Region(), dmr, 0, ErrRemoteAccess},
		"local too small": {Region{r.Addr, r.RKey, 10}, dmr, 8, ErrLocalLength},
	} {
		if err := rq.Read(ctx, tc.dst, tc.off, tc.src); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", name, err, tc.want)
		}
	}
	smr.Close()
	if err := rq.Read(ctx, dmr, 0, Region{r.Addr, r.RKey, 4}); !errors.Is(err, ErrRemoteAccess) {
		t.Errorf("after deregistration: %v", err)
	}
	lone, _ := reader.NewQP()
	if err := lone.Read(ctx, dmr, 0, Region{r.Addr, r.RKey, 4}); !errors.Is(err, ErrNotConnected) {
		t.Errorf("unconnected: %v", err)
	}
}

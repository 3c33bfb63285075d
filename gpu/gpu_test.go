//go:build nogpu

package gpu

import (
	"bytes"
	"errors"
	"testing"
)

// TestStandIn: the nogpu device says it is a stand-in, bounds allocations
// by its memory, copies in and out at offsets, refuses copies outside a
// buffer, and gets its memory back on Free (once).
func TestStandIn(t *testing.T) {
	d, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if in := d.Info(); !in.StandIn || in.Name == "" || in.Memory != StandInMemory {
		t.Fatalf("info %+v", in)
	}
	if _, err := Open(1); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("ordinal 1: %v", err)
	}
	b, err := d.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	src := bytes.Repeat([]byte{1, 2, 3}, 1000)
	if err := b.CopyIn(4096, src); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, len(src))
	if err := b.CopyOut(dst, 4096); err != nil || !bytes.Equal(dst, src) {
		t.Fatalf("round trip: %v", err)
	}
	if b.CopyIn(1<<20-10, src) == nil || b.CopyOut(dst, -1) == nil {
		t.Fatal("a copy outside the buffer was accepted")
	}
	if _, err := d.Alloc(StandInMemory); !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("over the limit: %v", err)
	}
	b.Free()
	b.Free()
	if d.used != 0 {
		t.Fatalf("%d octets still counted after Free", d.used)
	}
}

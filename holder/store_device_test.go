//go:build nogpu

package holder

import (
	"bytes"
	"container/list"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/tier"
)

// TestDevicePartOutlivesDemotionWhileSent: a GET that is sending a split
// block keeps its device part and tail valid while the block is demoted
// to host memory under it; the device memory is freed when it finishes.
func TestDevicePartOutlivesDemotionWhileSent(t *testing.T) {
	d, _ := tier.OpenDevice(0)
	s := newStore(8<<20, newLeases(LeaseQuota{}), nil)
	s.dev = &deviceTier{d: d, layers: 2, capacity: 600 << 10, lru: list.New()} // two 256 KiB layers of one block
	a := bigBlock(t, s, 0xaa)
	want := bytes.Clone(a.Bytes())
	ea, _, _, err := s.put(id(1), a, bigGeom)
	if err != nil || ea.dev == nil {
		t.Fatalf("A not split: %v", err)
	}
	p, release, err := s.acquire(ea, bigGeom) // a GET starts sending A
	sp, split := p.(splitBlock)
	if err != nil || !split {
		t.Fatal(err)
	}
	_, _, demoted, err := s.put(id(2), bigBlock(t, s, 0xbb), bigGeom)
	if err != nil || len(demoted) != 1 || demoted[0] != ea || ea.dev != nil || ea.blk == nil {
		t.Fatalf("B did not demote A: %v", err)
	}
	// The GET still reads A's original parts, intact.
	blk, done, err := p.materialize()
	if err != nil || !bytes.Equal(blk.Bytes(), want) {
		t.Fatalf("parts of a block being sent were released: %v", err)
	}
	done()
	release()
	if sp.dev.Len() != 0 {
		t.Fatal("the device part was not freed when the GET finished")
	}
}

// TestPreloadReservesDeviceMemory: a PUT's device part is reserved as its
// header arrives, against what is stored and what other PUTs reserved; the
// reservation goes when the PUT is stored (then counted as used) or given
// up.
func TestPreloadReservesDeviceMemory(t *testing.T) {
	d, _ := tier.OpenDevice(0)
	s := newStore(8<<20, newLeases(LeaseQuota{}), nil)
	s.dev = &deviceTier{d: d, layers: 2, capacity: 600 << 10, lru: list.New()} // room for one block's two 256 KiB layers
	hdr := bigBlock(t, s, 0xaa).Header()
	a := s.preload(hdr)
	if a == nil || s.dev.reserved != 512<<10 {
		t.Fatalf("first preload: %v, reserved %d", a, s.dev.reserved)
	}
	if b := s.preload(hdr); b != nil {
		t.Fatal("a second PUT's device part was reserved beyond the capacity")
	}
	a.release()
	a.release()
	if s.dev.reserved != 0 {
		t.Fatalf("reserved %d after the PUT gave up", s.dev.reserved)
	}
	c := s.preload(hdr)
	if c == nil || !c.finish() {
		t.Fatal("preload after the reservation was given back")
	}
	blk := bigBlock(t, s, 0xcc)
	e, _, _, err := s.putWith(blockID{key: kvsp.BlockKey{3}}, blk, bigGeom, c)
	c.release()
	if err != nil || e.dev == nil || s.dev.reserved != 0 || s.dev.used != 512<<10 {
		t.Fatalf("stored with its preload: %v, reserved %d, used %d", err, s.dev.reserved, s.dev.used)
	}
}

package holder

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// bigGeom makes 1 MiB blocks: pooled sizes.
var bigGeom = container.Geometry{Layers: 4, BlockTokens: 64, KVHeads: 8, HeadDim: 128, Elem: container.BF16}

func bigBlock(t *testing.T, s *store, fill byte) *container.Block {
	t.Helper()
	h, _ := container.NewHeader(container.CodecRaw, 0, 4, bigGeom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	sec := bytes.Repeat([]byte{fill}, int(bigGeom.RawSectionLen()))
	for range 4 {
		w.WriteLayer(sec, sec)
	}
	w.Close()
	blk, err := container.ReadBlockInto(&buf, int64(buf.Len()), bigGeom, s.bufs.get)
	if err != nil {
		t.Fatal(err)
	}
	return blk
}

// TestRecycledMemoryWaitsForReaders: an evicted block's memory is reused
// by a later PUT only once no GET is still sending it; a GET in flight
// keeps seeing the bytes it started with.
func TestRecycledMemoryWaitsForReaders(t *testing.T) {
	s := newStore(1<<20+64<<10, newLeases(LeaseQuota{}), nil) // room for one block
	id := func(k byte) blockID { return blockID{compat: kvsp.CompatID{1}, key: kvsp.BlockKey{k}} }
	a := bigBlock(t, s, 0xaa)
	ea, _, _, err := s.put(id(1), a, bigGeom)
	if err != nil {
		t.Fatal(err)
	}
	got, release, err := s.acquire(ea, bigGeom) // a GET starts sending A
	if err != nil || got.blk != a {
		t.Fatal(err)
	}
	want := bytes.Clone(a.Bytes())
	if _, evicted, _, err := s.put(id(2), bigBlock(t, s, 0xbb), bigGeom); err != nil || len(evicted) != 1 {
		t.Fatalf("B evicts A: %v %d", err, len(evicted))
	}
	// C arrives while the GET of A is still running: A's memory is not
	// free yet (B's block memory is in use by B).
	c := bigBlock(t, s, 0xcc)
	if &c.Bytes()[0] == &want[0] || !bytes.Equal(a.Bytes(), want) {
		t.Fatal("the memory of a block being sent was reused")
	}
	release() // the GET is done: A's memory goes back to the pool
	d := bigBlock(t, s, 0xdd)
	if &d.Bytes()[:1][0] != &a.Bytes()[:1][0] {
		t.Fatal("released memory was not recycled")
	}
}

// TestUnpublishWaitsForReaders: an attached entry that leaves while a GET
// reads it hands back a channel that closes only when that GET releases it
// (the engine may reuse the page after unpublish returns); with no reader,
// nothing to wait for; new GETs no longer find it.
func TestUnpublishWaitsForReaders(t *testing.T) {
	s := newStore(1<<20, newLeases(LeaseQuota{Octets: 1, MaxTTL: time.Second, MaxLeases: 1}), nil)
	id := blockID{key: kvsp.BlockKey{1}}
	e := &entry{id: id, att: &attached{}}
	if !s.addAttached(e) || s.addAttached(e) {
		t.Fatal("addAttached: once, not twice")
	}
	p, release, err := s.acquire(e, container.Geometry{})
	if err != nil || p.att == nil {
		t.Fatalf("acquire: %+v %v", p, err)
	}
	idle := s.removeAttached(e)
	if idle == nil || s.get(id) != nil {
		t.Fatal("a read in flight: removal must wait, and the entry must be gone")
	}
	select {
	case <-idle:
		t.Fatal("closed while the GET still reads")
	default:
	}
	release()
	select {
	case <-idle:
	case <-time.After(time.Second):
		t.Fatal("not closed when the last GET finished")
	}
	e2 := &entry{id: blockID{key: kvsp.BlockKey{2}}, att: &attached{}}
	s.addAttached(e2)
	if s.removeAttached(e2) != nil {
		t.Fatal("nothing in flight: nothing to wait for")
	}
	// A GET that found the entry before it left does not get to read it.
	if _, _, err := s.acquire(e2, container.Geometry{}); !errors.Is(err, errGone) {
		t.Fatalf("acquire after removal: %v", err)
	}
}

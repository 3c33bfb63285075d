package holder

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/tier"
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
	a := bigBlock(t, s, 0xaa)
	ea, _, _, err := s.put(id(1), a, bigGeom)
	if err != nil {
		t.Fatal(err)
	}
	got, release, err := s.acquire(ea, bigGeom) // a GET starts sending A
	if err != nil || got != (hostBlock{a}) {
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
	if _, ok := p.(attachedBlock); err != nil || !ok {
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

// TestDemotionWrittenOutsideTheLock: a demotion's file (encryption, write,
// two fsyncs) is written without the store's lock: while it is stalled,
// GETs of the other blocks and of the block being demoted go on (the
// latter from its host copy, still held), and once written the block is
// served from local storage, verified, with the same octets.
func TestDemotionWrittenOutsideTheLock(t *testing.T) {
	s := fullStoreOverDisk(t, nil)
	put := make(chan error, 1)
	go func() {
		_, _, demoted, err := s.put(id(3), bigBlock(t, s, 0xa3), bigGeom)
		if err == nil && (len(demoted) != 1 || demoted[0].id != id(1)) {
			err = fmt.Errorf("demoted %d blocks, want block 1", len(demoted))
		}
		put <- err
	}()
	for failpoint.Hits("tier/disk-before-fsync") == 0 {
		runtime.Gosched()
	}
	// Block 1's file is being written, stalled before its fsync.
	got := make(chan byte, 2)
	go func() {
		for _, k := range []byte{2, 1} {
			e := s.get(id(k))
			p, release, err := s.acquire(e, bigGeom)
			hb, inHost := p.(hostBlock)
			if err != nil || !inHost {
				t.Errorf("block %d during the demotion: %v (in %T, want host memory)", k, err, p)
				got <- 0
				continue
			}
			got <- hb.blk.Bytes()[len(hb.blk.Bytes())-1]
			release()
		}
	}()
	for _, want := range []byte{0xa2, 0xa1} {
		select {
		case b := <-got:
			if b != want {
				t.Fatalf("served %#x during the demotion, want %#x", b, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a GET waited for a demotion's file to be written (the store's lock held through it)")
		}
	}
	failpoint.Disable("tier/disk-before-fsync")
	if err := <-put; err != nil {
		t.Fatal(err)
	}
	e := s.get(id(1))
	p, release, err := s.acquire(e, bigGeom)
	if db, ok := p.(diskBlock); err != nil || !ok || db.blk.Bytes()[len(db.blk.Bytes())-1] != 0xa1 {
		t.Fatalf("block 1 after its demotion: %v, in %T", err, p)
	}
	release()
	if s.demoting != 0 || s.used != 2*e.size {
		t.Fatalf("accounting after the demotion: %d demoting, %d used", s.demoting, s.used)
	}
}

// TestPUTDoesNotWaitForTheDemotionItChose: with the demotion writer
// started, a PUT that makes room by demoting another block answers
// while that block's file is still being written (stalled before its
// fsync here), and the writer reports the demotion once it is written,
// after which the block is served from local storage.
func TestPUTDoesNotWaitForTheDemotionItChose(t *testing.T) {
	reported := make(chan []*entry, 4)
	s := fullStoreOverDisk(t, func(demoted, evicted []*entry) { reported <- append(demoted, evicted...) })
	put := make(chan error, 1)
	go func() {
		_, evicted, demoted, err := s.put(id(3), bigBlock(t, s, 0xa3), bigGeom)
		if err == nil && len(demoted)+len(evicted) != 0 {
			err = fmt.Errorf("the PUT itself reported %d demotions and %d evictions", len(demoted), len(evicted))
		}
		put <- err
	}()
	select {
	case err := <-put:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the PUT waited for the file of the block it demoted")
	}
	for failpoint.Hits("tier/disk-before-fsync") == 0 {
		runtime.Gosched()
	}
	select {
	case <-reported:
		t.Fatal("a demotion reported before its file was written")
	default:
	}
	failpoint.Disable("tier/disk-before-fsync")
	select {
	case got := <-reported:
		if len(got) != 1 || got[0].id != id(1) || !got[0].onDisk {
			t.Fatalf("reported %d entries, want block 1 on disk", len(got))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the demotion was not reported")
	}
	p, release, err := s.acquire(s.get(id(1)), bigGeom)
	if db, ok := p.(diskBlock); err != nil || !ok || db.blk.Bytes()[len(db.blk.Bytes())-1] != 0xa1 {
		t.Fatalf("block 1 after its demotion: %v, in %T", err, p)
	}
	release()
}

// id is the store tests' block id k.
func id(k byte) blockID { return blockID{compat: kvsp.CompatID{1}, key: kvsp.BlockKey{k}} }

// fullStoreOverDisk is a store with room for two big blocks over a
// local-storage tier, holding blocks 1 and 2 (last octets 0xa1, 0xa2),
// with the demotion writer started when report is set, and
// tier/disk-before-fsync set to pause until the test disables it.
func fullStoreOverDisk(t *testing.T, report func(demoted, evicted []*entry)) *store {
	t.Helper()
	disk, err := tier.OpenDisk(tier.DiskConfig{Dir: t.TempDir(), Capacity: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	s := newStore(2*(1<<20+64<<10), newLeases(LeaseQuota{}), disk)
	if report != nil {
		s.startDemoter(report)
		t.Cleanup(s.close)
	}
	for k := byte(1); k <= 2; k++ {
		if _, _, _, err := s.put(id(k), bigBlock(t, s, 0xa0+k), bigGeom); err != nil {
			t.Fatal(err)
		}
	}
	failpoint.Enable("tier/disk-before-fsync", "pause")
	t.Cleanup(failpoint.Reset)
	return s
}

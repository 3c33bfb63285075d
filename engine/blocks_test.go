package engine

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/kvsp/kvsp"
)

// payload is a test block's memory: the layers written, by layer.
type payload struct {
	key    kvsp.BlockKey
	layers [][]byte
}

// rig is a Blocks of payloads that records allocs and releases.
type rig struct {
	*Blocks[*payload]
	allocs   int
	released []kvsp.BlockKey
	fail     error // alloc's error, when set
}

func newRig(layers, capacity int) *rig {
	r := &rig{}
	alloc := func(key kvsp.BlockKey) (*payload, error) {
		if r.fail != nil {
			return nil, r.fail
		}
		r.allocs++
		return &payload{key: key, layers: make([][]byte, layers)}, nil
	}
	release := func(p *payload) { r.released = append(r.released, p.key) }
	r.Blocks = NewBlocks(layers, capacity, alloc, release)
	return r
}

func bkey(i int) kvsp.BlockKey { return kvsp.BlockKey{byte(i), byte(i >> 8)} }

// put writes layer of key with the octets s.
func (r *rig) put(key kvsp.BlockKey, layer uint32, s string) error {
	return r.Write(key, layer, func(p *payload) error {
		p.layers[layer] = append(p.layers[layer][:0], s...)
		return nil
	})
}

// full writes every layer of key.
func (r *rig) full(t *testing.T, key kvsp.BlockKey) {
	t.Helper()
	for l := range r.layers {
		if err := r.put(key, uint32(l), fmt.Sprint(key[0], "/", l)); err != nil {
			t.Fatalf("write %d layer %d: %v", key[0], l, err)
		}
	}
}

// get reads layer of key.
func (r *rig) get(key kvsp.BlockKey, layer uint32) (string, error) {
	var s string
	err := r.Read(key, layer, func(p *payload) error {
		s = string(p.layers[layer])
		return nil
	})
	return s, err
}

// held is the keys held, sorted by their first octet.
func (r *rig) held() []int {
	var ks []int
	r.Each(func(k kvsp.BlockKey, _ *payload) { ks = append(ks, int(k[0])) })
	slices.Sort(ks)
	return ks
}

func wantHeld(t *testing.T, r *rig, want ...int) {
	t.Helper()
	if got := r.held(); !slices.Equal(got, want) {
		t.Fatalf("held %v, want %v", got, want)
	}
}

// At capacity, a new block evicts the least recently used resident block:
// Has and completion make a block the most recently used, Read does not;
// the evicted block's payload is released.
func TestBlocksLRUEviction(t *testing.T) {
	r := newRig(2, 3)
	for i := 1; i <= 3; i++ {
		r.full(t, bkey(i))
	}
	if !r.Has(bkey(1)) { // recency: 1, 3, 2
		t.Fatal("block 1 not resident")
	}
	r.full(t, bkey(4)) // evicts 2; recency 4, 1, 3
	wantHeld(t, r, 1, 3, 4)
	if r.Has(bkey(2)) {
		t.Fatal("evicted block 2 still resident")
	}
	if _, err := r.get(bkey(3), 0); err != nil { // no recency
		t.Fatal(err)
	}
	r.full(t, bkey(5)) // evicts 3
	wantHeld(t, r, 1, 4, 5)
	r.full(t, bkey(6)) // evicts 1
	wantHeld(t, r, 4, 5, 6)
	if want := []kvsp.BlockKey{bkey(2), bkey(3), bkey(1)}; !slices.Equal(r.released, want) {
		t.Fatalf("released %v, want %v", r.released, want)
	}
	if r.Resident() != 3 || r.Capacity() != 3 {
		t.Fatalf("resident %d of %d, want 3 of 3", r.Resident(), r.Capacity())
	}
}

// Pinned blocks are not evicted: with every resident block pinned, a new
// block is ErrKVFull and leaves nothing behind. Pin needs a resident block;
// Unpin reports whether pins remain.
func TestBlocksPins(t *testing.T) {
	r := newRig(2, 2)
	if r.Pin(bkey(1)) {
		t.Fatal("pinned a block not held")
	}
	r.full(t, bkey(1))
	r.full(t, bkey(2))
	for _, i := range []int{1, 1, 2} { // block 1 twice
		if !r.Pin(bkey(i)) {
			t.Fatalf("pin of resident block %d failed", i)
		}
	}
	allocs := r.allocs
	if err := r.put(bkey(3), 0, "x"); !errors.Is(err, ErrKVFull) {
		t.Fatalf("write with all blocks pinned: %v, want ErrKVFull", err)
	}
	wantHeld(t, r, 1, 2)
	if r.allocs != allocs || len(r.released) != 0 {
		t.Fatalf("a refused write allocated %d, released %v", r.allocs-allocs, r.released)
	}
	if r.Unpin(bkey(1)) != true { // one pin of two left
		t.Fatal("block 1 reported unpinned with a pin left")
	}
	if r.Unpin(bkey(2)) != false {
		t.Fatal("block 2 reported pinned after its one pin undone")
	}
	if r.Unpin(bkey(2)) || r.Unpin(bkey(9)) {
		t.Fatal("extra Unpin reported pinned")
	}
	r.full(t, bkey(3)) // 2 is the unpinned one, though 1 is older
	wantHeld(t, r, 1, 3)
	if r.Unpin(bkey(1)) {
		t.Fatal("block 1 still pinned")
	}
	r.full(t, bkey(4)) // now 1 goes
	wantHeld(t, r, 3, 4)
}

// A partly written block is not resident: not readable, not pinnable, not
// counted, and never evicted to make room.
func TestBlocksPartial(t *testing.T) {
	r := newRig(3, 2)
	for l := range uint32(2) {
		if err := r.put(bkey(1), l, "p"); err != nil {
			t.Fatal(err)
		}
	}
	if r.Has(bkey(1)) || r.Pin(bkey(1)) || r.Resident() != 0 {
		t.Fatal("a partly written block is resident")
	}
	if _, err := r.get(bkey(1), 0); !errors.Is(err, ErrNotResident) {
		t.Fatalf("read of a partly written block: %v, want ErrNotResident", err)
	}
	r.full(t, bkey(2))
	r.full(t, bkey(3)) // evicts 2, not the older partial 1
	wantHeld(t, r, 1, 3)
	if !r.Pin(bkey(3)) {
		t.Fatal("pin failed")
	}
	if err := r.put(bkey(4), 0, "x"); !errors.Is(err, ErrKVFull) {
		t.Fatalf("write with a partial and a pinned block: %v, want ErrKVFull", err)
	}
	if err := r.put(bkey(1), 2, "p"); err != nil { // 1 is complete now
		t.Fatal(err)
	}
	if !r.Has(bkey(1)) || r.Resident() != 2 {
		t.Fatal("block 1 not resident once whole")
	}
	if err := r.put(bkey(1), 3, "x"); err == nil {
		t.Fatal("wrote layer 3 of a 3-layer block")
	}
	if _, err := r.get(bkey(1), 3); !errors.Is(err, ErrNotResident) {
		t.Fatalf("read of layer 3 of a 3-layer block: %v, want ErrNotResident", err)
	}
}

// Drop forgets a block in any state and releases its payload; a block
// written again after is a new one.
func TestBlocksDrop(t *testing.T) {
	r := newRig(2, 0)
	r.full(t, bkey(1))
	r.full(t, bkey(2))
	r.Pin(bkey(2))
	if err := r.put(bkey(3), 0, "p"); err != nil {
		t.Fatal(err)
	}
	r.Drop(bkey(2)) // pinned
	r.Drop(bkey(3)) // partial
	r.Drop(bkey(9)) // not held
	wantHeld(t, r, 1)
	if want := []kvsp.BlockKey{bkey(2), bkey(3)}; !slices.Equal(r.released, want) {
		t.Fatalf("released %v, want %v", r.released, want)
	}
	if r.Has(bkey(2)) || r.Pin(bkey(2)) || r.Unpin(bkey(2)) || r.Resident() != 1 {
		t.Fatal("dropped block 2 still resident or pinned")
	}
	if err := r.put(bkey(3), 1, "p"); err != nil || r.Has(bkey(3)) {
		t.Fatalf("block 3 after drop: %v, resident %v (its layer 0 should be forgotten)", err, r.Has(bkey(3)))
	}
	if r.allocs != 4 {
		t.Fatalf("%d allocs, want 4", r.allocs)
	}
	r.Clear()
	wantHeld(t, r)
	if len(r.released) != 4 || r.Resident() != 0 {
		t.Fatalf("after Clear: released %v, resident %d", r.released, r.Resident())
	}
}

// Writing a layer again overwrites it and counts once; a layer whose fn
// fails is not written.
func TestBlocksRewrite(t *testing.T) {
	r := newRig(2, 0)
	for _, s := range []string{"first", "second"} {
		if err := r.put(bkey(1), 0, s); err != nil {
			t.Fatal(err)
		}
	}
	if r.Has(bkey(1)) {
		t.Fatal("layer 0 written twice made a 2-layer block whole")
	}
	errFn := errors.New("copy failed")
	if err := r.Write(bkey(1), 1, func(*payload) error { return errFn }); !errors.Is(err, errFn) {
		t.Fatalf("fn's error: %v", err)
	}
	if r.Has(bkey(1)) {
		t.Fatal("a layer whose write failed counts as written")
	}
	if err := r.put(bkey(1), 1, "one"); err != nil {
		t.Fatal(err)
	}
	if got, err := r.get(bkey(1), 0); err != nil || got != "second" {
		t.Fatalf("layer 0: %q, %v; want the second write", got, err)
	}
	if err := r.put(bkey(1), 0, "third"); err != nil || !r.Has(bkey(1)) || r.Resident() != 1 {
		t.Fatalf("rewrite of a resident block: %v, resident %d", err, r.Resident())
	}
	if got, _ := r.get(bkey(1), 0); got != "third" || r.allocs != 1 {
		t.Fatalf("layer 0: %q after %d allocs; want third after 1", got, r.allocs)
	}
}

// alloc's error is Write's, and no block is made.
func TestBlocksAllocFailure(t *testing.T) {
	r := newRig(2, 0)
	r.full(t, bkey(1))
	r.fail = fmt.Errorf("pages: %w", ErrKVFull)
	if err := r.put(bkey(2), 0, "x"); !errors.Is(err, ErrKVFull) {
		t.Fatalf("write with alloc failing: %v", err)
	}
	if err := r.put(bkey(1), 0, "y"); err != nil { // held: no alloc
		t.Fatal(err)
	}
	wantHeld(t, r, 1)
	r.fail = nil
	if err := r.put(bkey(2), 1, "x"); err != nil || r.Has(bkey(2)) {
		t.Fatalf("write after alloc failure: %v, block whole %v", err, r.Has(bkey(2)))
	}
	if err := r.put(bkey(2), 0, "x"); err != nil || !r.Has(bkey(2)) || r.allocs != 2 {
		t.Fatalf("block 2: %v, whole %v, %d allocs", err, r.Has(bkey(2)), r.allocs)
	}
}

// Claim takes the resident blocks a Has checked and no pin holds, without
// releasing them.
func TestBlocksClaim(t *testing.T) {
	r := newRig(1, 0)
	for i := 1; i <= 4; i++ {
		r.full(t, bkey(i))
	}
	r.put(bkey(5), 0, "x") // whole but not checked
	for _, i := range []int{1, 2, 3} {
		r.Has(bkey(i))
	}
	r.Pin(bkey(2))
	var got []int
	r.Claim(func(k kvsp.BlockKey, p *payload) {
		if p.key != k {
			t.Errorf("block %d with the payload of %d", k[0], p.key[0])
		}
		got = append(got, int(k[0]))
	})
	slices.Sort(got)
	if !slices.Equal(got, []int{1, 3}) || len(r.released) != 0 {
		t.Fatalf("claimed %v, released %v; want 1 and 3, none", got, r.released)
	}
	wantHeld(t, r, 2, 4, 5)
	if r.Resident() != 3 {
		t.Fatalf("resident %d, want 3", r.Resident())
	}
}

// Concurrent use (run with -race): every operation at once on a few keys;
// each read sees its own block's layer whole, and payloads made are those
// released plus those held.
func TestBlocksConcurrent(t *testing.T) {
	const layers, capacity, keys = 4, 6, 12
	var allocs, releases int // under Blocks' lock
	b := NewBlocks(layers, capacity, func(key kvsp.BlockKey) ([][]byte, error) {
		allocs++
		return make([][]byte, layers), nil
	}, func([][]byte) { releases++ })
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(g), 0))
			for range 2000 {
				i := rnd.IntN(keys)
				key, l := bkey(i), uint32(rnd.IntN(layers))
				want := fmt.Sprintf("%02d/%d", i, l)
				switch op := rnd.IntN(10); {
				case op < 4:
					err := b.Write(key, l, func(p [][]byte) error {
						p[l] = append(p[l][:0], want...)
						return nil
					})
					if err != nil && !errors.Is(err, ErrKVFull) {
						t.Error(err)
					}
				case op < 7:
					err := b.Read(key, l, func(p [][]byte) error {
						if string(p[l]) != want {
							return fmt.Errorf("block %d layer %d holds %q", i, l, p[l])
						}
						return nil
					})
					if err != nil && !errors.Is(err, ErrNotResident) {
						t.Error(err)
					}
				case op < 8:
					if b.Pin(key) {
						b.Has(key)
						b.Unpin(key)
					}
				case op < 9:
					b.Drop(key)
				default:
					if b.Resident() > capacity {
						t.Errorf("%d resident, capacity %d", b.Resident(), capacity)
					}
				}
			}
		})
	}
	wg.Wait()
	n := 0
	b.Each(func(kvsp.BlockKey, [][]byte) { n++ })
	if n > capacity || allocs != releases+n {
		t.Fatalf("%d held (capacity %d); %d allocs, %d releases", n, capacity, allocs, releases)
	}
	for i := range keys {
		if b.Unpin(bkey(i)) {
			t.Fatalf("block %d pinned after all pins undone", i)
		}
	}
}

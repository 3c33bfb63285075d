package instance

import (
	"container/heap"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// TestOffloadQueuePrefixFirst: when the offload buffer is full, an offer
// takes the place of the deepest waiting one deeper than itself (which is
// skipped), an offer deeper than all is skipped, a block waiting or
// answered lately is a duplicate, and PUTs go lowest position first (a
// block is useful to a longest-prefix lookup only after every block
// before it in its chain), the newest of a position first (wanted soonest;
// with the oldest first, the sequence check below fails).
func TestOffloadQueuePrefixFirst(t *testing.T) {
	g := container.Geometry{Layers: 2, BlockTokens: 16, KVHeads: 1, HeadDim: 16, Elem: container.BF16}
	o, err := newOffloader(g, 1) // the least: 16 blocks
	if err != nil {
		t.Fatal(err)
	}
	key := func(i int) offloadKey {
		var k kvsp.BlockKey
		k[0], k[1] = byte(i), byte(i>>8)
		return offloadKey{key: k}
	}
	queue := func(i, pos int) {
		if outcome, dropped := o.admit(key(i), pos); outcome != "" || dropped != nil {
			t.Fatalf("offer %d at %d: %q, dropped %v", i, pos, outcome, dropped)
		}
		o.seq++
		heap.Push(&o.queue, &offer{k: key(i), pos: pos, seq: o.seq})
	}
	for i := range 16 {
		queue(i, 10+i) // positions 10..25
	}
	outcome, dropped := o.admit(key(100), 3)
	if outcome != "" || dropped == nil || dropped.pos != 25 {
		t.Fatalf("a shallow offer into a full buffer: %q, dropped %+v; want the one at 25 dropped", outcome, dropped)
	}
	o.seq++
	heap.Push(&o.queue, &offer{k: key(100), pos: 3, seq: o.seq})
	if outcome, dropped := o.admit(key(101), 30); outcome != "skipped" || dropped != nil {
		t.Fatalf("an offer deeper than every waiting one: %q, %v; want skipped", outcome, dropped)
	}
	if outcome, _ := o.admit(key(5), 1); outcome != "duplicate" {
		t.Fatalf("a block waiting already: %q, want duplicate", outcome)
	}
	// Two more at position 12, the buffer full: the deepest go (24, then
	// 23), and the three at 12 are PUT newest first.
	for _, i := range []int{102, 103} {
		if outcome, dropped := o.admit(key(i), 12); outcome != "" || dropped == nil || dropped.pos != 126-i {
			t.Fatalf("offer %d: %q, dropped %+v; want the one at %d dropped", i, outcome, dropped, 126-i)
		}
		o.seq++
		heap.Push(&o.queue, &offer{k: key(i), pos: 12, seq: o.seq})
	}
	var order []int
	var at12 []uint64
	for o.queue.Len() > 0 {
		x := heap.Pop(&o.queue).(*offer)
		order = append(order, x.pos)
		if x.pos == 12 {
			at12 = append(at12, x.seq)
		}
	}
	for i := 1; i < len(order); i++ {
		if order[i] < order[i-1] {
			t.Fatalf("PUT order %v: not the lowest position first", order)
		}
	}
	if order[0] != 3 {
		t.Fatalf("first PUT at position %d, want 3", order[0])
	}
	if len(at12) != 3 || at12[0] < at12[1] || at12[1] < at12[2] {
		t.Fatalf("offers at one position PUT in the order %v (offer sequence): want the newest first", at12)
	}
	o.mu.Lock()
	o.forgetLocked(key(7), true) // answered
	o.mu.Unlock()
	if outcome, _ := o.admit(key(7), 0); outcome != "duplicate" {
		t.Fatalf("a block answered lately: %q, want duplicate", outcome)
	}
}

// TestPutLimit: offload PUTs answered at the link's round trip raise the
// limit one per limit's worth, up to maxOffloads; a PUT that waited (over
// twice the least round trip of the last putWindow) halves it, down to
// one; once the slow round trips are all the window holds, they are the
// link's, and the limit rises again.
func TestPutLimit(t *testing.T) {
	l := putLimit{limit: 1}
	ms := time.Millisecond
	n := 0
	for l.get() < maxOffloads {
		l.observe(ms)
		if n++; n > 100 {
			t.Fatalf("limit %d after %d PUTs at the link's round trip", l.get(), n)
		}
	}
	if n != 28 { // 1 + 2 + ... + 7: one per limit's worth
		t.Errorf("maxOffloads after %d PUTs, want 28", n)
	}
	for _, want := range []int{4, 2, 1, 1} {
		l.observe(5 * ms)
		if l.get() != want {
			t.Fatalf("after a PUT that waited: limit %d, want %d", l.get(), want)
		}
	}
	for range putWindow - 5 {
		l.observe(5 * ms) // the last 1 ms round trip is still in the window
	}
	if l.get() != 1 {
		t.Fatalf("limit %d with slow round trips and a fast one in the window", l.get())
	}
	l.observe(5 * ms) // now 5 ms is the least the window holds
	if l.get() != 2 {
		t.Fatalf("limit %d once the slow round trips are the link's", l.get())
	}
}

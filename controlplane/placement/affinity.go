package placement

import (
	"sync"

	"github.com/kvsp/kvsp"
)

// Residency from placement history. The IS knows a block once a holder
// has stored it, which is after the instance that computed it has copied
// it out and sent it: under load, seconds later (kvsp demo --speed 24:
// 1.9 s on average). Meanwhile the block is in that instance's engine, and
// the PC, which placed the request that computed it, knows where. A
// request with that prefix placed there prefills it from the engine's
// prefix cache, with nothing moved; placed elsewhere, it recomputes it or
// fetches it. Routers of engines with prefix caches estimate residency
// the same way, from the requests they routed (SGLang's cache-aware load
// balancer keeps an approximate tree of them).
//
// The estimate: each block of a placed prompt enters the instance's
// engine (loaded or computed), and an engine of C blocks (its status's
// kv_blocks) has evicted a block once C blocks have entered after it, as
// an LRU would. An instance that reports no kv_blocks gets no estimate.
// Counting a block as resident wrongly costs a misplacement, never a
// wrong result: the directive still names every matched block, and the
// instance loads or computes what its engine lacks.

// maxAffinityBlocks bounds the blocks remembered per instance, whatever
// its kv_blocks says (a status record is not trusted with the PC's memory).
const maxAffinityBlocks = 1 << 16

// affinity remembers, per instance, the last blocks placed on it.
type affinity struct {
	mu   sync.Mutex
	last map[kvsp.BlockKey]placedAt // the instance a block was last placed on
	inst map[string]*placedRing
}

type placedAt struct {
	ring *placedRing
	seq  uint64 // the ring's count when the block entered
}

// placedRing is the keys of an instance's last placed blocks, oldest
// overwritten first; seq counts every block placed. Epoch is the
// instance's: a restarted instance's engine holds none of them.
type placedRing struct {
	keys  []kvsp.BlockKey
	seq   uint64
	epoch uint64
}

func newAffinity() *affinity {
	return &affinity{last: map[kvsp.BlockKey]placedAt{}, inst: map[string]*placedRing{}}
}

// capacity is the blocks an instance's engine keeps, bounded.
func capacity(st *kvsp.InstanceStatus) int { return int(min(st.KVBlocks, maxAffinityBlocks)) }

// resident is how many of keys' leading blocks are estimated to be in the
// engine of the instance st reports.
func (a *affinity) resident(st *kvsp.InstanceStatus, keys []kvsp.BlockKey) int {
	c := uint64(capacity(st))
	if c == 0 || len(keys) == 0 {
		return 0
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.inst[st.Instance]
	if r == nil || r.epoch != st.Epoch || uint64(len(r.keys)) != c { // restarted or resized: nothing known
		return 0
	}
	n := 0
	for _, k := range keys {
		if p, ok := a.last[k]; !ok || p.ring != r { // never placed there, or overwritten, or placed elsewhere since
			break
		}
		n++
	}
	return n
}

// placed records that keys entered the engine of the instance st reports.
func (a *affinity) placed(st *kvsp.InstanceStatus, keys []kvsp.BlockKey) {
	c := capacity(st)
	if c == 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.inst[st.Instance]
	if r == nil || len(r.keys) != c || r.epoch != st.Epoch { // new, restarted or resized: start again
		if r != nil {
			a.forget(r)
		}
		r = &placedRing{keys: make([]kvsp.BlockKey, c), epoch: st.Epoch}
		a.inst[st.Instance] = r
	}
	for _, k := range keys {
		slot := &r.keys[r.seq%uint64(c)]
		if r.seq >= uint64(c) { // overwriting the oldest: forgotten unless placed again since
			if p, ok := a.last[*slot]; ok && p.ring == r && p.seq == r.seq-uint64(c) {
				delete(a.last, *slot)
			}
		}
		*slot = k
		a.last[k] = placedAt{ring: r, seq: r.seq}
		r.seq++
	}
}

func (a *affinity) forget(r *placedRing) {
	for _, k := range r.keys {
		if p, ok := a.last[k]; ok && p.ring == r {
			delete(a.last, k)
		}
	}
}

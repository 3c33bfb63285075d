package holder

import (
	"container/list"
	"fmt"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// blockID names a block resource: blocks/{compat}/{scope}/{block_key}.
type blockID struct {
	compat kvsp.CompatID
	scope  kvsp.ScopeID
	key    kvsp.BlockKey
}

// entry is a stored block.
type entry struct {
	id   blockID
	blk  *container.Block
	size int64
	elem *list.Element

	mu        sync.Mutex
	published time.Time // expiry of the record at the IS; zero: not published
	ranges    map[[2]uint32]container.Digest
}

// rangeDigest returns the Repr-Digest of a layer range view, computed once.
func (e *entry) rangeDigest(v container.View) container.Digest {
	if v.IsFull() {
		return v.Digest()
	}
	k := [2]uint32{v.FirstLayer(), v.FirstLayer() + uint32(v.LayerCount()) - 1}
	e.mu.Lock()
	d, ok := e.ranges[k]
	e.mu.Unlock()
	if ok {
		return d
	}
	d = v.Digest()
	e.mu.Lock()
	if e.ranges == nil {
		e.ranges = map[[2]uint32]container.Digest{}
	}
	if len(e.ranges) < 64 {
		e.ranges[k] = d
	}
	e.mu.Unlock()
	return d
}

// store is the host tier: blocks in Go memory, with a capacity in octets
// and LRU eviction of unleased blocks.
type store struct {
	mu       sync.Mutex
	m        map[blockID]*entry
	lru      *list.List // front: most recently used
	used     int64
	capacity int64
	leases   *leases
}

func newStore(capacity int64, l *leases) *store {
	return &store{m: map[blockID]*entry{}, lru: list.New(), capacity: capacity, leases: l}
}

// get returns a stored block and marks it used.
func (s *store) get(id blockID) *entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.m[id]
	if e != nil {
		s.lru.MoveToFront(e.elem)
	}
	return e
}

// peek returns a stored block without marking it used.
func (s *store) peek(id blockID) *entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[id]
}

func (s *store) has(id blockID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[id] != nil
}

// errExists: a replica for the key is held; the stored copy is kept
// (R-BLK-14).
var errExists = fmt.Errorf("%w: the holder already has a replica for this key (If-None-Match: *)", kvsp.ErrPreconditionFailed)

// put stores a verified block, evicting least recently used unleased
// blocks to make room; it returns the evicted entries, whose records the
// caller withdraws.
func (s *store) put(id blockID, blk *container.Block) (*entry, []*entry, error) {
	size := int64(len(blk.Bytes()))
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m[id] != nil {
		return nil, nil, errExists
	}
	if size > s.capacity {
		return nil, nil, fmt.Errorf("%w: block larger than the tier", kvsp.ErrTooLarge)
	}
	var evicted []*entry
	for el := s.lru.Back(); s.used+size > s.capacity && el != nil; {
		victim := el.Value.(*entry)
		el = el.Prev()
		if s.leases.pinned(victim.id) {
			continue // never under an unexpired lease (R-IS-8, R-LS-4)
		}
		s.removeLocked(victim)
		evicted = append(evicted, victim)
	}
	if s.used+size > s.capacity {
		return nil, evicted, fmt.Errorf("%w: the tier is full of leased blocks", kvsp.ErrUnavailable)
	}
	e := &entry{id: id, blk: blk, size: size}
	e.elem = s.lru.PushFront(e)
	s.m[id] = e
	s.used += size
	return e, evicted, nil
}

func (s *store) removeLocked(e *entry) {
	delete(s.m, e.id)
	s.lru.Remove(e.elem)
	s.used -= e.size
}

// all returns the stored entries (for refresh and shutdown).
func (s *store) all() []*entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*entry, 0, len(s.m))
	for _, e := range s.m {
		out = append(out, e)
	}
	return out
}

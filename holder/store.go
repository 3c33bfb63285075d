package holder

import (
	"container/list"
	"fmt"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder/tier"
)

// blockID names a block resource: blocks/{compat}/{scope}/{block_key}.
type blockID struct {
	compat kvsp.CompatID
	scope  kvsp.ScopeID
	key    kvsp.BlockKey
}

// entry is a stored block: its metadata always, its octets in host memory
// (blk) or only in the local-storage tier (onDisk, blk nil).
type entry struct {
	id      blockID
	hdr     container.Header
	layers  []container.Digest
	replica container.Digest
	payload uint64
	size    int64 // octets in host memory when resident there
	elem    *list.Element

	blk    *container.Block // nil when only on disk
	onDisk bool
	refs   int    // GETs using blk (under store.mu)
	orphan []byte // blk's memory once evicted, until refs drops to 0

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

// store is the host tier (blocks in Go memory, with a capacity in octets)
// over an optional local-storage tier: the least recently used unleased
// blocks are demoted to disk when host memory is full, and dropped when
// disk is full too (or there is none).
type store struct {
	mu       sync.Mutex
	m        map[blockID]*entry
	lru      *list.List // host-resident entries; front: most recently used
	used     int64
	capacity int64
	leases   *leases
	disk     *tier.Disk
	bufs     *bufferPool
}

func newStore(capacity int64, l *leases, disk *tier.Disk) *store {
	return &store{m: map[blockID]*entry{}, lru: list.New(), capacity: capacity, leases: l, disk: disk,
		bufs: newBufferPool(min(max(capacity/8, 8<<20), 256<<20))}
}

// bufferPool recycles the memory of evicted blocks for the next PUTs, by
// size class: a fresh 2 MiB allocation costs about as much as hashing it
// (page faults, zeroing, then the collector), and blocks of one geometry
// are all one size. The free memory it keeps is bounded.
type bufferPool struct {
	mu      sync.Mutex
	free    map[int][][]byte
	held    int64 // octets in free
	maxHeld int64
}

// bufferClass is the size-class granularity: blocks whose sizes differ by
// less (header lengths, short layer ranges) share a class. Blocks smaller
// than minPooled are allocated exactly (no rounding waste; the page-fault
// cost that pooling saves is a large block's).
const (
	bufferClass = 64 << 10
	minPooled   = 256 << 10
)

func newBufferPool(maxHeld int64) *bufferPool {
	return &bufferPool{free: map[int][][]byte{}, maxHeld: maxHeld}
}

func (p *bufferPool) get(n int) []byte {
	if n < minPooled {
		return make([]byte, n)
	}
	c := (n + bufferClass - 1) / bufferClass * bufferClass
	p.mu.Lock()
	if l := p.free[c]; len(l) > 0 {
		b := l[len(l)-1]
		l[len(l)-1] = nil
		p.free[c] = l[:len(l)-1]
		p.held -= int64(c)
		p.mu.Unlock()
		return b[:n]
	}
	p.mu.Unlock()
	return make([]byte, n, c)
}

func (p *bufferPool) put(b []byte) {
	c := cap(b)
	if c < minPooled || c%bufferClass != 0 {
		return // small, or not ours (a block read back from disk): the collector's
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.held+int64(c) > p.maxHeld {
		return
	}
	p.free[c] = append(p.free[c], b[:0])
	p.held += int64(c)
}

// releaseBlockLocked gives up e's host copy: its memory goes back to the
// pool now, or when the last GET using it finishes.
func (s *store) releaseBlockLocked(e *entry) {
	if e.blk == nil {
		return
	}
	buf := e.blk.Bytes()
	e.blk = nil
	if e.refs > 0 {
		e.orphan = buf
		return
	}
	s.bufs.put(buf)
}

func newEntry(id blockID, blk *container.Block) *entry {
	return &entry{id: id, hdr: *blk.Header(), layers: blk.LayerDigests(), replica: blk.ReplicaDigest(),
		payload: blk.PayloadSize(), size: int64(cap(blk.Bytes())), blk: blk} // the memory it holds
}

func (id blockID) name() tier.Name { return tier.Name{Compat: id.compat, Scope: id.scope, Key: id.key} }

// get returns a stored block and marks it used.
func (s *store) get(id blockID) *entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.m[id]
	if e != nil && e.elem != nil {
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

// put stores a verified block in host memory, demoting or evicting least
// recently used unleased blocks to make room. It returns the entries whose
// records changed: evicted ones (to withdraw) and demoted ones (to
// republish with their new residency).
func (s *store) put(id blockID, blk *container.Block) (*entry, []*entry, []*entry, error) {
	e := newEntry(id, blk)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m[id] != nil {
		return nil, nil, nil, errExists
	}
	if e.size > s.capacity {
		return nil, nil, nil, fmt.Errorf("%w: block larger than the host tier", kvsp.ErrTooLarge)
	}
	var evicted, demoted []*entry
	for el := s.lru.Back(); s.used+e.size > s.capacity && el != nil; {
		victim := el.Value.(*entry)
		el = el.Prev()
		if s.leases.pinned(victim.id) {
			continue // never under an unexpired lease (R-IS-8, R-LS-4)
		}
		if s.disk != nil && s.disk.Put(victim.id.name(), victim.blk) == nil {
			s.lru.Remove(victim.elem)
			s.releaseBlockLocked(victim)
			victim.elem, victim.onDisk = nil, true
			s.used -= victim.size
			demoted = append(demoted, victim)
			continue
		}
		s.removeLocked(victim)
		evicted = append(evicted, victim)
	}
	if s.used+e.size > s.capacity {
		return nil, evicted, demoted, fmt.Errorf("%w: the host tier is full of leased blocks", kvsp.ErrUnavailable)
	}
	e.elem = s.lru.PushFront(e)
	s.m[id] = e
	s.used += e.size
	return e, evicted, demoted, nil
}

// addDisk registers a block found on disk at start.
func (s *store) addDisk(e *entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e.blk, e.onDisk = nil, true
	s.m[e.id] = e
}

// drop removes an entry (a corrupt block) from both tiers.
func (s *store) drop(e *entry) {
	s.mu.Lock()
	if s.m[e.id] == e {
		s.removeLocked(e)
	}
	s.mu.Unlock()
	if s.disk != nil {
		s.disk.Delete(e.id.name())
	}
}

func (s *store) removeLocked(e *entry) {
	delete(s.m, e.id)
	if e.elem != nil {
		s.lru.Remove(e.elem)
		s.used -= e.size
		e.elem = nil
	}
	s.releaseBlockLocked(e)
	if e.onDisk && s.disk != nil {
		s.disk.Delete(e.id.name())
	}
}

// acquire returns the entry's octets: from host memory, or read back from
// disk and verified (tier.ErrCorrupt when that fails). The caller calls
// release when done with them: until then an eviction does not recycle
// their memory.
func (s *store) acquire(e *entry, g container.Geometry) (blk *container.Block, release func(), err error) {
	s.mu.Lock()
	blk = e.blk
	if blk != nil {
		e.refs++
	}
	s.mu.Unlock()
	if blk != nil {
		return blk, func() { s.unref(e) }, nil
	}
	blk, err = s.disk.Get(e.id.name(), g)
	return blk, func() {}, err
}

func (s *store) unref(e *entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e.refs--
	if e.refs == 0 && e.orphan != nil {
		s.bufs.put(e.orphan)
		e.orphan = nil
	}
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

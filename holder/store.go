package holder

import (
	"container/list"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/tier"
)

// blockID names a block resource: blocks/{compat}/{scope}/{block_key}.
type blockID struct {
	compat kvsp.CompatID
	scope  kvsp.ScopeID
	key    kvsp.BlockKey
}

// entry is a stored block: its metadata always; its octets in one of
//
//   - host memory: blk, the whole container;
//   - split: the first devLayers layers in device memory (dev, their
//     octets back to back, no header) and the rest in host memory (tail);
//   - the local-storage tier only (onDisk, blk and dev nil).
type entry struct {
	id      blockID
	hdr     container.Header
	layers  []container.Digest
	whole   container.Digest // the container digest (Repr-Digest of the whole)
	replica container.Digest
	payload uint64
	octets  int64 // the container's size
	size    int64 // host memory held (blk's or tail's)
	g       container.Geometry
	elem    *list.Element

	blk       *container.Block // nil when split or only on disk
	onDisk    bool
	demoting  bool      // its file is being written (out of the host tier's LRU and count)
	refs      int       // GETs using blk, or dev and tail (under store.mu)
	readers   []*reader // the GETs among them, charged if it is orphaned
	orphan    []byte    // host memory given up while refs > 0
	devOrphan tier.DeviceBuffer

	dev       tier.DeviceBuffer
	devLayers int
	tail      []byte
	devElem   *list.Element

	att  *attached     // served from an attached engine's pages
	idle chan struct{} // closed when refs reach 0 after an attached entry left

	mu        sync.Mutex
	published time.Time // expiry of the record at the IS; zero: not published
	ranges    map[[2]uint32]container.Digest
}

// rangeDigest returns the Repr-Digest of layers first..last, computed
// once (by compute) per range; the whole block's is stored.
func (e *entry) rangeDigest(first, last uint32, compute func() (container.Digest, error)) (container.Digest, error) {
	if first == e.hdr.FirstLayer && last == e.hdr.LastLayer() {
		return e.whole, nil
	}
	k := [2]uint32{first, last}
	e.mu.Lock()
	d, ok := e.ranges[k]
	e.mu.Unlock()
	if ok {
		return d, nil
	}
	d, err := compute()
	if err != nil { // a device read failed: nothing is cached
		return d, err
	}
	e.mu.Lock()
	if e.ranges == nil {
		e.ranges = map[[2]uint32]container.Digest{}
	}
	if len(e.ranges) < 64 {
		e.ranges[k] = d
	}
	e.mu.Unlock()
	return d, nil
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
	dev      *deviceTier // nil: no device tier
	// orphaned is the host memory of entries released while GETs still
	// send them (their orphans): held beyond capacity until they end.
	orphaned int64
	// Demotions to local storage are chosen under mu and written
	// outside it (encryption, file, two fsyncs: about a millisecond that
	// would stall every GET and PUT): toDisk are those chosen and not
	// yet taken by a writer, demoting the host memory they still hold
	// beyond capacity, at most demoteMax (past it, a demotion is written
	// under the lock, as it always was).
	toDisk    []demotion
	demoting  int64
	demoteMax int64
	// The demotion writer, once started (startDemoter): a PUT that chose
	// demotions wakes it and returns (the files are not its work: a PUT
	// waiting on another block's fsync held back every instance's
	// offload), and it reports what it wrote to demoted. Without one (the
	// store's own tests), each PUT writes the demotions it chose.
	demoteWake chan struct{}
	demoteStop chan struct{}
	demoteDone chan struct{}
}

// demotion is a block on its way to local storage: its entry and its
// host copy (held by a reference until the file is written).
type demotion struct {
	e   *entry
	blk *container.Block
}

// deviceTier is the accelerator memory tier: the first layers of blocks,
// least recently used first out (demoted to host memory).
type deviceTier struct {
	d        *tier.Device
	layers   int // leading layers per block placed in device memory
	capacity int64
	used     int64
	reserved int64 // for the first layers of PUTs being received (preload)
	lru      *list.List
}

func newStore(capacity int64, l *leases, disk *tier.Disk) *store {
	return &store{m: map[blockID]*entry{}, lru: list.New(), capacity: capacity, leases: l, disk: disk,
		bufs: newBufferPool(min(max(capacity/8, 8<<20), 256<<20)), demoteMax: min(max(capacity/8, 8<<20), 256<<20)}
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
	var buf []byte
	switch {
	case e.blk != nil:
		buf = e.blk.Bytes()
		e.blk = nil
	case e.dev != nil:
		buf = e.tail
		if s.dev != nil && e.devElem != nil {
			s.dev.lru.Remove(e.devElem)
			s.dev.used -= e.dev.Len()
			e.devElem = nil
		}
		if e.refs > 0 {
			e.devOrphan = e.dev
		} else {
			e.dev.Free()
		}
		e.dev, e.tail, e.devLayers = nil, nil, 0
	default:
		return
	}
	if e.refs > 0 {
		// Held beyond capacity by the GETs sending it, each charged to
		// its client's read allowance (reads.go).
		e.orphan = buf
		s.orphaned += int64(cap(buf))
		for _, rd := range e.readers {
			rd.evicted(int64(cap(buf)))
		}
		return
	}
	s.bufs.put(buf)
}

func newEntry(id blockID, blk *container.Block, g container.Geometry) *entry {
	return &entry{id: id, g: g, hdr: *blk.Header(), layers: blk.LayerDigests(), whole: blk.ContainerDigest(), replica: blk.ReplicaDigest(),
		payload: blk.PayloadSize(), octets: int64(len(blk.Bytes())), size: int64(cap(blk.Bytes())), blk: blk}
}

// layerOffset returns the offset of layer index i (0 = the block's first
// layer) in the container's data, counted from the first layer's start.
func (e *entry) layerOffset(i int) int64 {
	var off int64
	for _, l := range e.hdr.Layers[:i] {
		off += int64(l.K + l.V)
	}
	return off
}

func (id blockID) name() tier.Name { return tier.Name{Compat: id.compat, Scope: id.scope, Key: id.key} }

// get returns a stored block and marks it used.
func (s *store) get(id blockID) *entry {
	failpoint.Eval("holder/store-probe") // RELIABILITY S9: counts storage probes (armed with sleep(0s))
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
	failpoint.Eval("holder/store-probe") // RELIABILITY S9: counts storage probes (armed with sleep(0s))
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[id] != nil
}

// errExists: a replica for the key is held; the stored copy is kept
// (R-BLK-14).
var errExists = fmt.Errorf("%w: the holder already has a replica for this key (If-None-Match: *)", kvsp.ErrPreconditionFailed)

// put stores a verified block: its first layers in device memory when
// there is a device tier with room (split residency), otherwise all of it
// in host memory, demoting or evicting least recently used unleased blocks
// to make room. It returns the entries whose records changed: evicted ones
// (to withdraw) and demoted ones (to republish with their new residency).
func (s *store) put(id blockID, blk *container.Block, g container.Geometry) (*entry, []*entry, []*entry, error) {
	return s.putWith(id, blk, g, nil)
}

// preload is the device part of a block being received: device memory for
// its first layers, filled layer by layer as they arrive (before the block
// is verified: nothing is visible until put).
type preload struct {
	s       *store
	settled bool // the reservation was given back, or became the entry's
	buf     tier.DeviceBuffer
	up      *tier.Uploader
	layers  int
	offs    []int64 // device offset of each of the first layers
	bytes   int64
	used    bool // the store took buf
}

// preload reserves device memory for the first layers of a block whose
// header arrived (counted against the device tier's capacity with what is
// stored and what other PUTs reserved), or returns nil (no room, no device
// memory): the block is then placed as before, by a copy when it is
// stored.
func (s *store) preload(h *container.Header) *preload {
	t := s.dev
	d := min(t.layers, len(h.Layers))
	if d == 0 {
		return nil
	}
	p := &preload{s: s, layers: d, offs: make([]int64, d)}
	for i, l := range h.Layers[:d] {
		p.offs[i] = p.bytes
		p.bytes += int64(l.K + l.V)
	}
	s.mu.Lock()
	if t.used+t.reserved+p.bytes > t.capacity {
		s.mu.Unlock()
		return nil
	}
	t.reserved += p.bytes
	s.mu.Unlock()
	buf, err := t.d.Alloc(p.bytes)
	if err != nil {
		p.unreserve()
		return nil
	}
	up, err := t.d.Uploader()
	if err != nil {
		buf.Free()
		p.unreserve()
		return nil
	}
	p.buf, p.up = buf, up
	return p
}

// unreserve gives back the reservation (once).
func (p *preload) unreserve() {
	p.s.mu.Lock()
	p.unreserveLocked()
	p.s.mu.Unlock()
}

func (p *preload) unreserveLocked() {
	if !p.settled {
		p.s.dev.reserved -= p.bytes
		p.settled = true
	}
}

// layer queues the copy of layer i's octets (from the reading goroutine's
// hasher, in order).
func (p *preload) layer(i int, octets []byte) {
	if i < p.layers {
		p.up.Write(p.buf, p.offs[i], octets)
	}
}

// finish waits for the copies; false when one failed (the preload is
// freed then).
func (p *preload) finish() bool {
	if p.up.Close() != nil {
		p.buf.Free()
		p.unreserve()
		return false
	}
	return true
}

// release frees the device memory unless the store took it.
func (p *preload) release() {
	if !p.used {
		p.buf.Free()
	}
	p.unreserve()
}

// putWith is put with the block's device part already copied (pre, when
// it matches the device tier's split; nil: copied now).
func (s *store) putWith(id blockID, blk *container.Block, g container.Geometry, pre *preload) (*entry, []*entry, []*entry, error) {
	e, evicted, demoted, err := s.putLocked(id, blk, g, pre)
	if s.demoteWake == nil || s.backlogged() {
		dm, ev := s.writeDemotions() // no writer, or one behind: this PUT writes too
		return e, append(evicted, ev...), append(demoted, dm...), err
	}
	select {
	case s.demoteWake <- struct{}{}:
	default:
	}
	return e, evicted, demoted, err
}

// backlogged reports whether the demotions waiting for the writer hold
// half of what may be held beyond capacity: PUTs then write them too
// (before the limit, past which one is written under the lock).
func (s *store) backlogged() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.demoting > s.demoteMax/2
}

// demotionsWaiting reports whether demotions are chosen and not yet
// taken by a writer.
func (s *store) demotionsWaiting() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.toDisk) > 0
}

// startDemoter starts the demotion writer; report is given each batch
// written (the entries now on local storage, and those evicted instead),
// from the writer's goroutine. close stops it after a last batch.
func (s *store) startDemoter(report func(demoted, evicted []*entry)) {
	if s.disk == nil {
		return
	}
	s.demoteWake, s.demoteStop, s.demoteDone = make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(s.demoteDone)
		for {
			stopping := false
			select {
			case <-s.demoteWake:
			case <-s.demoteStop:
				stopping = true
			}
			for s.demotionsWaiting() {
				if dm, ev := s.writeDemotions(); len(dm)+len(ev) > 0 {
					report(dm, ev)
				}
			}
			if stopping {
				return
			}
		}
	}()
}

// writeDemotions writes the demotions chosen so far, outside the lock,
// and returns the entries now on disk and those evicted instead (their
// file could not be written). A block removed meanwhile has its file
// removed too.
func (s *store) writeDemotions() (demoted, evicted []*entry) {
	s.mu.Lock()
	todo := s.toDisk
	s.toDisk = nil
	s.mu.Unlock()
	if len(todo) == 0 {
		return nil, nil
	}
	items := make([]tier.Item, len(todo))
	for i, d := range todo {
		items[i] = tier.Item{Name: d.e.id.name(), Block: d.blk}
	}
	errs := s.disk.PutAll(items) // one flush for the batch
	for i, d := range todo {
		err := errs[i]
		s.mu.Lock()
		v := d.e
		v.demoting = false
		s.demoting -= v.size
		switch {
		case s.m[v.id] != v: // removed while its file was written
			if cur := s.m[v.id]; err == nil && (cur == nil || !cur.onDisk && !cur.demoting) {
				s.disk.Delete(v.id.name())
			}
		case err != nil:
			s.removeLocked(v)
			evicted = append(evicted, v)
		default:
			s.releaseBlockLocked(v) // orphaned: this writer's reference holds it
			v.onDisk = true
			demoted = append(demoted, v)
		}
		s.mu.Unlock()
		s.unref(v, nil)
	}
	return demoted, evicted
}

func (s *store) putLocked(id blockID, blk *container.Block, g container.Geometry, pre *preload) (*entry, []*entry, []*entry, error) {
	e := newEntry(id, blk, g)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m[id] != nil {
		return nil, nil, nil, errExists
	}
	if e.size > s.capacity {
		return nil, nil, nil, fmt.Errorf("%w: block larger than the host tier", kvsp.ErrTooLarge)
	}
	var evicted, demoted []*entry
	if pre != nil {
		pre.unreserveLocked() // placed now (counted in used), or not at all
	}
	if s.dev != nil {
		ev, dm, placed := s.placeOnDeviceLocked(e, pre)
		evicted, demoted = append(evicted, ev...), append(demoted, dm...)
		if placed {
			s.m[id] = e
			return e, evicted, demoted, nil
		}
	}
	ev, dm := s.makeHostRoomLocked(e.size)
	evicted, demoted = append(evicted, ev...), append(demoted, dm...)
	if s.used+e.size > s.capacity {
		return nil, evicted, demoted, fmt.Errorf("%w: the host tier is full of leased blocks", kvsp.ErrUnavailable)
	}
	e.elem = s.lru.PushFront(e)
	s.m[id] = e
	s.used += e.size
	return e, evicted, demoted, nil
}

// makeHostRoomLocked demotes (to local storage) or evicts least recently
// used unleased host blocks until n more octets fit, or none is left.
func (s *store) makeHostRoomLocked(n int64) (evicted, demoted []*entry) {
	for el := s.lru.Back(); s.used+n > s.capacity && el != nil; {
		victim := el.Value.(*entry)
		el = el.Prev()
		if s.leases.pinned(victim.id) {
			continue // never under an unexpired lease (R-IS-8, R-LS-4)
		}
		if s.disk != nil && victim.blk != nil && s.demoting+victim.size <= s.demoteMax {
			s.lru.Remove(victim.elem)
			victim.elem, victim.demoting = nil, true
			victim.refs++ // the writer's: the memory is not reused before the file is written
			s.used -= victim.size
			s.demoting += victim.size
			s.toDisk = append(s.toDisk, demotion{victim, victim.blk})
			continue
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
	return evicted, demoted
}

// placeOnDeviceLocked moves e's first layers to device memory and the rest
// to a right-sized host buffer (e.blk's memory goes back to the pool),
// demoting least recently used unleased device blocks to host memory to
// make room. It reports false, changing nothing in e, when they do not fit.
func (s *store) placeOnDeviceLocked(e *entry, pre *preload) (evicted, demoted []*entry, placed bool) {
	d := min(s.dev.layers, len(e.hdr.Layers))
	devBytes := e.layerOffset(d)
	tailBytes := int64(e.payload) - devBytes
	if devBytes == 0 || devBytes > s.dev.capacity {
		return nil, nil, false
	}
	for el := s.dev.lru.Back(); s.dev.used+devBytes > s.dev.capacity && el != nil; {
		victim := el.Value.(*entry)
		el = el.Prev()
		if s.leases.pinned(victim.id) {
			continue
		}
		ev, ok := s.demoteFromDeviceLocked(victim)
		evicted = append(evicted, ev...)
		if ok {
			demoted = append(demoted, victim)
		}
	}
	if s.dev.used+devBytes > s.dev.capacity {
		return evicted, demoted, false
	}
	ev, dm := s.makeHostRoomLocked(tailBytes)
	evicted, demoted = append(evicted, ev...), append(demoted, dm...)
	if s.used+tailBytes > s.capacity {
		return evicted, demoted, false
	}
	data := e.blk.Bytes()
	start := int64(e.hdr.Len())
	var buf tier.DeviceBuffer
	if pre != nil && pre.layers == d && pre.bytes == devBytes { // copied while it arrived
		buf, pre.used = pre.buf, true
	} else {
		var err error
		if buf, err = s.dev.d.Alloc(devBytes); err != nil {
			return evicted, demoted, false
		}
		if err := buf.CopyIn(0, data[start:start+devBytes]); err != nil {
			buf.Free()
			return evicted, demoted, false
		}
	}
	tail := s.bufs.get(int(tailBytes))
	copy(tail, data[start+devBytes:])
	s.bufs.put(data)
	e.blk, e.dev, e.devLayers, e.tail, e.size = nil, buf, d, tail, int64(cap(tail))
	e.devElem = s.dev.lru.PushFront(e)
	s.dev.used += devBytes
	s.used += e.size // tails are host memory, not in the host LRU: they leave with their device part
	return evicted, demoted, true
}

// demoteFromDeviceLocked reassembles a split block into host memory (the
// whole container), freeing its device part; it reports false when host
// memory has no room for it (the block stays where it is).
func (s *store) demoteFromDeviceLocked(e *entry) (evicted []*entry, ok bool) {
	need := e.octets - e.size // the tail is already counted
	ev, dm := s.makeHostRoomLocked(need)
	evicted = append(ev, dm...) // demoted host blocks change records too
	if s.used+need > s.capacity {
		return evicted, false
	}
	blk, err := s.assemble(e)
	if err != nil {
		return evicted, false
	}
	s.releaseBlockLocked(e) // the device part and the tail
	s.used -= e.size
	e.blk, e.size = blk, int64(cap(blk.Bytes()))
	e.elem = s.lru.PushFront(e)
	s.used += e.size
	return evicted, true
}

// assemble returns a split block's whole container in a pooled host
// buffer (its residence's materialize, without the release: the caller
// keeps the buffer).
func (s *store) assemble(e *entry) (*container.Block, error) {
	blk, _, err := s.residenceLocked(e).materialize()
	return blk, err
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

// errGone: the entry left the store between a lookup and its acquire.
var errGone = fmt.Errorf("%w: block", kvsp.ErrNotFound)

// residenceLocked is where e's layers live now: the one place that tells
// the kinds apart. A block only in the local-storage tier is a diskBlock
// with no octets yet (acquire reads them back).
func (s *store) residenceLocked(e *entry) residence {
	var d *tier.Device
	if s.dev != nil {
		d = s.dev.d
	}
	switch {
	case e.att != nil:
		return attachedBlock{d: d, at: e.att}
	case e.blk != nil:
		return hostBlock{blk: e.blk}
	case e.dev != nil:
		return splitBlock{d: d, dev: e.dev, devLayers: e.devLayers, tail: e.tail, e: e, bufs: s.bufs}
	}
	return diskBlock{}
}

// residence is where e's layers live now, for its replica record.
func (s *store) residence(e *entry) residence {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.residenceLocked(e)
}

// acquire returns where the entry's octets are, to read them: in memory
// (host, split, an engine's pages), or read back from disk and verified
// (tier.ErrCorrupt when that fails). The caller calls release when done:
// until then an eviction or demotion does not reuse their memory.
func (s *store) acquire(e *entry, g container.Geometry) (r residence, release func(), err error) {
	return s.acquireFor(e, g, nil)
}

// acquireFor is acquire for a GET's reader (nil: none, an RDMA read): the
// reader is charged for a block read back from disk (429 past its
// client's allowance, before the read) and, if the block leaves host
// memory while it is read, for that memory.
func (s *store) acquireFor(e *entry, g container.Geometry, rd *reader) (r residence, release func(), err error) {
	s.mu.Lock()
	if s.m[e.id] != e { // evicted, dropped or unpublished since it was found: its memory is no longer its own
		s.mu.Unlock()
		return nil, nil, errGone
	}
	r = s.residenceLocked(e)
	if _, onDisk := r.(diskBlock); !onDisk {
		e.refs++
		if rd != nil {
			e.readers = append(e.readers, rd)
		}
		if e.devElem != nil {
			s.dev.lru.MoveToFront(e.devElem)
		}
		s.mu.Unlock()
		return r, func() { s.unref(e, rd) }, nil
	}
	s.mu.Unlock()
	if rd != nil {
		if err := rd.reserve(e.octets); err != nil { // the copy read back
			return nil, nil, err
		}
	}
	blk, err := s.disk.Get(e.id.name(), g)
	if err != nil {
		return nil, nil, err
	}
	return diskBlock{hostBlock{blk}}, func() {}, nil
}

// unref ends a reference to e taken by acquireFor (rd: its reader, or
// nil), or by the demotion writer.
func (s *store) unref(e *entry, rd *reader) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e.refs--
	if rd != nil {
		if i := slices.Index(e.readers, rd); i >= 0 {
			e.readers = slices.Delete(e.readers, i, i+1)
		}
	}
	if e.refs > 0 {
		return
	}
	if e.idle != nil {
		close(e.idle)
		e.idle = nil
	}
	if e.orphan != nil {
		s.orphaned -= int64(cap(e.orphan))
		s.bufs.put(e.orphan)
		e.orphan = nil
	}
	if e.devOrphan != nil {
		e.devOrphan.Free()
		e.devOrphan = nil
	}
}

// close frees device memory.
func (s *store) close() {
	if s.demoteStop != nil {
		close(s.demoteStop)
		<-s.demoteDone
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.m {
		if e.dev != nil && e.refs == 0 {
			e.dev.Free()
		}
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

// evictedHeld is the host memory held beyond capacity by GETs of blocks
// that left the tier while they were sent (the metric's "evicted").
func (s *store) evictedHeld() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.orphaned
}

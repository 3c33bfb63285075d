package engine

import (
	"container/list"
	"fmt"
	"sync"

	"github.com/kvsp/kvsp"
)

// Blocks is the block bookkeeping engines share behind their KV: blocks by
// Block Key, each with a payload P (the engine's memory of the block: host
// buffers, lent pages), the layers written so far, its pins, and the
// recency of the complete (resident) ones. At capacity, a new block evicts
// the least recently used resident block that is not pinned; a partly
// written block is never evicted. Its methods follow KV's semantics, and
// are safe for concurrent use.
//
// Callbacks (alloc, release, and the fn of Write, Read, Claim and Each) run
// under Blocks' lock, so they see the payload alone; they must not call
// back into the same Blocks.
type Blocks[P any] struct {
	layers   int
	capacity int
	alloc    func(key kvsp.BlockKey) (P, error)
	release  func(P)

	mu     sync.Mutex
	blocks map[kvsp.BlockKey]*held[P]
	lru    list.List // of kvsp.BlockKey: the resident blocks, front most recently used
}

// held is one block of Blocks.
type held[P any] struct {
	p       P
	written []bool
	count   int           // layers written
	pins    int           // > 0: never evicted
	checked bool          // Has found it complete: Claim may take it
	elem    *list.Element // in lru once complete
}

func (h *held[P]) complete() bool { return h.count == len(h.written) }

// NewBlocks returns the bookkeeping of blocks of layers layers (layers >
// 0), holding at most capacity blocks, resident or being written (0: no
// bound of its own, as when alloc is what runs out). alloc makes the
// payload of a new block; its error (ErrKVFull when the engine has no
// memory left, say) is Write's, and no block is made. release, if not nil,
// frees the payload of a block dropped or evicted.
func NewBlocks[P any](layers, capacity int, alloc func(key kvsp.BlockKey) (P, error), release func(P)) *Blocks[P] {
	return &Blocks[P]{layers: layers, capacity: max(capacity, 0), alloc: alloc, release: release, blocks: map[kvsp.BlockKey]*held[P]{}}
}

// Has reports whether all layers of the block are written; if so, the
// block becomes the most recently used, and one Claim may take.
func (b *Blocks[P]) Has(key kvsp.BlockKey) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.blocks[key]
	if h == nil || !h.complete() {
		return false
	}
	h.checked = true
	b.lru.MoveToFront(h.elem)
	return true
}

// Write runs fn with the payload of the block, to store layer into it: a
// block not held yet is made first (evicting the least recently used
// resident block that is not pinned when at capacity; ErrKVFull when there
// is none). The layer counts as written once fn returns nil (written again,
// it stays written; fn overwrites it); the block written whole becomes
// resident, the most recently used. fn's error is returned as it is, and
// leaves the block held.
func (b *Blocks[P]) Write(key kvsp.BlockKey, layer uint32, fn func(p P) error) error {
	if uint64(layer) >= uint64(b.layers) {
		return fmt.Errorf("engine: layer %d of a block of %d layers", layer, b.layers)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.blocks[key]
	if h == nil {
		if b.capacity > 0 && len(b.blocks) >= b.capacity && !b.evictLocked() {
			return ErrKVFull
		}
		p, err := b.alloc(key)
		if err != nil {
			return err
		}
		h = &held[P]{p: p, written: make([]bool, b.layers)}
		b.blocks[key] = h
	}
	if err := fn(h.p); err != nil {
		return err
	}
	if !h.written[layer] {
		h.written[layer] = true
		h.count++
		if h.complete() {
			h.elem = b.lru.PushFront(key)
		}
	}
	return nil
}

// evictLocked drops the least recently used resident block that is not
// pinned; it reports false when there is none.
func (b *Blocks[P]) evictLocked() bool {
	for el := b.lru.Back(); el != nil; el = el.Prev() {
		key := el.Value.(kvsp.BlockKey)
		if b.blocks[key].pins > 0 {
			continue
		}
		b.dropLocked(key)
		return true
	}
	return false
}

// Read runs fn with the payload of a resident block, to read layer from
// it; ErrNotResident when the block is not held whole or layer is not
// one of its layers. It leaves recency as it is.
func (b *Blocks[P]) Read(key kvsp.BlockKey, layer uint32, fn func(p P) error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.blocks[key]
	if h == nil || !h.complete() || uint64(layer) >= uint64(b.layers) {
		return ErrNotResident
	}
	return fn(h.p)
}

// Drop forgets a block, resident or partly written, pinned or not, and
// releases its payload.
func (b *Blocks[P]) Drop(key kvsp.BlockKey) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.dropLocked(key)
}

func (b *Blocks[P]) dropLocked(key kvsp.BlockKey) {
	h := b.blocks[key]
	if h == nil {
		return
	}
	b.forgetLocked(key, h)
	if b.release != nil {
		b.release(h.p)
	}
}

// forgetLocked removes h from the map and the recency list.
func (b *Blocks[P]) forgetLocked(key kvsp.BlockKey, h *held[P]) {
	if h.elem != nil {
		b.lru.Remove(h.elem)
	}
	delete(b.blocks, key)
}

// Pin keeps a resident block from eviction until as many Unpin calls; it
// reports false when the block is not resident (KV.Pin).
func (b *Blocks[P]) Pin(key kvsp.BlockKey) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.blocks[key]
	if h == nil || !h.complete() {
		return false
	}
	h.pins++
	return true
}

// Unpin undoes one Pin; it reports whether the block is still pinned
// (KV.Unpin).
func (b *Blocks[P]) Unpin(key kvsp.BlockKey) (stillPinned bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.blocks[key]
	if h == nil {
		return false
	}
	if h.pins > 0 {
		h.pins--
	}
	return h.pins > 0
}

// Resident is the number of complete blocks held.
func (b *Blocks[P]) Resident() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lru.Len()
}

// Capacity is the bound on blocks held given to NewBlocks (0: none).
func (b *Blocks[P]) Capacity() int { return b.capacity }

// Claim hands over the resident blocks a Has found complete and that are
// not pinned: each is forgotten, and fn gets its key and payload, which is
// the caller's from then on (release is not called). An attached engine
// claims the blocks the agent loaded for it this way.
func (b *Blocks[P]) Claim(fn func(key kvsp.BlockKey, p P)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for key, h := range b.blocks {
		if h.checked && h.pins == 0 {
			b.forgetLocked(key, h)
			fn(key, h.p)
		}
	}
}

// Each calls fn with the key and payload of every block held, resident or
// being written, in no particular order.
func (b *Blocks[P]) Each(fn func(key kvsp.BlockKey, p P)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for key, h := range b.blocks {
		fn(key, h.p)
	}
}

// Clear drops every block, releasing each payload.
func (b *Blocks[P]) Clear() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for key := range b.blocks {
		b.dropLocked(key)
	}
}

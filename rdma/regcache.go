package rdma

import (
	"container/list"
	"sync"
	"unsafe"
)

// regCache keeps a holder's registrations for reuse. A holder's block
// memory is recycled (its buffer pool hands an evicted block's memory to
// the next PUT), so registering each allocation once and binding a
// memory window per exposure replaces an ibv_reg_mr and ibv_dereg_mr per
// block read. The registrations allow windows only, never a read with
// the MR's own rkey: a peer reads through the window bound for its queue
// pair, and that key is revoked when the exposure ends, so what the
// memory holds later is out of its reach.
//
// An entry keeps its memory pinned and alive (the provider pins it) even
// after the holder dropped it; idle entries beyond the cache's bound are
// deregistered, least recently used first.
type regCache struct {
	p      Provider
	access Access
	max    int64

	mu    sync.Mutex
	byKey map[regKey]*regEntry
	idle  *list.List // of *regEntry with refs == 0, most recent first
	held  int64      // octets registered
	made  int64      // registrations made
	hits  int64
}

type regKey struct {
	base uintptr
	n    int
}

type regEntry struct {
	key  regKey
	mr   MR
	refs int
	elem *list.Element // in idle, when refs == 0
}

func newRegCache(p Provider, access Access, max int64) *regCache {
	return &regCache{p: p, access: access, max: max, byKey: map[regKey]*regEntry{}, idle: list.New()}
}

// acquire returns the registration of mem (the whole allocation a block
// lies in), registering it on first use.
func (c *regCache) acquire(mem []byte) (*regEntry, error) {
	k := regKey{uintptr(unsafe.Pointer(&mem[0])), len(mem)}
	c.mu.Lock()
	if e := c.byKey[k]; e != nil {
		c.take(e)
		c.hits++
		c.mu.Unlock()
		return e, nil
	}
	c.mu.Unlock()
	mr, err := c.p.Register(mem, c.access) // outside the lock: it is slow
	if err != nil && c.shed() {
		// Perhaps the locked-memory limit: what is idle goes, then again.
		mr, err = c.p.Register(mem, c.access)
	}
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.byKey[k]; e != nil { // registered meanwhile by another read
		mr.Close()
		c.take(e)
		return e, nil
	}
	e := &regEntry{key: k, mr: mr, refs: 1}
	c.byKey[k] = e
	c.held += int64(k.n)
	c.made++
	c.trim()
	return e, nil
}

// take adds a reference to e, under mu.
func (c *regCache) take(e *regEntry) {
	if e.refs == 0 {
		c.idle.Remove(e.elem)
		e.elem = nil
	}
	e.refs++
}

// release drops a reference taken by acquire.
func (c *regCache) release(e *regEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e.refs--; e.refs == 0 {
		e.elem = c.idle.PushFront(e)
		c.trim()
	}
}

// trim deregisters idle entries, least recently used first, while more
// than max octets are registered (under mu).
func (c *regCache) trim() { c.trimTo(c.max) }

// trimTo deregisters idle entries, least recently used first, while more
// than limit octets are registered (under mu); it returns how many.
func (c *regCache) trimTo(limit int64) int {
	n := 0
	for c.held > limit {
		last := c.idle.Back()
		if last == nil {
			break // all in use: they are deregistered once idle
		}
		e := c.idle.Remove(last).(*regEntry)
		delete(c.byKey, e.key)
		c.held -= int64(e.key.n)
		e.mr.Close()
		n++
	}
	return n
}

// shed deregisters every idle entry; false if there was none.
func (c *regCache) shed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.trimTo(0) > 0
}

// drain deregisters the idle entries, and the others once released.
func (c *regCache) drain() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.max = 0
	c.trim()
}

// close deregisters every entry; those in use must be released first.
func (c *regCache) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, e := range c.byKey {
		e.mr.Close()
		delete(c.byKey, k)
	}
	c.idle.Init()
	c.held = 0
}

// CacheStats reports a Target's registration cache.
type CacheStats struct {
	Registrations int64 // made so far
	Hits          int64 // exposures that reused one
	HeldBytes     int64 // octets registered now
}

func (c *regCache) stats() CacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return CacheStats{Registrations: c.made, Hits: c.hits, HeldBytes: c.held}
}

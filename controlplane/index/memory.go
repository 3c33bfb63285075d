package index

import (
	"container/heap"
	"context"
	"encoding/binary"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsp/kvsp"
)

const (
	memShards = 64
	// sweepBatch bounds the expired entries removed per shard lock hold.
	sweepBatch = 256
)

// Memory is the in-process backend.
type Memory struct {
	shards [memShards]memShard
	stop   chan struct{}
	done   chan struct{}
	// OnExpire, when set, is called with the number of records each sweep
	// removed (metrics).
	onExpire atomic.Pointer[func(n int)]
	// perHolder counts each holder's records (stored, swept or not), for
	// the per-holder quota: holder URI -> *atomic.Int64.
	perHolder sync.Map
}

type memShard struct {
	m0      *Memory
	mu      sync.RWMutex
	holders map[string]string // interned holder URIs: a few per deployment, millions of records
	m       map[kvsp.BlockKey][]memReplica
	pins    map[kvsp.BlockKey]memPin // producers' digests (Pin)
	heap    expiryHeap
	n       int
}

// memPin is a producer's digest of a key, until it expires.
type memPin struct {
	scope   kvsp.ScopeID
	compat  kvsp.CompatID
	digest  kvsp.Digest
	expires time.Time
	gen     uint64
}

func (p memPin) matches(r *kvsp.ReplicaRecord) bool {
	return p.scope == r.ScopeID && p.compat == r.CompatID && p.digest == r.Digest
}

type memReplica struct {
	rec     kvsp.ReplicaRecord
	expires time.Time
	gen     uint64
}

type expiryItem struct {
	at     time.Time
	key    kvsp.BlockKey
	holder string
	gen    uint64
}

type expiryHeap []expiryItem

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h expiryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)        { *h = append(*h, x.(expiryItem)) }
func (h *expiryHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

var genCounter atomic.Uint64

func nextGen() uint64 { return genCounter.Add(1) }

// NewMemory returns a Memory backend whose sweeper removes expired records
// every interval (records past their expiry are never returned, swept or
// not).
func NewMemory(interval time.Duration) *Memory {
	m := &Memory{stop: make(chan struct{}), done: make(chan struct{})}
	for i := range m.shards {
		m.shards[i].m = make(map[kvsp.BlockKey][]memReplica)
		m.shards[i].pins = make(map[kvsp.BlockKey]memPin)
		m.shards[i].holders = make(map[string]string)
		m.shards[i].m0 = m
	}
	go m.sweeper(interval)
	return m
}

func (m *Memory) shard(k kvsp.BlockKey) *memShard {
	// Block Keys are HMAC outputs: uniformly distributed.
	return &m.shards[binary.LittleEndian.Uint64(k[:8])%memShards]
}

// Put implements Backend.
func (m *Memory) Put(ctx context.Context, rec *kvsp.ReplicaRecord, ttl time.Duration, o PutOptions) (bool, error) {
	now := time.Now()
	at := now.Add(ttl)
	s := m.shard(rec.BlockKey)
	gen := nextGen()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepLocked(now, 8) // amortized: writers help the sweeper
	stored := *rec
	if h, ok := s.holders[stored.Holder]; ok {
		stored.Holder = h
	} else if len(s.holders) < 4096 {
		s.holders[stored.Holder] = stored.Holder
	}
	rec = &stored
	reps := s.m[rec.BlockKey]
	if o.PinDigest {
		p, ok := s.pins[rec.BlockKey]
		switch {
		case !ok || !p.expires.After(now):
			return false, ErrNoProducerDigest
		case !p.matches(rec):
			return false, ErrDigestConflict
		case p.expires.Before(at): // the statement lives as long as the replicas that match it
			p.expires, p.gen = at, nextGen()
			s.pins[rec.BlockKey] = p
			heap.Push(&s.heap, expiryItem{at, rec.BlockKey, "", p.gen})
		}
	}
	created := true
	for i := range reps {
		if reps[i].rec.Holder == rec.Holder {
			created = !reps[i].expires.After(now)
			reps[i] = memReplica{rec: *rec, expires: at, gen: gen}
			heap.Push(&s.heap, expiryItem{at, rec.BlockKey, rec.Holder, gen})
			return created, nil
		}
	}
	count := m.holderCount(rec.Holder)
	if o.MaxHolderRecords > 0 && count.Load() >= int64(o.MaxHolderRecords) {
		return false, ErrRecordQuota
	}
	count.Add(1)
	s.m[rec.BlockKey] = append(reps, memReplica{rec: *rec, expires: at, gen: gen})
	s.n++
	heap.Push(&s.heap, expiryItem{at, rec.BlockKey, rec.Holder, gen})
	return true, nil
}

// Pin implements Backend.
func (m *Memory) Pin(ctx context.Context, rec *kvsp.ProducerRecord, ttl time.Duration) error {
	now := time.Now()
	at := now.Add(ttl)
	s := m.shard(rec.BlockKey)
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pins[rec.BlockKey]
	if ok && p.expires.After(now) {
		if p.scope != rec.ScopeID || p.compat != rec.CompatID || p.digest != rec.Digest {
			return ErrProducerConflict
		}
		if !p.expires.Before(at) {
			return nil // stated already, for longer
		}
	}
	p = memPin{scope: rec.ScopeID, compat: rec.CompatID, digest: rec.Digest, expires: at, gen: nextGen()}
	s.pins[rec.BlockKey] = p
	heap.Push(&s.heap, expiryItem{at, rec.BlockKey, "", p.gen})
	return nil
}

// Delete implements Backend.
func (m *Memory) Delete(ctx context.Context, holder string, key kvsp.BlockKey, authorize func(*kvsp.ReplicaRecord) error) error {
	now := time.Now()
	s := m.shard(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	reps := s.m[key]
	for i := range reps {
		if reps[i].rec.Holder != holder || !reps[i].expires.After(now) {
			continue
		}
		if authorize != nil {
			if err := authorize(&reps[i].rec); err != nil {
				return err
			}
		}
		s.removeLocked(key, i)
		return nil
	}
	return kvsp.ErrNotFound
}

// holderCount is holder's record counter.
func (m *Memory) holderCount(holder string) *atomic.Int64 {
	if c, ok := m.perHolder.Load(holder); ok {
		return c.(*atomic.Int64)
	}
	c, _ := m.perHolder.LoadOrStore(holder, new(atomic.Int64))
	return c.(*atomic.Int64)
}

// removeLocked drops replica i of key; its heap item goes stale.
func (s *memShard) removeLocked(key kvsp.BlockKey, i int) {
	reps := s.m[key]
	s.m0.holderCount(reps[i].rec.Holder).Add(-1)
	reps[i] = reps[len(reps)-1]
	reps = reps[:len(reps)-1]
	if len(reps) == 0 {
		delete(s.m, key)
	} else {
		s.m[key] = reps
	}
	s.n--
}

// sweepLocked removes up to max expired records; stale heap items (records
// refreshed or deleted since) are dropped on the way.
func (s *memShard) sweepLocked(now time.Time, max int) int {
	removed := 0
	for len(s.heap) > 0 && removed < max && !s.heap[0].at.After(now) {
		it := heap.Pop(&s.heap).(expiryItem)
		if it.holder == "" { // a producer's digest (no holder has an empty base URI)
			if p, ok := s.pins[it.key]; ok && p.gen == it.gen {
				delete(s.pins, it.key)
			}
			continue
		}
		reps := s.m[it.key]
		for i := range reps {
			if reps[i].rec.Holder == it.holder && reps[i].gen == it.gen {
				s.removeLocked(it.key, i)
				removed++
				break
			}
		}
	}
	return removed
}

func (m *Memory) sweeper(interval time.Duration) {
	defer close(m.done)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
		for i := range m.shards {
			s := &m.shards[i]
			for {
				s.mu.Lock()
				n := s.sweepLocked(time.Now(), sweepBatch)
				more := len(s.heap) > 0 && !s.heap[0].at.After(time.Now())
				s.mu.Unlock() // lookups get in between batches
				if f := m.onExpire.Load(); f != nil && n > 0 {
					(*f)(n)
				}
				if !more {
					break
				}
			}
		}
	}
}

// Lookup implements Backend.
func (m *Memory) Lookup(ctx context.Context, scope kvsp.ScopeID, compat kvsp.CompatID, keys []kvsp.BlockKey, res *Result) error {
	res.Reset()
	now := time.Now()
	for _, k := range keys {
		s := m.shard(k)
		start := len(res.flat)
		s.mu.RLock()
		reps := s.m[k]
		for i := range reps {
			r := &reps[i]
			if !r.expires.After(now) || r.rec.ScopeID != scope || r.rec.CompatID != compat {
				continue
			}
			res.flat = append(res.flat, r.rec)
			res.flat[len(res.flat)-1].TTLMs = remainingMs(r.expires.Sub(now))
		}
		s.mu.RUnlock()
		if len(res.flat) == start {
			break // Block Keys chain: nothing after a gap can be used (R-IS-15)
		}
		res.add(start)
	}
	return nil
}

// Len implements Backend.
func (m *Memory) Len() int {
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.RLock()
		n += s.n
		s.mu.RUnlock()
	}
	return n
}

// Close implements Backend.
func (m *Memory) Close() error {
	select {
	case <-m.stop:
	default:
		close(m.stop)
	}
	<-m.done
	return nil
}

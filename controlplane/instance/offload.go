package instance

import (
	"bytes"
	"container/heap"
	"context"
	"crypto/sha256"
	"errors"
	"math"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
)

// Offloading: the blocks a request computed (and those loaded from
// another holder) go to the instance's own holder, which publishes them,
// so the next request with that prefix, on any instance, loads them
// instead of computing them.
//
// A block is copied out of the engine when it is offered, not when its
// PUT starts: the engine's KV turns over in about a second under load,
// and a block read later may be gone. Before this copy, 42% of the blocks
// computed in kvsp demo --speed 24 were evicted before their PUT, without
// a trace, and the sharing they would have given was lost; the requests
// that missed them computed more blocks, which waited longer: a collapse.
// What waits is bounded in octets; beyond, the deepest blocks in their
// chains are skipped (and counted), a block offered while an earlier
// offer of it is waiting or was just answered is not sent again, and
// every outcome is counted.

// maxOffloads bounds the PUTs to the instance's holder under way at once
// (putLimit sets how many, up to it), and recentOffloads the answered
// blocks remembered, so that a block computed again soon after (two
// requests of one batch with one prefix) is not sent again.
const (
	maxOffloads    = 8
	recentOffloads = 4096
)

// defaultOffloadBuffer is the offload queue's bound when none is
// configured. A longer queue stores more of the deepest blocks, which are
// read least, and its PUTs take the CPU that loads need: on 2 cores at
// kvsp demo --speed 24 (all roles in one process, about 80% busy) the
// prefix hit ratio was, as a fraction of the infinite-cache bound, 0.56
// and 0.66 with 256 MiB, a median of 0.72 over 6 runs with 64 MiB (0.49
// to 0.79), 0.80 to 0.82 over 3 with 32 MiB, a median of 0.83 over 6
// with 16 MiB (0.73 to 0.86), and 0.41 and 0.42 with 1 MiB (54,000
// blocks skipped: too few stored).
const defaultOffloadBuffer = 16 << 20

// putWindow is the PUTs whose least round trip putLimit compares with.
const putWindow = 64

// putLimit sets how many offload PUTs may be under way from their round
// trips, as TCP Vegas reads delay: a PUT answered within twice the least
// round trip of the last putWindow adds 1/limit (one more PUT per
// limit's worth answered), a slower one halves the limit (at least 1).
//
// Offloading is background work, most of whose blocks are never read
// again, and loading is what requests wait for; when PUTs queue, they
// take what loads need. With eight PUTs always under way, at kvsp demo
// --speed 24 the instances' PUT streams took the CPU that directives'
// lookups, leases and GETs needed: from 15 s on, a directive of 34
// blocks took 460 ms (median) against a deadline of 415 ms, 21 of 264
// completed, and the hit ratio stayed at 0.22-0.26 (0.35-0.39 of the
// bound) though the IS held most of what was asked for. One PUT at a
// time stored nearly as much (the CPU bounded it, not the concurrency),
// and the hit ratio rose to 0.45; this limit finds that where PUTs wait,
// and keeps maxOffloads under way where their round trip is the link's
// (a remote holder with CPU to spare).
type putLimit struct {
	limit int
	fast  int // PUTs at the link's round trip since the limit last rose
	rtts  [putWindow]time.Duration
	n     int // PUTs observed
}

func (l *putLimit) get() int { return max(1, l.limit) }

func (l *putLimit) observe(rtt time.Duration) {
	l.rtts[l.n%putWindow] = rtt
	l.n++
	least := rtt
	for _, r := range l.rtts[:min(l.n, putWindow)] {
		least = min(least, r)
	}
	if rtt > 2*least {
		l.limit, l.fast = max(1, l.limit/2), 0
		return
	}
	if l.fast++; l.fast >= l.limit {
		l.limit, l.fast = min(maxOffloads, l.limit+1), 0
	}
}

// copyPosition is the position given to a block loaded from another
// holder and offered to the instance's own: it yields to every block
// computed here, which no holder has.
const copyPosition = math.MaxInt32

type offloadKey struct {
	scope kvsp.ScopeID
	key   kvsp.BlockKey
}

// offer is a block waiting for its PUT: its layers copied out of the
// engine, its position in its chain (block 0 first).
type offer struct {
	k       offloadKey
	compat  kvsp.CompatID
	pos     int
	seq     uint64
	buf     *[]byte
	offered time.Time
}

// offers is a heap of offers, the lowest position (then the newest)
// first: a block is only useful to a longest-prefix lookup after every
// block before it in its chain, and the first blocks of prompts are the
// ones shared, so when the holder cannot keep up the first blocks go
// first, and what is skipped is the deepest (the oldest of those). Among
// equals the newest goes first: a block is wanted soon after it was
// computed (requests sharing a prefix arrive together), so under
// overload first-in-first-out made every block wait the whole queue
// (offload delay 1.7 s on average at kvsp demo --speed 24, hit ratio
// 0.205-0.222), while newest-first publishes most promptly and lets the
// queue's oldest wait (1.1-1.2 s, 0.244-0.255).
type offers []*offer

func (h offers) Len() int { return len(h) }
func (h offers) Less(i, j int) bool {
	return h[i].pos < h[j].pos || h[i].pos == h[j].pos && h[i].seq > h[j].seq
}
func (h offers) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *offers) Push(x any)   { *h = append(*h, x.(*offer)) }
func (h *offers) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// offloader is the agent's offload queue. Its buffers hold a whole KVB1
// container: the header (hdrLen octets) and after it the layers, K then V
// of each, as copied from the engine, which is the container's body as it
// is (CodecRaw): the PUT sends the buffer, with no second copy.
type offloader struct {
	blockOctets int64
	h           container.Header // the containers' header (one geometry, CodecRaw)
	hdr         []byte           // and its octets
	budget      int64            // octets of copied blocks, waiting or under way
	bufs        sync.Pool

	mu      sync.Mutex
	used    int64
	queue   offers
	seq     uint64
	workers int                 // PUT goroutines running (each ends when the queue is empty)
	puts    putLimit            // how many may run
	waiting map[offloadKey]bool // offered and not answered yet
	recent  map[offloadKey]bool // answered lately: ring's keys
	ring    []offloadKey
	next    int
}

func newOffloader(g container.Geometry, budget int64) (*offloader, error) {
	h, err := container.NewHeader(container.CodecRaw, 0, g.Layers, g)
	if err != nil {
		return nil, err
	}
	hdr := h.Append(nil)
	n := int64(2 * g.Layers * uint32(g.RawSectionLen()))
	if budget == 0 {
		budget = defaultOffloadBuffer
	}
	o := &offloader{blockOctets: n, h: h, hdr: hdr, budget: max(budget, 16*n),
		puts: putLimit{limit: 1}, waiting: map[offloadKey]bool{}, recent: map[offloadKey]bool{}, ring: make([]offloadKey, recentOffloads)}
	o.bufs.New = func() any {
		b := make([]byte, len(hdr)+int(n))
		copy(b, hdr)
		return &b
	}
	return o, nil
}

// forgetLocked ends k's offer; answered: the holder has the block now.
func (o *offloader) forgetLocked(k offloadKey, answered bool) {
	delete(o.waiting, k)
	if !answered {
		return
	}
	delete(o.recent, o.ring[o.next])
	o.ring[o.next] = k
	o.recent[k] = true
	o.next = (o.next + 1) % len(o.ring)
}

// admit decides an offer at pos of k: "" to copy and queue it, or the
// outcome that ends it (duplicate, skipped). When the buffer is full, the
// deepest waiting offer deeper than pos makes room (dropped: returned,
// to count as skipped).
func (o *offloader) admit(k offloadKey, pos int) (outcome string, dropped *offer) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.waiting[k] || o.recent[k] {
		return "duplicate", nil
	}
	if o.used+o.blockOctets > o.budget {
		worst := -1
		for i, x := range o.queue {
			if x.pos > pos && (worst < 0 || x.pos > o.queue[worst].pos || x.pos == o.queue[worst].pos && x.seq < o.queue[worst].seq) {
				worst = i
			}
		}
		if worst < 0 {
			return "skipped", nil
		}
		dropped = heap.Remove(&o.queue, worst).(*offer)
		o.forgetLocked(dropped.k, false)
		o.used -= o.blockOctets
	}
	o.waiting[k] = true
	o.used += o.blockOctets
	return "", dropped
}

// offload copies a block of the engine's KV (at pos in its chain) and
// queues its PUT to the instance's holder.
func (a *Agent) offload(scope kvsp.ScopeID, compat kvsp.CompatID, key kvsp.BlockKey, pos int) {
	if a.cfg.Holder == "" {
		return
	}
	o, k := a.off, offloadKey{scope, key}
	outcome, dropped := o.admit(k, pos)
	if dropped != nil {
		o.bufs.Put(dropped.buf)
		a.m.offloads.WithLabelValues("skipped").Inc()
	}
	if outcome != "" {
		a.m.offloads.WithLabelValues(outcome).Inc()
		return
	}
	buf := o.bufs.Get().(*[]byte)
	sec := int(a.g.RawSectionLen())
	layers := (*buf)[len(o.hdr):]
	for l := range int(a.g.Layers) {
		kv := layers[2*l*sec : (2*l+2)*sec]
		if a.cfg.Engine.KV().ReadLayer(key, uint32(l), kv[:sec], kv[sec:]) != nil {
			o.bufs.Put(buf)
			o.mu.Lock()
			o.used -= o.blockOctets
			o.forgetLocked(k, false)
			o.mu.Unlock()
			a.m.offloads.WithLabelValues("evicted").Inc()
			return
		}
	}
	o.mu.Lock()
	o.seq++
	heap.Push(&o.queue, &offer{k: k, compat: compat, pos: pos, seq: o.seq, buf: buf, offered: time.Now()})
	if o.workers < o.puts.get() {
		o.workers++
		go a.offloadWorker()
	}
	o.mu.Unlock()
}

// offloadWorker PUTs the queued offers, lowest position first, until the
// queue is empty, the agent stops, or more workers run than putLimit
// allows (at least one stays while the queue is not empty).
func (a *Agent) offloadWorker() {
	o := a.off
	for {
		o.mu.Lock()
		if len(o.queue) == 0 || a.stopCtx.Err() != nil || o.workers > o.puts.get() {
			o.workers--
			o.mu.Unlock()
			return
		}
		x := heap.Pop(&o.queue).(*offer)
		o.mu.Unlock()
		start := time.Now()
		answered := a.store(x.k.scope, x.compat, x.k.key, *x.buf, x.pos != copyPosition)
		rtt := time.Since(start)
		if answered {
			a.m.offloadDelay.Observe(time.Since(x.offered).Seconds())
		}
		o.bufs.Put(x.buf)
		o.mu.Lock()
		if answered {
			o.puts.observe(rtt)
		}
		o.used -= o.blockOctets
		o.forgetLocked(x.k, answered)
		o.mu.Unlock()
	}
}

// store puts a block (a container in blk, as offload copied it: the
// offloader's header, then its layers, K then V of each) at the
// instance's holder, which publishes the new replica (best effort: the
// engine has it either way). computed says this instance computed it
// (not a copy of a block it loaded): with ProducerDigests its digest is
// stated at the IS first. It reports whether the holder has the block
// now.
func (a *Agent) store(scope kvsp.ScopeID, compat kvsp.CompatID, key kvsp.BlockKey, blk []byte, computed bool) bool {
	// The buffer is the container, octet for octet: its Repr-Digest is
	// SHA-256 of it, one pass (container.Writer hashed every octet twice,
	// for the layer digests too, which the holder computes itself: 3% of
	// the CPU of kvsp demo --speed 24).
	if int64(len(blk)) != int64(len(a.off.hdr))+a.off.blockOctets {
		return false
	}
	dg := container.Digest(sha256.Sum256(blk))
	ctx, cancel := context.WithTimeout(a.stopCtx, 10*time.Second)
	defer cancel()
	if computed && a.cfg.ProducerDigests && !a.stateDigest(ctx, scope, compat, key, blk) {
		return false
	}
	ref := client.BlockRef{Compat: compat, Scope: scope, Key: key}
	switch err := a.cfg.Client.Holder(a.cfg.Holder).PutBlock(ctx, ref, bytes.NewReader(blk), int64(len(blk)), dg); {
	case err == nil:
		a.m.offloads.WithLabelValues("stored").Inc()
	case errors.Is(err, client.ErrExists):
		a.m.offloads.WithLabelValues("exists").Inc()
	default:
		a.m.offloads.WithLabelValues("failed").Inc()
		a.log.Warn("storing a block at the instance's holder failed", "err", err)
		return false
	}
	return true
}

// producerTTL is the lifetime asked for a producer's statement: as long as
// its block is likely kept, the IS's max_ttl_ms capping it; the holders'
// records that match it extend it as they are refreshed.
const producerTTL = 10 * time.Minute

// stateDigest states the replica digest of a block this instance computed
// at the IS, before its holder publishes it (R-SEC-8: "the producing
// instance can publish the digest itself"). It reports whether the block
// should go to the holder: not when another producer stated another
// digest for the key (the holder's record of it would be refused), nor
// when the IS did not take the statement.
func (a *Agent) stateDigest(ctx context.Context, scope kvsp.ScopeID, compat kvsp.CompatID, key kvsp.BlockKey, blk []byte) bool {
	layers := make([]container.Digest, a.g.Layers)
	body := blk[len(a.off.hdr):]
	n := 2 * int(a.g.RawSectionLen())
	for l := range layers {
		layers[l] = sha256.Sum256(body[l*n : (l+1)*n]) // K then V of layer l
	}
	rec := &kvsp.ProducerRecord{BlockKey: key, ScopeID: scope, CompatID: compat, Producer: a.cfg.Base,
		Digest: kvsp.Digest(container.ReplicaDigest(layers)), TTLMs: uint64(producerTTL.Milliseconds())}
	_, err := a.cfg.Client.Index(a.cfg.Index).StateDigest(ctx, rec)
	switch {
	case err == nil:
		return true
	case errors.Is(err, kvsp.ErrConflict):
		a.m.offloads.WithLabelValues("other_producer").Inc()
	default:
		a.m.offloads.WithLabelValues("failed").Inc()
		a.log.Warn("stating a block's digest at the IS failed", "err", err)
	}
	return false
}

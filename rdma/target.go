package rdma

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"
)

// Target is a holder's side: one queue pair per client endpoint, and
// the exposures of block octets to them. It satisfies holder.RDMA.
//
// Where the device has type 2 memory windows, the memory blocks lie in is
// registered once (cached, for windows only) and each exposure binds a
// window for the one client's queue pair, invalidated when it ends.
// Otherwise each exposure registers its octets for remote read and
// deregisters them after.
type Target struct {
	p     Provider
	cache *regCache

	mu        sync.Mutex
	peers     map[string]*peer // by the client's endpoint
	maxPeers  int
	noWindows bool // the device has none: register per exposure
}

// peer is a client's queue pair and its exposures under way.
type peer struct {
	q      QP
	active int       // exposures not yet released, under Target.mu
	used   time.Time // last exposure's start, under Target.mu
}

// maxPeers bounds the queue pairs a target keeps (one per client
// endpoint). Clients come back with new endpoints (after a failed read,
// or a restart) without saying so: at the bound, the least recently used
// pair with no exposure under way is closed for a new one.
const maxPeers = 4096

// DefaultCacheBytes bounds the memory a Target keeps registered while no
// exposure uses it.
const DefaultCacheBytes = 1 << 30

// NewTarget returns a Target on p, keeping up to DefaultCacheBytes
// registered.
func NewTarget(p Provider) *Target { return NewTargetCache(p, DefaultCacheBytes) }

// NewTargetCache returns a Target on p keeping up to cacheBytes of idle
// registrations.
func NewTargetCache(p Provider, cacheBytes int64) *Target {
	return &Target{p: p, cache: newRegCache(p, AccessWindows, cacheBytes), peers: map[string]*peer{}, maxPeers: maxPeers, noWindows: !p.HasWindows()}
}

// Accept returns the endpoint of this side's queue pair connected to the
// client's (created on first use).
func (t *Target) Accept(client string) (string, error) {
	ep, err := ParseEndpoint(client)
	if err != nil {
		return "", err
	}
	t.mu.Lock()
	if pr := t.peers[client]; pr != nil {
		t.mu.Unlock()
		return pr.q.Endpoint().String(), nil
	}
	var evict QP
	if len(t.peers) >= t.maxPeers {
		var oldest string
		for k, pr := range t.peers {
			if pr.active == 0 && (oldest == "" || pr.used.Before(t.peers[oldest].used)) {
				oldest = k
			}
		}
		if oldest == "" {
			t.mu.Unlock()
			return "", fmt.Errorf("rdma: %d queue pairs with reads under way", t.maxPeers)
		}
		evict = t.peers[oldest].q
		delete(t.peers, oldest)
	}
	t.mu.Unlock()
	if evict != nil {
		evict.Close()
	}
	q, err := t.p.NewQP()
	if err != nil {
		return "", err
	}
	if err := q.Connect(ep); err != nil {
		q.Close()
		return "", err
	}
	t.mu.Lock()
	if pr := t.peers[client]; pr != nil { // accepted meanwhile
		t.mu.Unlock()
		q.Close()
		return pr.q.Endpoint().String(), nil
	}
	t.peers[client] = &peer{q: q, used: time.Now()}
	t.mu.Unlock()
	return q.Endpoint().String(), nil
}

// begin returns the client's queue pair for an exposure, counted as under
// way until end.
func (t *Target) begin(client string) (*peer, bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	pr := t.peers[client]
	if pr == nil {
		return nil, false, fmt.Errorf("%w: no queue pair for %s", ErrNotConnected, client)
	}
	pr.active++
	pr.used = time.Now()
	return pr, t.noWindows, nil
}

func (t *Target) end(pr *peer) {
	t.mu.Lock()
	pr.active--
	t.mu.Unlock()
}

// Expose lets the client (the endpoint given to Accept) read buf until
// release. mem is the allocation buf lies in: it is what gets registered
// (once, for windows), so that memory the holder recycles is not
// registered again; nil registers buf for this exposure only (memory that
// will not come back: a block read from disk).
func (t *Target) Expose(client string, mem, buf []byte) (addr uint64, rkey uint32, release func(), err error) {
	if len(buf) == 0 {
		return 0, 0, nil, fmt.Errorf("rdma: exposing no octets")
	}
	a := uintptr(unsafe.Pointer(&buf[0]))
	if mem != nil {
		lo := uintptr(unsafe.Pointer(&mem[0]))
		if a < lo || a-lo > uintptr(len(mem)) || uintptr(len(buf)) > uintptr(len(mem))-(a-lo) {
			return 0, 0, nil, fmt.Errorf("rdma: the exposed octets are not inside the memory given")
		}
	}
	return t.exposure(client, func(pr *peer, noWindows bool) (uint64, uint32, func(), error) {
		if noWindows {
			return t.register(buf)
		}
		var mr MR
		var done func()
		if mem == nil {
			m, err := t.p.Register(buf, AccessWindows)
			if err != nil {
				return 0, 0, nil, err
			}
			mr, done = m, func() { m.Close() }
		} else {
			e, err := t.cache.acquire(mem)
			if err != nil {
				return 0, 0, nil, err
			}
			mr, done = e.mr, func() { t.cache.release(e) }
		}
		rkey, release, err := t.bind(client, pr, mr, uint64(a), uint64(len(buf)), done)
		if errors.Is(err, ErrNoWindows) {
			return t.register(buf)
		}
		return uint64(a), rkey, release, err
	})
}

// exposure runs expose for the client's queue pair, the exposure counted
// as under way until its release (once).
func (t *Target) exposure(client string, expose func(pr *peer, noWindows bool) (uint64, uint32, func(), error)) (uint64, uint32, func(), error) {
	pr, noWindows, err := t.begin(client)
	if err != nil {
		return 0, 0, nil, err
	}
	addr, rkey, release, err := expose(pr, noWindows)
	if err != nil {
		t.end(pr)
		return 0, 0, nil, err
	}
	var once sync.Once
	return addr, rkey, func() {
		once.Do(func() {
			release()
			t.end(pr)
		})
	}, nil
}

// bind binds a window over n octets at addr of mr for the client's queue
// pair; its release invalidates it, then calls done (what frees mr). A
// failed bind calls done at once; ErrNoWindows (the device said otherwise
// than HasWindows) turns windows off for the target, and another failure
// takes the pair down (it is in the error state).
func (t *Target) bind(client string, pr *peer, mr MR, addr, n uint64, done func()) (uint32, func(), error) {
	w, err := pr.q.Bind(mr, addr, n)
	if err != nil {
		done()
		if errors.Is(err, ErrNoWindows) {
			t.markNoWindows()
		} else {
			t.drop(client, pr)
		}
		return 0, nil, err
	}
	return w.RKey(), func() {
		if w.Invalidate() != nil {
			t.drop(client, pr) // closing the pair ends its windows
		}
		done()
	}, nil
}

// ExposeDevice lets the client read n octets at off of device memory
// until release: GPUDirect RDMA, the NIC reading the accelerator's memory
// with no staging through the host. Those octets are registered for this
// exposure and deregistered when it ends (the device tier frees and
// reuses its allocations without telling, so a cached registration could
// outlive its memory); where the device has windows, the key is a window
// for the client's queue pair.
func (t *Target) ExposeDevice(client string, m DeviceMemory, off, n uint64) (addr uint64, rkey uint32, release func(), err error) {
	if n == 0 || off > uint64(m.Len()) || n > uint64(m.Len())-off {
		return 0, 0, nil, fmt.Errorf("rdma: exposing %d octets at %d of %d of device memory", n, off, m.Len())
	}
	return t.exposure(client, func(pr *peer, noWindows bool) (uint64, uint32, func(), error) {
		return t.exposeDevice(client, pr, noWindows, m, off, n)
	})
}

func (t *Target) exposeDevice(client string, pr *peer, noWindows bool, m DeviceMemory, off, n uint64) (uint64, uint32, func(), error) {
	access := AccessWindows
	if noWindows {
		access = AccessRemoteRead
	}
	mr, err := t.p.RegisterDevice(m, off, n, access)
	if err != nil {
		return 0, 0, nil, err
	}
	r := mr.Region()
	if noWindows {
		return r.Addr, r.RKey, func() { mr.Close() }, nil
	}
	rkey, release, err := t.bind(client, pr, mr, r.Addr, n, func() { mr.Close() })
	if errors.Is(err, ErrNoWindows) {
		return t.exposeDevice(client, pr, true, m, off, n)
	}
	return r.Addr, rkey, release, err
}

// register exposes buf by a registration of its own, for remote read by
// any connected peer until release deregisters it.
func (t *Target) register(buf []byte) (uint64, uint32, func(), error) {
	mr, err := t.p.Register(buf, AccessRemoteRead)
	if err != nil {
		return 0, 0, nil, err
	}
	r := mr.Region()
	return r.Addr, r.RKey, func() { mr.Close() }, nil
}

// markNoWindows records that the device has no windows after all (a bind
// said so): exposures register for remote read from now on, and the
// cached registrations (for windows only) go.
func (t *Target) markNoWindows() {
	t.mu.Lock()
	t.noWindows = true
	t.mu.Unlock()
	t.cache.drain()
}

// drop closes the client's queue pair (if it is still pr's), which ends
// the windows bound through it.
func (t *Target) drop(client string, pr *peer) {
	t.mu.Lock()
	if t.peers[client] == pr {
		delete(t.peers, client)
	}
	t.mu.Unlock()
	pr.q.Close() // outside the lock: it waits for a bind or invalidate under way
}

// CacheStats reports the registration cache.
func (t *Target) CacheStats() CacheStats { return t.cache.stats() }

// Close destroys the queue pairs and deregisters the cached memory (after
// the exposures ended).
func (t *Target) Close() error {
	t.mu.Lock()
	peers := t.peers
	t.peers = map[string]*peer{}
	t.mu.Unlock()
	var errs []error
	for _, pr := range peers {
		errs = append(errs, pr.q.Close())
	}
	t.cache.close()
	return errors.Join(errs...)
}

package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"
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
	qps       map[string]QP // by the client's endpoint
	noWindows bool          // the device has none: register per exposure
}

// maxPeers bounds the queue pairs a target keeps (one per client
// endpoint); beyond it new clients are refused.
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
	return &Target{p: p, cache: newRegCache(p, AccessWindows, cacheBytes), qps: map[string]QP{}, noWindows: !p.HasWindows()}
}

// Accept returns the endpoint of this side's queue pair connected to the
// client's (created on first use).
func (t *Target) Accept(client string) (string, error) {
	ep, err := ParseEndpoint(client)
	if err != nil {
		return "", err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if q := t.qps[client]; q != nil {
		return q.Endpoint().String(), nil
	}
	if len(t.qps) >= maxPeers {
		return "", fmt.Errorf("rdma: %d queue pairs already", maxPeers)
	}
	q, err := t.p.NewQP()
	if err != nil {
		return "", err
	}
	if err := q.Connect(ep); err != nil {
		q.Close()
		return "", err
	}
	t.qps[client] = q
	return q.Endpoint().String(), nil
}

// Expose lets the client (the endpoint given to Accept) read buf until
// release. mem is the allocation buf lies in: it is what gets registered
// (once, for windows), so that memory the holder recycles is not
// registered again.
func (t *Target) Expose(client string, mem, buf []byte) (addr uint64, rkey uint32, release func(), err error) {
	if len(buf) == 0 || len(mem) == 0 {
		return 0, 0, nil, fmt.Errorf("rdma: exposing no octets")
	}
	lo, a := uintptr(unsafe.Pointer(&mem[0])), uintptr(unsafe.Pointer(&buf[0]))
	if a < lo || a-lo > uintptr(len(mem)) || uintptr(len(buf)) > uintptr(len(mem))-(a-lo) {
		return 0, 0, nil, fmt.Errorf("rdma: the exposed octets are not inside the memory given")
	}
	t.mu.Lock()
	q, noWindows := t.qps[client], t.noWindows
	t.mu.Unlock()
	if q == nil {
		return 0, 0, nil, fmt.Errorf("%w: no queue pair for %s", ErrNotConnected, client)
	}
	if noWindows {
		return t.register(buf)
	}
	e, err := t.cache.acquire(mem)
	if err != nil {
		return 0, 0, nil, err
	}
	w, err := q.Bind(e.mr, uint64(a), uint64(len(buf)))
	if err != nil {
		t.cache.release(e)
		if errors.Is(err, ErrNoWindows) { // the device said otherwise
			t.markNoWindows()
			return t.register(buf)
		}
		t.drop(client, q) // a pair that cannot bind is in the error state
		return 0, 0, nil, err
	}
	var once sync.Once
	return uint64(a), w.RKey(), func() {
		once.Do(func() {
			if w.Invalidate() != nil {
				t.drop(client, q) // closing the pair ends its windows
			}
			t.cache.release(e)
		})
	}, nil
}

// ExposeDevice lets the client read n octets at off of device memory
// until release: GPUDirect RDMA, the NIC reading the accelerator's memory
// with no staging through the host. The memory is registered for this
// exposure and deregistered when it ends (the device tier frees and
// reuses its allocations without telling, so a cached registration could
// outlive its memory); where the device has windows, the key is a window
// for the client's queue pair over exactly these octets.
func (t *Target) ExposeDevice(client string, m DeviceMemory, off, n uint64) (addr uint64, rkey uint32, release func(), err error) {
	if n == 0 || off > uint64(m.Len()) || n > uint64(m.Len())-off {
		return 0, 0, nil, fmt.Errorf("rdma: exposing %d octets at %d of %d of device memory", n, off, m.Len())
	}
	t.mu.Lock()
	q, noWindows := t.qps[client], t.noWindows
	t.mu.Unlock()
	if q == nil {
		return 0, 0, nil, fmt.Errorf("%w: no queue pair for %s", ErrNotConnected, client)
	}
	access := AccessWindows
	if noWindows {
		access = AccessRemoteRead
	}
	mr, err := t.p.RegisterDevice(m, access)
	if err != nil {
		return 0, 0, nil, err
	}
	addr = mr.Region().Addr + off
	if noWindows {
		var once sync.Once
		return addr, mr.Region().RKey, func() { once.Do(func() { mr.Close() }) }, nil
	}
	w, err := q.Bind(mr, addr, n)
	if err != nil {
		mr.Close()
		if errors.Is(err, ErrNoWindows) {
			t.markNoWindows()
			return t.ExposeDevice(client, m, off, n)
		}
		t.drop(client, q)
		return 0, 0, nil, err
	}
	var once sync.Once
	return addr, w.RKey(), func() {
		once.Do(func() {
			if w.Invalidate() != nil {
				t.drop(client, q)
			}
			mr.Close()
		})
	}, nil
}

// register exposes buf by a registration of its own, for remote read by
// any connected peer until release deregisters it.
func (t *Target) register(buf []byte) (uint64, uint32, func(), error) {
	mr, err := t.p.Register(buf, AccessRemoteRead)
	if err != nil {
		return 0, 0, nil, err
	}
	r := mr.Region()
	var once sync.Once
	return r.Addr, r.RKey, func() { once.Do(func() { mr.Close() }) }, nil
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

// drop closes the client's queue pair if it is still q.
func (t *Target) drop(client string, q QP) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.qps[client] == q {
		delete(t.qps, client)
	}
	q.Close()
}

// CacheStats reports the registration cache.
func (t *Target) CacheStats() CacheStats { return t.cache.stats() }

// Close destroys the queue pairs and deregisters the cached memory (after
// the exposures ended).
func (t *Target) Close() error {
	t.mu.Lock()
	var errs []error
	for k, q := range t.qps {
		errs = append(errs, q.Close())
		delete(t.qps, k)
	}
	t.mu.Unlock()
	t.cache.close()
	return errors.Join(errs...)
}

// Reader is an instance's side: one queue pair per holder. It satisfies
// client.RDMAReader.
type Reader struct {
	p    Provider
	bufs *bufPool
	mu   sync.Mutex
	qp   map[string]*readerQP // by holder base URI
}

type readerQP struct {
	q      QP
	remote string // the holder endpoint it is connected to; "" before
}

// NewReader returns a Reader on p, keeping up to DefaultPoolBytes of
// receive buffers registered.
func NewReader(p Provider) *Reader { return NewReaderPool(p, DefaultPoolBytes) }

// NewReaderPool returns a Reader on p keeping up to poolBytes of receive
// buffers registered (0: none; every read registers its buffer).
func NewReaderPool(p Provider, poolBytes int64) *Reader {
	return &Reader{p: p, bufs: newBufPool(p, poolBytes), qp: map[string]*readerQP{}}
}

// Buffer returns a buffer of n octets to read into, registered once and
// reused when it comes from the pool, and the release that gives it back
// (after which it must not be used).
func (r *Reader) Buffer(n int) ([]byte, func(), error) { return r.bufs.get(n) }

// PoolStats reports the receive buffers' use.
func (r *Reader) PoolStats() PoolStats { return r.bufs.snapshot() }

func (r *Reader) get(holder string) (*readerQP, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if q := r.qp[holder]; q != nil {
		return q, nil
	}
	q, err := r.p.NewQP()
	if err != nil {
		return nil, err
	}
	rq := &readerQP{q: q}
	r.qp[holder] = rq
	return rq, nil
}

// Endpoint returns this side's endpoint for holder.
func (r *Reader) Endpoint(holder string) (string, error) {
	q, err := r.get(holder)
	if err != nil {
		return "", err
	}
	return q.q.Endpoint().String(), nil
}

// Connect connects the queue pair for holder to remote (once).
func (r *Reader) Connect(holder, remote string) error {
	q, err := r.get(holder)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if q.remote == remote {
		return nil
	}
	if q.remote != "" {
		return fmt.Errorf("%w: the holder answered from another queue pair (%s, was %s); it restarted?", ErrNotConnected, remote, q.remote)
	}
	ep, err := ParseEndpoint(remote)
	if err != nil {
		return err
	}
	if err := q.q.Connect(ep); err != nil {
		return err
	}
	q.remote = remote
	return nil
}

// Read reads len(dst) octets at addr/rkey of holder into dst. A dst
// inside a buffer from Buffer's pool is already registered; other memory
// is registered for the read and deregistered after. A read that failed
// once posted takes its queue pair down with it (a NIC leaves it in the
// error state, and destroying it ends any transfer still under way, so
// the buffer can be reused): the next read connects a new one.
func (r *Reader) Read(ctx context.Context, holder string, dst []byte, addr uint64, rkey uint32) error {
	if len(dst) == 0 {
		return nil
	}
	q, err := r.get(holder)
	if err != nil {
		return err
	}
	mr, off, ok := r.bufs.lookup(dst)
	if !ok {
		if mr, err = r.p.Register(dst, AccessLocal); err != nil {
			return err
		}
		r.bufs.countRegistration()
		defer mr.Close()
	}
	err = q.q.Read(ctx, mr, off, Region{Addr: addr, RKey: rkey, Len: uint64(len(dst))})
	if err != nil && !errors.Is(err, ErrLocalLength) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		r.forget(holder, q)
	}
	return err
}

// Forget drops the queue pair for holder (after it restarted): the next
// Endpoint creates a new one.
func (r *Reader) Forget(holder string) { r.forget(holder, nil) }

// forget drops holder's queue pair if it is still q (nil: any).
func (r *Reader) forget(holder string, q *readerQP) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cur := r.qp[holder]; cur != nil && (q == nil || cur == q) {
		cur.q.Close()
		delete(r.qp, holder)
	}
}

// Close destroys the queue pairs and deregisters the pooled buffers.
func (r *Reader) Close() error {
	r.mu.Lock()
	for k, q := range r.qp {
		q.q.Close()
		delete(r.qp, k)
	}
	r.mu.Unlock()
	r.bufs.close()
	return nil
}

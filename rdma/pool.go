package rdma

import (
	"fmt"
	"math/bits"
	"sort"
	"sync"
	"unsafe"
)

// Registering memory is the slow step of an RDMA transfer: the kernel
// pins and maps every page of the buffer (tens of microseconds per MiB on
// a NIC, more than the READ of the same octets takes at 25 GB/s). A
// Reader therefore keeps its receive buffers registered, in size classes,
// and reuses them: a block read into a pooled buffer costs no
// registration.

const (
	// minBufferClass is the smallest pooled buffer (a block of a small
	// model is tens of KiB).
	minBufferClass = 64 << 10
	// maxBufferClass bounds a pooled buffer; larger reads register their
	// own buffer each time.
	maxBufferClass = 256 << 20
	// DefaultPoolBytes bounds the memory a Reader keeps registered.
	DefaultPoolBytes = 256 << 20
)

// bufPool is a pool of registered local buffers (no remote access).
type bufPool struct {
	p   Provider
	max int64

	mu     sync.Mutex
	idle   map[int][]*poolBuf // by class
	bases  []*poolBuf         // every buffer, by address
	held   int64              // octets registered
	stats  PoolStats
	closed bool
}

type poolBuf struct {
	buf  []byte
	mr   MR
	base uintptr
}

// PoolStats counts a Reader's receive buffers.
type PoolStats struct {
	Pooled     int64 // buffers handed out from the pool (registered once)
	Registered int64 // registrations made (pool growth, and reads into other memory)
	Unpooled   int64 // buffers handed out outside the pool (too large, or the pool full)
	HeldBytes  int64 // octets registered in the pool now
}

func newBufPool(p Provider, max int64) *bufPool {
	return &bufPool{p: p, max: max, idle: map[int][]*poolBuf{}}
}

// class is the pooled size for n octets: the next power of two from
// minBufferClass, or 0 if n is beyond maxBufferClass.
func class(n int) int {
	if n <= minBufferClass {
		return minBufferClass
	}
	if n > maxBufferClass {
		return 0
	}
	return 1 << bits.Len(uint(n-1))
}

// get returns a buffer of n octets and its release. It comes from the
// pool (registered) when one of its class is idle or the pool may grow;
// otherwise it is ordinary memory, which Read registers for each read.
func (p *bufPool) get(n int) ([]byte, func(), error) {
	c := class(n)
	p.mu.Lock()
	if l := p.idle[c]; c > 0 && len(l) > 0 {
		b := l[len(l)-1]
		p.idle[c] = l[:len(l)-1]
		p.stats.Pooled++
		p.mu.Unlock()
		return b.buf[:n], p.releaser(b, c), nil
	}
	if c == 0 || p.closed || p.held+int64(c) > p.max {
		p.stats.Unpooled++
		p.mu.Unlock()
		return make([]byte, n), func() {}, nil
	}
	p.held += int64(c) // reserved before registering, outside the lock
	p.mu.Unlock()
	buf := make([]byte, c)
	mr, err := p.p.Register(buf, AccessLocal)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		if !p.closed {
			p.held -= int64(c)
		}
		return nil, nil, fmt.Errorf("rdma: registering a %d-octet receive buffer: %w", c, err)
	}
	if p.closed { // closed meanwhile: not pooled
		mr.Close()
		p.stats.Unpooled++
		return buf[:n], func() {}, nil
	}
	b := &poolBuf{buf: buf, mr: mr, base: uintptr(unsafe.Pointer(&buf[0]))}
	i := sort.Search(len(p.bases), func(i int) bool { return p.bases[i].base > b.base })
	p.bases = append(p.bases, nil)
	copy(p.bases[i+1:], p.bases[i:])
	p.bases[i] = b
	p.stats.Pooled++
	p.stats.Registered++
	return buf[:n], p.releaser(b, c), nil
}

func (p *bufPool) releaser(b *poolBuf, c int) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.closed {
				return
			}
			p.idle[c] = append(p.idle[c], b)
		})
	}
}

// lookup returns the pooled registration that holds all of dst, and dst's
// offset in it.
func (p *bufPool) lookup(dst []byte) (MR, uint64, bool) {
	a := uintptr(unsafe.Pointer(&dst[0]))
	p.mu.Lock()
	defer p.mu.Unlock()
	i := sort.Search(len(p.bases), func(i int) bool { return p.bases[i].base > a })
	if i == 0 {
		return nil, 0, false
	}
	b := p.bases[i-1]
	off := uint64(a - b.base)
	if off >= uint64(len(b.buf)) || uint64(len(dst)) > uint64(len(b.buf))-off {
		return nil, 0, false
	}
	return b.mr, off, true
}

func (p *bufPool) countRegistration() {
	p.mu.Lock()
	p.stats.Registered++
	p.mu.Unlock()
}

func (p *bufPool) snapshot() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.HeldBytes = p.held
	return s
}

// close deregisters every pooled buffer. Buffers handed out and not yet
// released must not be read into afterwards.
func (p *bufPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, b := range p.bases {
		b.mr.Close()
	}
	p.bases, p.idle, p.held, p.closed = nil, map[int][]*poolBuf{}, 0, true
}

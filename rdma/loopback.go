package rdma

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"
	"unsafe"
)

// Fabric is an in-process RDMA fabric: providers on it register memory
// and connect queue pairs, and reads between them copy registered memory
// with the checks a NIC makes (rkey, bounds, access, connection). It
// stands in for hardware where there is none (tests, CI, single-node
// development).
type Fabric struct {
	mu    sync.Mutex
	lids  uint16
	qpns  uint32
	qps   map[uint32]*loopQP
	nodes map[uint16]*Loopback
}

// NewFabric returns an empty fabric.
func NewFabric() *Fabric {
	return &Fabric{qps: map[uint32]*loopQP{}, nodes: map[uint16]*Loopback{}}
}

// Loopback is a provider on a Fabric.
type Loopback struct {
	f    *Fabric
	name string
	lid  uint16
	mrs  map[uint32]*loopMR     // by rkey, under f.mu
	mws  map[uint32]*loopWindow // bound windows by rkey, under f.mu
	regs int64                  // registrations made, under f.mu
}

// Provider adds a node to the fabric.
func (f *Fabric) Provider(name string) *Loopback {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lids++
	l := &Loopback{f: f, name: "loopback:" + name, lid: f.lids, mrs: map[uint32]*loopMR{}, mws: map[uint32]*loopWindow{}}
	f.nodes[l.lid] = l
	return l
}

// Name implements Provider.
func (l *Loopback) Name() string { return l.name }

// Close implements Provider.
func (l *Loopback) Close() error {
	l.f.mu.Lock()
	defer l.f.mu.Unlock()
	delete(l.f.nodes, l.lid)
	return nil
}

// Registrations reports the registrations made on l so far, and those
// still live.
func (l *Loopback) Registrations() (made int64, live int) {
	l.f.mu.Lock()
	defer l.f.mu.Unlock()
	return l.regs, len(l.mrs)
}

type loopMR struct {
	l      *Loopback
	buf    []byte
	rkey   uint32
	access Access
}

// newKey returns an rkey no MR or window of l has, under f.mu.
func (l *Loopback) newKey() uint32 {
	for {
		var b [4]byte
		rand.Read(b[:])
		k := binary.LittleEndian.Uint32(b[:])
		_, mr := l.mrs[k]
		_, mw := l.mws[k]
		if k != 0 && !mr && !mw {
			return k
		}
	}
}

// Register implements Provider.
func (l *Loopback) Register(buf []byte, access Access) (MR, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("rdma: registering an empty buffer")
	}
	l.f.mu.Lock()
	defer l.f.mu.Unlock()
	m := &loopMR{l: l, buf: buf, rkey: l.newKey(), access: access}
	l.mrs[m.rkey] = m
	l.regs++
	return m, nil
}

// RegisterDevice implements Provider: the fabric reads host memory, so
// only memory that is (the stand-in's) registers.
func (l *Loopback) RegisterDevice(m DeviceMemory, off, n uint64, access Access) (MR, error) {
	b := m.HostBytes()
	if b == nil {
		return nil, fmt.Errorf("rdma: the loopback fabric reads host memory; device memory needs a NIC")
	}
	if off > uint64(len(b)) || n > uint64(len(b))-off {
		return nil, fmt.Errorf("rdma: registering %d octets at %d of %d", n, off, len(b))
	}
	return l.Register(b[off:off+n], access)
}

// loopWindow is a bound type 2 window: qp's peer may read n octets at
// addr of mr.
type loopWindow struct {
	mr      *loopMR
	qp      *loopQP
	addr, n uint64
	rkey    uint32
}

func (w *loopWindow) RKey() uint32 { return w.rkey }

func (w *loopWindow) Invalidate() error {
	f := w.qp.l.f
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(w.qp.l.mws, w.rkey)
	return nil
}

// Bind implements QP: the window lives until invalidated, or until this
// queue pair or the MR is gone.
func (q *loopQP) Bind(mr MR, addr, n uint64) (Window, error) {
	f := q.l.f
	f.mu.Lock()
	defer f.mu.Unlock()
	m, ok := mr.(*loopMR)
	if !ok || m.l != q.l || q.l.mrs[m.rkey] != m || m.access&AccessWindows == 0 {
		return nil, fmt.Errorf("rdma: binding a window over memory not registered for windows")
	}
	if f.qps[q.qpn] != q {
		return nil, ErrNotConnected
	}
	base := uint64(uintptr(unsafe.Pointer(&m.buf[0])))
	if addr < base || addr-base > uint64(len(m.buf)) || n > uint64(len(m.buf))-(addr-base) {
		return nil, fmt.Errorf("rdma: a window past its MR")
	}
	w := &loopWindow{mr: m, qp: q, addr: addr, n: n, rkey: q.l.newKey()}
	q.l.mws[w.rkey] = w
	return w, nil
}

// HasWindows implements Provider: the fabric has type 2 windows.
func (l *Loopback) HasWindows() bool { return true }

// Windows reports the windows bound on l now.
func (l *Loopback) Windows() int {
	l.f.mu.Lock()
	defer l.f.mu.Unlock()
	return len(l.mws)
}

func (m *loopMR) Region() Region {
	return Region{Addr: uint64(uintptr(unsafe.Pointer(&m.buf[0]))), RKey: m.rkey, Len: uint64(len(m.buf))}
}

func (m *loopMR) Close() error {
	m.l.f.mu.Lock()
	defer m.l.f.mu.Unlock()
	delete(m.l.mrs, m.rkey)
	return nil
}

type loopQP struct {
	l    *Loopback
	qpn  uint32
	psn  uint32
	peer *loopQP // under f.mu
	mu   sync.Mutex
}

// NewQP implements Provider.
func (l *Loopback) NewQP() (QP, error) {
	l.f.mu.Lock()
	defer l.f.mu.Unlock()
	l.f.qpns++
	var b [4]byte
	rand.Read(b[:])
	q := &loopQP{l: l, qpn: l.f.qpns & 0xffffff, psn: binary.LittleEndian.Uint32(b[:]) & 0xffffff}
	l.f.qps[q.qpn] = q
	return q, nil
}

func (q *loopQP) Endpoint() Endpoint {
	var gid [16]byte
	binary.BigEndian.PutUint16(gid[14:], q.l.lid)
	return Endpoint{LID: q.l.lid, QPN: q.qpn, PSN: q.psn, GID: gid}
}

func (q *loopQP) Connect(remote Endpoint) error {
	q.l.f.mu.Lock()
	defer q.l.f.mu.Unlock()
	p := q.l.f.qps[remote.QPN]
	if p == nil || p.l.lid != remote.LID || p.psn != remote.PSN {
		return fmt.Errorf("%w: no queue pair %v on the fabric", ErrNotConnected, remote)
	}
	q.peer = p
	return nil
}

// Read copies under the fabric's lock: the checks and the copy are one
// step, as a NIC's are against deregistration.
func (q *loopQP) Read(ctx context.Context, dst MR, off uint64, src Region) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	q.mu.Lock() // one outstanding read per queue pair, as the verbs path
	defer q.mu.Unlock()
	f := q.l.f
	f.mu.Lock()
	defer f.mu.Unlock()
	p := q.peer
	if p == nil || f.qps[p.qpn] != p || f.qps[q.qpn] != q || p.peer != q { // RC: each the other's peer
		return ErrNotConnected
	}
	d, ok := dst.(*loopMR)
	if !ok || d.l != q.l || q.l.mrs[d.rkey] != d {
		return fmt.Errorf("rdma: the destination is not registered on this provider")
	}
	if off > uint64(len(d.buf)) || src.Len > uint64(len(d.buf))-off {
		return ErrLocalLength
	}
	m, lo, hi := p.l.readable(p, src.RKey)
	if m == nil || src.Addr < lo || src.Addr > hi || src.Len > hi-src.Addr {
		return ErrRemoteAccess
	}
	base := uint64(uintptr(unsafe.Pointer(&m.buf[0])))
	copy(d.buf[off:off+src.Len], m.buf[src.Addr-base:])
	return nil
}

// readable returns the memory rkey lets the peer of l's queue pair via
// read, and its bounds [lo, hi), under f.mu: an MR registered for remote
// read, or a window bound through via over an MR still registered.
func (l *Loopback) readable(via *loopQP, rkey uint32) (m *loopMR, lo, hi uint64) {
	if m := l.mrs[rkey]; m != nil && m.access&AccessRemoteRead != 0 {
		lo = uint64(uintptr(unsafe.Pointer(&m.buf[0])))
		return m, lo, lo + uint64(len(m.buf))
	}
	if w := l.mws[rkey]; w != nil && w.qp == via && l.mrs[w.mr.rkey] == w.mr {
		return w.mr, w.addr, w.addr + w.n
	}
	return nil, 0, 0
}

// Close destroys the queue pair and the windows bound through it.
func (q *loopQP) Close() error {
	q.l.f.mu.Lock()
	defer q.l.f.mu.Unlock()
	delete(q.l.f.qps, q.qpn)
	for k, w := range q.l.mws {
		if w.qp == q {
			delete(q.l.mws, k)
		}
	}
	return nil
}

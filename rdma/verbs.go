//go:build rdma && cgo

package rdma

/*
#cgo LDFLAGS: -libverbs
#include <stdlib.h>
#include "../csrc/kvsp_verbs.h"
*/
import "C"

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// Enabled reports whether this build has the verbs provider.
const Enabled = true

// Verbs is the libibverbs provider on one device (port 1).
type Verbs struct {
	d    *C.kvsp_rdma_dev
	name string

	mwOnce sync.Once
	mwOK   bool
	mwMu   sync.Mutex
	mwIdle []unsafe.Pointer // invalidated windows, for reuse
	closed bool             // under mwMu
}

// OpenVerbs opens the device named name ("" : the first). On a machine
// without RDMA it says so (ErrNoDevice, with libibverbs' reason).
func OpenVerbs(name string) (*Verbs, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var msg [256]C.char
	d := C.kvsp_rdma_open(cname, &msg[0], C.size_t(len(msg)))
	if d == nil {
		return nil, fmt.Errorf("%w: %s", ErrNoDevice, C.GoString(&msg[0]))
	}
	return &Verbs{d: d, name: C.GoString(C.kvsp_rdma_name(d))}, nil
}

// Name implements Provider.
func (v *Verbs) Name() string { return v.name }

// Close implements Provider.
func (v *Verbs) Close() error {
	v.mwMu.Lock()
	for _, mw := range v.mwIdle {
		C.kvsp_rdma_mw_dealloc(mw)
	}
	v.mwIdle, v.closed = nil, true
	v.mwMu.Unlock()
	C.kvsp_rdma_close(v.d)
	return nil
}

type verbsMR struct {
	mr     unsafe.Pointer
	buf    []byte
	lkey   uint32
	region Region
	pin    runtime.Pinner // the buffer stays put while the NIC may touch it
}

// Register implements Provider: ibv_reg_mr over buf, pinned.
func (v *Verbs) Register(buf []byte, access Access) (MR, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("rdma: registering an empty buffer")
	}
	m := &verbsMR{buf: buf}
	m.pin.Pin(&buf[0])
	var lkey, rkey C.uint32_t
	var errno C.int
	m.mr = C.kvsp_rdma_reg(v.d, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), accessFlags(access), &lkey, &rkey, &errno)
	if m.mr == nil {
		m.pin.Unpin()
		return nil, fmt.Errorf("rdma: ibv_reg_mr of %d octets: %w", len(buf), syscall.Errno(errno))
	}
	m.lkey = uint32(lkey)
	m.region = Region{Addr: uint64(uintptr(unsafe.Pointer(&buf[0]))), RKey: uint32(rkey), Len: uint64(len(buf))}
	return m, nil
}

func accessFlags(a Access) C.int {
	var flags C.int
	if a&AccessRemoteRead != 0 {
		flags |= C.KVSP_RDMA_REMOTE_READ
	}
	if a&AccessWindows != 0 {
		flags |= C.KVSP_RDMA_MW_BIND
	}
	return flags
}

// RegisterDevice implements Provider: the stand-in's host memory as
// memory, an accelerator's through its dma-buf (ibv_reg_dmabuf_mr, with
// the device addresses as the region's: the NIC reads the GPU's memory).
// A device that cannot (no dma-buf support in the GPU driver or the NIC)
// says so; the holder then serves the block by GET.
func (v *Verbs) RegisterDevice(dm DeviceMemory, off, n uint64, access Access) (MR, error) {
	if off > uint64(dm.Len()) || n == 0 || n > uint64(dm.Len())-off {
		return nil, fmt.Errorf("rdma: registering %d octets at %d of %d of device memory", n, off, dm.Len())
	}
	if b := dm.HostBytes(); b != nil {
		return v.Register(b[off:off+n], access)
	}
	fd, at, _, err := dm.Dmabuf()
	if err != nil {
		return nil, fmt.Errorf("rdma: device memory for GPUDirect RDMA: %w", err)
	}
	defer syscall.Close(fd) // the MR holds its own reference to the dma-buf
	iova := dm.DevicePtr() + off
	var lkey, rkey C.uint32_t
	var errno C.int
	mr := C.kvsp_rdma_reg_dmabuf(v.d, C.int(fd), C.uint64_t(at+off), C.size_t(n), C.uint64_t(iova), accessFlags(access), &lkey, &rkey, &errno)
	if mr == nil {
		return nil, fmt.Errorf("rdma: ibv_reg_dmabuf_mr of %d octets of device memory: %w", n, syscall.Errno(errno))
	}
	return &verbsMR{mr: mr, lkey: uint32(lkey), region: Region{Addr: iova, RKey: uint32(rkey), Len: n}}, nil
}

func (m *verbsMR) Region() Region { return m.region }

func (m *verbsMR) Close() error {
	if m.mr == nil {
		return nil
	}
	rc := C.kvsp_rdma_dereg(m.mr)
	m.mr = nil
	m.pin.Unpin()
	if rc != 0 {
		return fmt.Errorf("rdma: ibv_dereg_mr: %w", syscall.Errno(rc))
	}
	return nil
}

type verbsQP struct {
	v  *Verbs
	q  *C.kvsp_rdma_qp
	mu sync.Mutex // one outstanding READ at a time
}

// NewQP implements Provider.
func (v *Verbs) NewQP() (QP, error) {
	var errno C.int
	q := C.kvsp_rdma_qp_create(v.d, &errno)
	if q == nil {
		return nil, fmt.Errorf("rdma: creating an RC queue pair: %w", syscall.Errno(errno))
	}
	return &verbsQP{v: v, q: q}, nil
}

func (q *verbsQP) Endpoint() Endpoint {
	var e Endpoint
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.q == nil {
		return e
	}
	var lid C.uint16_t
	var qpn, psn C.uint32_t
	C.kvsp_rdma_qp_endpoint(q.v.d, q.q, &lid, &qpn, &psn, (*C.uint8_t)(unsafe.Pointer(&e.GID[0])))
	e.LID, e.QPN, e.PSN = uint16(lid), uint32(qpn), uint32(psn)
	return e
}

func (q *verbsQP) Connect(r Endpoint) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.q == nil {
		return ErrNotConnected
	}
	if rc := C.kvsp_rdma_qp_connect(q.v.d, q.q, C.uint16_t(r.LID), C.uint32_t(r.QPN), C.uint32_t(r.PSN), (*C.uint8_t)(unsafe.Pointer(&r.GID[0]))); rc != 0 {
		return fmt.Errorf("%w: ibv_modify_qp to RTR/RTS: %v", ErrNotConnected, syscall.Errno(rc))
	}
	return nil
}

// completion statuses (enum ibv_wc_status) the transfer logic tells apart.
const (
	wcSuccess      = 0
	wcRemAccessErr = 10
)

// readTimeout bounds a posted READ: it cannot be withdrawn once posted,
// so a cancelled context still waits for its completion up to this.
const readTimeout = 30 * time.Second

func (q *verbsQP) Read(ctx context.Context, dst MR, off uint64, src Region) error {
	d, ok := dst.(*verbsMR)
	if !ok || d.mr == nil {
		return fmt.Errorf("rdma: the destination is not registered with verbs")
	}
	if off > uint64(len(d.buf)) || src.Len > uint64(len(d.buf))-off || src.Len > 1<<31 {
		return ErrLocalLength
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.q == nil {
		return ErrNotConnected
	}
	if rc := C.kvsp_rdma_read_post(q.q, unsafe.Pointer(&d.buf[off]), C.uint32_t(d.lkey), C.uint64_t(src.Addr), C.uint32_t(src.RKey), C.uint32_t(src.Len)); rc != 0 {
		return fmt.Errorf("rdma: ibv_post_send: %w", syscall.Errno(rc))
	}
	if err := q.complete("READ"); err != nil {
		return err
	}
	return ctx.Err()
}

// complete waits for the completion of the one work request posted on q
// (under q.mu).
func (q *verbsQP) complete(what string) error {
	deadline := time.Now().Add(readTimeout)
	for spins := 0; ; spins++ {
		var status C.int
		switch C.kvsp_rdma_poll(q.q, &status) {
		case 1:
			switch status {
			case wcSuccess:
				return nil
			case wcRemAccessErr:
				return ErrRemoteAccess
			default:
				return fmt.Errorf("rdma: %s completed with status %d (enum ibv_wc_status); the queue pair is in error", what, int(status))
			}
		case 0:
		default:
			return fmt.Errorf("rdma: ibv_poll_cq failed")
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("rdma: %s not completed after %v", what, readTimeout)
		}
		if spins > 1000 {
			time.Sleep(20 * time.Microsecond)
		} else {
			runtime.Gosched()
		}
	}
}

type verbsWindow struct {
	q    *verbsQP
	mw   unsafe.Pointer
	rkey uint32
	once sync.Once
	err  error
}

// Bind implements QP: a type 2 window from the device's free list (or
// newly allocated), bound through this pair's send queue.
func (q *verbsQP) Bind(mr MR, addr, n uint64) (Window, error) {
	m, ok := mr.(*verbsMR)
	if !ok || m.mr == nil {
		return nil, fmt.Errorf("rdma: binding a window over memory not registered with verbs")
	}
	if !q.v.windows() {
		return nil, ErrNoWindows
	}
	mw, err := q.v.allocWindow()
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.q == nil {
		q.v.freeWindow(mw, false)
		return nil, ErrNotConnected
	}
	var rkey C.uint32_t
	if rc := C.kvsp_rdma_mw_bind_post(q.q, mw, m.mr, C.uint64_t(addr), C.uint64_t(n), &rkey); rc != 0 {
		q.v.freeWindow(mw, false)
		return nil, fmt.Errorf("rdma: posting a window bind: %w", syscall.Errno(rc))
	}
	if err := q.complete("window bind"); err != nil {
		q.destroyLocked() // the bind may still be posted: the pair goes first
		q.v.freeWindow(mw, false)
		return nil, err
	}
	return &verbsWindow{q: q, mw: mw, rkey: uint32(rkey)}, nil
}

func (w *verbsWindow) RKey() uint32 { return w.rkey }

// Invalidate posts a local invalidate of the window's key and waits for
// it; a window whose invalidation failed is deallocated (which ends it),
// not reused.
func (w *verbsWindow) Invalidate() error {
	w.once.Do(func() {
		q := w.q
		q.mu.Lock()
		if q.q == nil {
			w.err = ErrNotConnected
		} else if rc := C.kvsp_rdma_inv_post(q.q, C.uint32_t(w.rkey)); rc != 0 {
			w.err = fmt.Errorf("rdma: posting a local invalidate: %w", syscall.Errno(rc))
		} else if w.err = q.complete("local invalidate"); w.err != nil {
			q.destroyLocked() // the invalidate may still be posted: the pair goes first
		}
		q.mu.Unlock()
		q.v.freeWindow(w.mw, w.err == nil)
	})
	return w.err
}

// maxIdleWindows bounds the invalidated windows a device keeps for reuse.
const maxIdleWindows = 1024

// HasWindows implements Provider (asked of the device once).
func (v *Verbs) HasWindows() bool { return v.windows() }

// windows reports (once) whether the device has type 2 windows.
func (v *Verbs) windows() bool {
	v.mwOnce.Do(func() { v.mwOK = C.kvsp_rdma_mw_supported(v.d) != 0 })
	return v.mwOK
}

func (v *Verbs) allocWindow() (unsafe.Pointer, error) {
	v.mwMu.Lock()
	if n := len(v.mwIdle); n > 0 {
		mw := v.mwIdle[n-1]
		v.mwIdle = v.mwIdle[:n-1]
		v.mwMu.Unlock()
		return mw, nil
	}
	v.mwMu.Unlock()
	var errno C.int
	mw := C.kvsp_rdma_mw_alloc(v.d, &errno)
	if mw == nil {
		return nil, fmt.Errorf("rdma: ibv_alloc_mw: %w", syscall.Errno(errno))
	}
	return mw, nil
}

// freeWindow keeps an unbound (invalidated or never bound) window for
// reuse, or deallocates it.
func (v *Verbs) freeWindow(mw unsafe.Pointer, reuse bool) {
	v.mwMu.Lock()
	if v.closed { // the device is gone, and its windows with it
		v.mwMu.Unlock()
		return
	}
	if reuse && len(v.mwIdle) < maxIdleWindows {
		v.mwIdle = append(v.mwIdle, mw)
		v.mwMu.Unlock()
		return
	}
	v.mwMu.Unlock()
	C.kvsp_rdma_mw_dealloc(mw)
}

// Close destroys the queue pair once no READ is posted on it (a read
// waiting for one finds it closed).
func (q *verbsQP) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.destroyLocked()
	return nil
}

// destroyLocked destroys the pair (under q.mu): work requests still
// posted are flushed, and the NIC no longer touches their memory.
func (q *verbsQP) destroyLocked() {
	if q.q != nil {
		C.kvsp_rdma_qp_destroy(q.q)
		q.q = nil
	}
}

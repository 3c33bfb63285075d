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
func (v *Verbs) Register(buf []byte, remoteRead bool) (MR, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("rdma: registering an empty buffer")
	}
	m := &verbsMR{buf: buf}
	m.pin.Pin(&buf[0])
	var lkey, rkey C.uint32_t
	var errno C.int
	rr := C.int(0)
	if remoteRead {
		rr = 1
	}
	m.mr = C.kvsp_rdma_reg(v.d, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), rr, &lkey, &rkey, &errno)
	if m.mr == nil {
		m.pin.Unpin()
		return nil, fmt.Errorf("rdma: ibv_reg_mr of %d octets: %w", len(buf), syscall.Errno(errno))
	}
	m.lkey = uint32(lkey)
	m.region = Region{Addr: uint64(uintptr(unsafe.Pointer(&buf[0]))), RKey: uint32(rkey), Len: uint64(len(buf))}
	return m, nil
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
	deadline := time.Now().Add(readTimeout)
	for spins := 0; ; spins++ {
		var status C.int
		switch C.kvsp_rdma_poll(q.q, &status) {
		case 1:
			switch status {
			case wcSuccess:
				return ctx.Err()
			case wcRemAccessErr:
				return ErrRemoteAccess
			default:
				return fmt.Errorf("rdma: READ completed with status %d (enum ibv_wc_status); the queue pair is in error", int(status))
			}
		case 0:
		default:
			return fmt.Errorf("rdma: ibv_poll_cq failed")
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("rdma: READ not completed after %v", readTimeout)
		}
		if spins > 1000 {
			time.Sleep(20 * time.Microsecond)
		} else {
			runtime.Gosched()
		}
	}
}

// Close destroys the queue pair once no READ is posted on it (a read
// waiting for one finds it closed).
func (q *verbsQP) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.q != nil {
		C.kvsp_rdma_qp_destroy(q.q)
		q.q = nil
	}
	return nil
}

package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

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
	local  string // its endpoint
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
	rq := &readerQP{q: q, local: q.Endpoint().String()}
	r.qp[holder] = rq
	return rq, nil
}

// Endpoint returns this side's endpoint for holder.
func (r *Reader) Endpoint(holder string) (string, error) {
	q, err := r.get(holder)
	if err != nil {
		return "", err
	}
	return q.local, nil
}

// Connect connects the queue pair of endpoint local (from Endpoint) for
// holder to remote, once. If that pair is gone meanwhile (a failed read
// dropped it), the holder's answer was for it: ErrNotConnected, and the
// next read starts over. A holder answering from another pair than before
// restarted: the pair is dropped, and the next read connects a new one.
func (r *Reader) Connect(holder, local, remote string) error {
	ep, err := ParseEndpoint(remote)
	if err != nil {
		return err
	}
	r.mu.Lock()
	q := r.qp[holder]
	switch {
	case q == nil || q.local != local:
		r.mu.Unlock()
		return fmt.Errorf("%w: the queue pair %s was dropped meanwhile", ErrNotConnected, local)
	case q.remote == remote:
		r.mu.Unlock()
		return nil
	case q.remote != "":
		delete(r.qp, holder)
		r.mu.Unlock()
		q.q.Close()
		return fmt.Errorf("%w: the holder answered from another queue pair (%s, was %s): it restarted", ErrNotConnected, remote, q.remote)
	}
	if err := q.q.Connect(ep); err != nil {
		r.mu.Unlock()
		r.forget(holder, q)
		return err
	}
	q.remote = remote
	r.mu.Unlock()
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

// Forget drops the queue pair for holder: the next Endpoint creates a new
// one.
func (r *Reader) Forget(holder string) { r.forget(holder, nil) }

// forget drops holder's queue pair if it is still q (nil: any), closing
// it outside the lock (a close waits for a read under way on it).
func (r *Reader) forget(holder string, q *readerQP) {
	r.mu.Lock()
	cur := r.qp[holder]
	if cur == nil || (q != nil && cur != q) {
		r.mu.Unlock()
		if q != nil {
			q.q.Close() // replaced meanwhile: still ours to end
		}
		return
	}
	delete(r.qp, holder)
	r.mu.Unlock()
	cur.q.Close()
}

// Close destroys the queue pairs and deregisters the pooled buffers.
func (r *Reader) Close() error {
	r.mu.Lock()
	qps := r.qp
	r.qp = map[string]*readerQP{}
	r.mu.Unlock()
	for _, q := range qps {
		q.q.Close()
	}
	r.bufs.close()
	return nil
}

package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// Target is a holder's side: one queue pair per client endpoint, and
// registrations of the octets it exposes. It satisfies holder.RDMA.
type Target struct {
	p   Provider
	mu  sync.Mutex
	qps map[string]QP // by the client's endpoint
}

// maxPeers bounds the queue pairs a target keeps (one per client
// endpoint); beyond it new clients are refused.
const maxPeers = 4096

// NewTarget returns a Target on p.
func NewTarget(p Provider) *Target { return &Target{p: p, qps: map[string]QP{}} }

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

// Expose registers buf for remote read until release.
func (t *Target) Expose(buf []byte) (addr uint64, rkey uint32, release func(), err error) {
	mr, err := t.p.Register(buf, true)
	if err != nil {
		return 0, 0, nil, err
	}
	r := mr.Region()
	var once sync.Once
	return r.Addr, r.RKey, func() { once.Do(func() { mr.Close() }) }, nil
}

// Close destroys the queue pairs.
func (t *Target) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	for k, q := range t.qps {
		errs = append(errs, q.Close())
		delete(t.qps, k)
	}
	return errors.Join(errs...)
}

// Reader is an instance's side: one queue pair per holder. It satisfies
// client.RDMAReader.
type Reader struct {
	p  Provider
	mu sync.Mutex
	qp map[string]*readerQP // by holder base URI
}

type readerQP struct {
	q      QP
	remote string // the holder endpoint it is connected to; "" before
}

// NewReader returns a Reader on p.
func NewReader(p Provider) *Reader { return &Reader{p: p, qp: map[string]*readerQP{}} }

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

// Read reads len(dst) octets at addr/rkey of holder into dst. dst is
// registered for the read and deregistered after.
func (r *Reader) Read(ctx context.Context, holder string, dst []byte, addr uint64, rkey uint32) error {
	q, err := r.get(holder)
	if err != nil {
		return err
	}
	mr, err := r.p.Register(dst, false)
	if err != nil {
		return err
	}
	defer mr.Close()
	return q.q.Read(ctx, mr, 0, Region{Addr: addr, RKey: rkey, Len: uint64(len(dst))})
}

// Forget drops the queue pair for holder (after it restarted): the next
// Endpoint creates a new one.
func (r *Reader) Forget(holder string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if q := r.qp[holder]; q != nil {
		q.q.Close()
		delete(r.qp, holder)
	}
}

// Close destroys the queue pairs.
func (r *Reader) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, q := range r.qp {
		q.q.Close()
		delete(r.qp, k)
	}
	return nil
}

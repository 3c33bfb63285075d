package holder

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/server"
)

// RDMA lets clients read blocks by one-sided RDMA READ (POST rdma/reads,
// a kvsp extension): the holder authorizes the request as a block GET,
// keeps the block and exposes its octets until the client is done (DELETE
// rdma/reads/{id}) or the exposure's TTL ends, and the client's queue
// pair reads them with no holder CPU in the data path: from host memory,
// and from the device tier's memory by GPUDirect RDMA. rdma.Target
// implements it (on verbs, or the in-process fabric).
type RDMA interface {
	// Accept returns the endpoint of this side's queue pair connected to
	// the client's endpoint. An error with an Invalid() method reporting
	// true is the client's (a 400); others are the holder's (503).
	Accept(client string) (string, error)
	// Expose lets the client (its endpoint, as given to Accept) read buf
	// until release. mem is the allocation buf lies in, which an
	// implementation may register once for all the blocks the holder
	// keeps in it over time (nil: memory of this read only).
	Expose(client string, mem, buf []byte) (addr uint64, rkey uint32, release func(), err error)
	// ExposeDevice lets the client read n octets at off of device memory
	// until release (GPUDirect RDMA).
	ExposeDevice(client string, mem DeviceMemory, off, n uint64) (addr uint64, rkey uint32, release func(), err error)
}

// DeviceMemory is device-tier memory as RDMA registers it (the same
// interface as rdma.DeviceMemory; tier.DeviceBuffer provides it).
type DeviceMemory = interface {
	DevicePtr() uint64
	HostBytes() []byte
	Dmabuf() (fd int, off, size uint64, err error)
	Len() int64
}

// RDMA exposure limits.
const (
	rdmaDefaultTTL = 10 * time.Second
	rdmaMaxTTL     = time.Minute
	// rdmaMaxPerClient bounds the exposures one identity holds at once.
	rdmaMaxPerClient = 256
)

// rdmaReads is the table of exposures: each holds its block (the
// store's acquire) and its registration until released or expired.
type rdmaReads struct {
	mu      sync.Mutex
	byID    map[string]*exposure
	byOwner map[string]int
}

type exposure struct {
	owner   string
	release func() // deregister, then let the store reuse the memory
	timer   *time.Timer
}

func newRDMAReads() *rdmaReads {
	return &rdmaReads{byID: map[string]*exposure{}, byOwner: map[string]int{}}
}

// add records an exposure for owner that ends after ttl; false when the
// owner holds too many.
func (t *rdmaReads) add(owner string, ttl time.Duration, release func()) (string, bool) {
	var b [16]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.byOwner[owner] >= rdmaMaxPerClient {
		return "", false
	}
	x := &exposure{owner: owner, release: release}
	t.byID[id] = x
	t.byOwner[owner]++
	x.timer = time.AfterFunc(ttl, func() { t.end(id, "") })
	return id, true
}

// end ends the exposure id (for owner, unless owner is ""): false when
// there is none of that owner's.
func (t *rdmaReads) end(id, owner string) bool {
	t.mu.Lock()
	x := t.byID[id]
	if x == nil || (owner != "" && x.owner != owner) {
		t.mu.Unlock()
		return false
	}
	delete(t.byID, id)
	if t.byOwner[x.owner]--; t.byOwner[x.owner] == 0 {
		delete(t.byOwner, x.owner)
	}
	t.mu.Unlock()
	x.timer.Stop()
	x.release()
	return true
}

// closeAll ends every exposure (the holder is closing).
func (t *rdmaReads) closeAll() {
	t.mu.Lock()
	ids := make([]string, 0, len(t.byID))
	for id := range t.byID {
		ids = append(ids, id)
	}
	t.mu.Unlock()
	for _, id := range ids {
		t.end(id, "")
	}
}

// mountRDMA adds POST rdma/reads and DELETE rdma/reads/{id}.
func (h *Holder) mountRDMA(r *server.Router) {
	anyone := []server.Role{server.RoleController, server.RoleIndex, server.RoleHolder, server.RoleInstance, server.RoleClient}
	r.Handle("POST", "rdma/reads", server.Route{Roles: anyone}, h.createRDMARead)
	r.Handle("DELETE", "rdma/reads/{id}", server.Route{Roles: anyone, MaxBody: -1}, h.deleteRDMARead)
}

func (h *Holder) createRDMARead(w http.ResponseWriter, r *http.Request) error {
	var q kvsp.RDMAReadRequest
	if err := server.DecodeJSON(r, &q); err != nil {
		return err
	}
	p := server.PrincipalFrom(r.Context())
	if !p.MayUseScope(q.ScopeID) { // before any probe (R-BLK-13, R-BLK-19)
		return fmt.Errorf("%w: block", kvsp.ErrScopeDenied)
	}
	g, err := h.geometry(q.CompatID)
	if err != nil {
		return err
	}
	e := h.store.get(blockID{q.CompatID, q.ScopeID, q.BlockKey})
	if e == nil {
		h.m.getMisses.Inc()
		return fmt.Errorf("%w: block", kvsp.ErrNotFound)
	}
	first, last := allLayers(g, &e.hdr)
	if q.Layers != nil {
		first, last = q.Layers[0], q.Layers[1]
	}
	if first < e.hdr.FirstLayer || last > e.hdr.LastLayer() {
		return fmt.Errorf("%w: layers %d-%d", kvsp.ErrLayersUnavailable, first, last)
	}
	ttl := rdmaDefaultTTL
	if q.TTLMs > 0 {
		ttl = min(kvsp.Millis(q.TTLMs), rdmaMaxTTL)
	}
	res, release, err := h.store.acquire(e, g)
	if err != nil {
		if errors.Is(err, errGone) {
			return err
		}
		return fmt.Errorf("%w: the stored block could not be read", kvsp.ErrUnavailable)
	}
	local, err := h.cfg.RDMA.Accept(q.Endpoint)
	if err != nil {
		release()
		var bad interface{ Invalid() bool }
		if errors.As(err, &bad) && bad.Invalid() {
			return fmt.Errorf("%w: endpoint: %v", kvsp.ErrInvalid, err)
		}
		return fmt.Errorf("%w: no queue pair for the endpoint: %v", kvsp.ErrUnavailable, err)
	}
	x, unexpose, err := h.exposeRange(q.Endpoint, e, res, first, last)
	if err != nil {
		release()
		return err
	}
	end := func() { unexpose(); release() }
	id, ok := h.rdma.add(p.ID, ttl, end)
	if !ok {
		end()
		return fmt.Errorf("%w: %d RDMA reads outstanding; DELETE finished ones", kvsp.ErrTooManyRequests, rdmaMaxPerClient)
	}
	n := x.Length
	for _, s := range x.More {
		n += s.Length
	}
	h.m.gets.Inc()
	h.m.served(res.where(), "rdma").Add(float64(n))
	x.ID, x.Endpoint, x.TTLMs = id, local, uint64(ttl/time.Millisecond)
	return server.WriteJSON(w, http.StatusCreated, x)
}

// exposeRange exposes layers first..last of a block to the client where
// they lie (its residence: one host segment, or a device segment for
// GPUDirect RDMA and a host one). It returns the answer without its id,
// endpoint and TTL, and what ends the exposure.
func (h *Holder) exposeRange(client string, e *entry, res residence, first, last uint32) (*kvsp.RDMAReadResponse, func(), error) {
	span := spanOf(e, first, last)
	body, err := res.body(span)
	if err != nil {
		return nil, nil, err
	}
	digest, err := e.rangeDigest(first, last, body.Digest)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: reading the block from device memory: %v", kvsp.ErrUnavailable, err)
	}
	segs, end, err := res.expose(h.cfg.RDMA, client, span)
	if err != nil {
		return nil, nil, err
	}
	x := &kvsp.RDMAReadResponse{Addr: segs[0].Addr, RKey: segs[0].RKey, Length: segs[0].Length, More: segs[1:],
		Header: hex.EncodeToString(span.headerBytes()), ReprDigest: container.ReprDigest(digest)}
	if len(x.More) == 0 {
		x.More = nil
	}
	return x, end, nil
}

func (h *Holder) deleteRDMARead(w http.ResponseWriter, r *http.Request) error {
	if !h.rdma.end(r.PathValue("id"), server.PrincipalFrom(r.Context()).ID) {
		return fmt.Errorf("%w: RDMA read", kvsp.ErrNotFound)
	}
	return server.NoContent(w)
}

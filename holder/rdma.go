package holder

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/server"
)

// RDMA lets clients read blocks in host memory by one-sided RDMA READ
// (POST rdma/reads, a kvsp extension): the holder authorizes the request
// as a block GET, keeps the block and registers its octets until the
// client is done (DELETE rdma/reads/{id}) or the exposure's TTL ends, and
// the client's queue pair reads them with no holder CPU in the data path.
// rdma.Target implements it (on verbs, or the in-process fabric).
type RDMA interface {
	// Accept returns the endpoint of this side's queue pair connected to
	// the client's endpoint.
	Accept(client string) (string, error)
	// Expose lets the client (its endpoint, as given to Accept) read buf
	// until release. mem is the allocation buf lies in, which an
	// implementation may register once for all the blocks the holder
	// keeps in it over time.
	Expose(client string, mem, buf []byte) (addr uint64, rkey uint32, release func(), err error)
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
	g, ok := h.cfg.Geometries[q.CompatID]
	if !ok {
		return fmt.Errorf("%w: this holder does not store compat_id %s", kvsp.ErrIncompatible, q.CompatID)
	}
	e := h.store.get(blockID{q.CompatID, q.ScopeID, q.BlockKey})
	if e == nil {
		h.m.getMisses.Inc()
		return fmt.Errorf("%w: block", kvsp.ErrNotFound)
	}
	first, last := uint32(0), g.Layers-1
	if q.Layers != nil {
		first, last = q.Layers[0], q.Layers[1]
	}
	if first < e.hdr.FirstLayer || last > e.hdr.LastLayer() {
		return fmt.Errorf("%w: layers %d-%d", kvsp.ErrLayersUnavailable, first, last)
	}
	ttl := rdmaDefaultTTL
	if q.TTLMs > 0 {
		ttl = min(time.Duration(q.TTLMs)*time.Millisecond, rdmaMaxTTL)
	}
	parts, release, err := h.store.acquire(e, g)
	if err != nil {
		if errors.Is(err, errGone) {
			return err
		}
		return fmt.Errorf("%w: the stored block could not be read", kvsp.ErrUnavailable)
	}
	if parts.blk == nil { // in device memory or an engine's pages
		release()
		return fmt.Errorf("%w: the block is not in host memory; GET it", kvsp.ErrUnavailable)
	}
	v, err := parts.blk.Range(first, last)
	if err != nil {
		release()
		return fmt.Errorf("%w: layers %d-%d", kvsp.ErrLayersUnavailable, first, last)
	}
	d, _ := e.rangeDigest(first, last, hostRange{v}.Digest)
	local, err := h.cfg.RDMA.Accept(q.Endpoint)
	if err != nil {
		release()
		return fmt.Errorf("%w: endpoint: %v", kvsp.ErrInvalid, err)
	}
	mem := parts.blk.Bytes()
	addr, rkey, unexpose, err := h.cfg.RDMA.Expose(q.Endpoint, mem[:cap(mem)], v.Data())
	if err != nil {
		release()
		return fmt.Errorf("%w: registering the block for RDMA: %v", kvsp.ErrUnavailable, err)
	}
	id, ok := h.rdma.add(p.ID, ttl, func() { unexpose(); release() })
	if !ok {
		unexpose()
		release()
		return fmt.Errorf("%w: %d RDMA reads outstanding; DELETE finished ones", kvsp.ErrTooManyRequests, rdmaMaxPerClient)
	}
	h.m.gets.Inc()
	h.m.bytesServed.WithLabelValues(string(parts.tier()), "rdma").Add(float64(len(v.Data())))
	return server.WriteJSON(w, http.StatusCreated, &kvsp.RDMAReadResponse{
		ID: id, Endpoint: local, Addr: strconv.FormatUint(addr, 16), RKey: rkey, Length: uint64(len(v.Data())),
		Header: hex.EncodeToString(v.AppendHeader(nil)), ReprDigest: container.ReprDigest(d), TTLMs: uint64(ttl / time.Millisecond),
	})
}

func (h *Holder) deleteRDMARead(w http.ResponseWriter, r *http.Request) error {
	if !h.rdma.end(r.PathValue("id"), server.PrincipalFrom(r.Context()).ID) {
		return fmt.Errorf("%w: RDMA read", kvsp.ErrNotFound)
	}
	return server.NoContent(w)
}

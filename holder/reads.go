package holder

import (
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// Memory held by block GETs (RELIABILITY B12). A GET of a block in the
// host tier sends the tier's own memory and holds nothing more, until the
// block is evicted or demoted while the GET still sends it: that memory
// is then held beyond the tier's capacity until the GET ends (the store's
// orphans). A GET of a block in local storage reads it back into memory of
// its own, and a GET that transcodes, or assembles a block from device
// memory, makes copies. All of it is held for as long as the client takes
// to read the response, which the server's minimum write rate bounds in
// time; readMemory bounds it in octets, per client: each client has an
// allowance (Config.MaxReadPerClient) of such memory. A GET whose copies
// do not fit in what is left of it is refused with 429 and Retry-After,
// before anything is read; a GET whose block is evicted while its client
// holds more than the allowance is cut (its response's write deadline set
// to now), so one client's stalled GETs never hold more than its
// allowance beyond the tier, and never take another client's share. GETs
// of blocks in the host tier take nothing from the allowance, so an
// instance prefetching many blocks from memory is never refused.
type readMemory struct {
	mu       sync.Mutex
	byClient map[string]int64
	each     int64
	copies   int64 // octets of copies held, all clients (the metric's "copy")
	m        *metrics
}

func newReadMemory(each int64, m *metrics) *readMemory {
	return &readMemory{byClient: map[string]int64{}, each: each, m: m}
}

// reader is one GET's account: what it holds beyond the tier, and how to
// cut it short.
type reader struct {
	rm     *readMemory
	client string
	rc     *http.ResponseController
	held   int64 // octets charged (under rm.mu)
	copies int64 // of which copies (the rest: evicted blocks)
	cut    bool  // under rm.mu

	mu    sync.Mutex // the cut's deadline against the GET's end
	ended bool       // done: the response is no longer the GET's to cut
}

// open starts client's GET, refused with 429 while the client holds more
// than its allowance (GETs of its being cut still finishing).
func (rm *readMemory) open(client string, w http.ResponseWriter) (*reader, error) {
	rm.mu.Lock()
	held := rm.byClient[client]
	rm.mu.Unlock()
	if held > rm.each {
		rm.m.getsRefused.Inc()
		return nil, rm.refusal(held)
	}
	return &reader{rm: rm, client: client, rc: http.NewResponseController(w)}, nil
}

func (rm *readMemory) refusal(held int64) error {
	return fmt.Errorf("%w: this client's block GETs under way hold %d octets of memory beyond the host tier, its allowance of %d; retry once they are done", kvsp.ErrTooManyRequests, held, rm.each)
}

// reserve takes n octets of copies for r, or refuses (429) past its
// client's allowance.
func (r *reader) reserve(n int64) error {
	rm := r.rm
	rm.mu.Lock()
	held := rm.byClient[r.client]
	if held+n > rm.each {
		rm.mu.Unlock()
		rm.m.getsRefused.Inc()
		return rm.refusal(held)
	}
	rm.byClient[r.client] = held + n
	rm.copies += n
	r.held += n
	r.copies += n
	rm.mu.Unlock()
	return nil
}

// evicted charges r with the n octets of its block, which left the tier
// while r sends it (store.mu held); past its client's allowance, r is cut.
func (r *reader) evicted(n int64) {
	rm := r.rm
	rm.mu.Lock()
	rm.byClient[r.client] += n
	r.held += n
	cut := rm.byClient[r.client] > rm.each && !r.cut
	r.cut = r.cut || cut
	rm.mu.Unlock()
	if cut {
		rm.m.getsCut.Inc()
		go r.cutNow()
	}
}

// cutNow makes the response's writes fail from now on, a write under way
// at once (its deadline, through the server's adapter), unless the GET
// has ended: a deadline set after it could fall on the next request of
// its HTTP/1.1 connection.
func (r *reader) cutNow() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.ended {
		r.rc.SetWriteDeadline(time.Now())
	}
}

// done gives back what r held (the GET has ended, its references too).
func (r *reader) done() {
	r.mu.Lock()
	r.ended = true
	r.mu.Unlock()
	rm := r.rm
	rm.mu.Lock()
	if rm.byClient[r.client] -= r.held; rm.byClient[r.client] <= 0 {
		delete(rm.byClient, r.client)
	}
	rm.copies -= r.copies
	r.held, r.copies = 0, 0
	rm.mu.Unlock()
}

// copied is the octets of copies GETs hold now.
func (rm *readMemory) copied() int64 {
	rm.mu.Lock()
	defer rm.mu.Unlock()
	return rm.copies
}

package holder

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// Body-rate defaults (RELIABILITY B8): a block body must arrive at
// MinBodyRate on average once BodyGrace has passed; slower (a stalled or
// trickling client holding its reservation) it is cut with 408.
const (
	DefaultMinBodyRate = 1 << 20 // octets per second
	DefaultBodyGrace   = time.Second
)

// errSlowBody cuts a body below the minimum rate.
var errSlowBody = kvsp.ErrRequestTimeout

// reservations are the octets of block PUTs being received, in all and per
// client: memory for a body is reserved before it is read, and one client
// may hold at most its share, so that stalled PUTs of one client cannot
// make every other client's valid PUT fail (B8).
type reservations struct {
	mu        sync.Mutex
	total     int64
	byClient  map[string]int64
	max, each int64
}

// reserve takes n octets for client: 429 beyond the client's share (its
// own doing), 503 beyond the holder's total.
func (r *reservations) reserve(client string, n int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.byClient[client]+n > r.each:
		return fmt.Errorf("%w: this client's block PUTs under way hold %d octets, its share of %d; retry once they are done", kvsp.ErrTooManyRequests, r.byClient[client], r.each)
	case r.total+n > r.max:
		return fmt.Errorf("%w: too many block octets being received; retry later", kvsp.ErrUnavailable)
	}
	r.total += n
	r.byClient[client] += n
	return nil
}

func (r *reservations) release(client string, n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.total -= n
	if r.byClient[client] -= n; r.byClient[client] <= 0 {
		delete(r.byClient, client)
	}
}

// minRateBody reads a request body that must keep up a minimum average
// rate after a grace period: before each read the body's read deadline is
// moved to when the octets read so far, and this read's, are due (through
// http.ResponseController, which every transport the holder serves
// supports: HTTP/1.1, HTTP/2, HTTP/3 and quicbulk). A read that passes its
// deadline ends the body with errSlowBody.
type minRateBody struct {
	r        io.Reader
	rc       *http.ResponseController
	start    time.Time
	grace    time.Duration
	rate     float64 // octets per second
	n        int64
	deadline time.Time
	enforced bool
}

func newMinRateBody(w http.ResponseWriter, r io.Reader, rate int64, grace time.Duration) *minRateBody {
	b := &minRateBody{r: r, rc: http.NewResponseController(w), start: time.Now(), grace: grace, rate: float64(rate), enforced: rate > 0}
	return b
}

func (b *minRateBody) Read(p []byte) (int, error) {
	if b.enforced {
		due := b.start.Add(b.grace + time.Duration(float64(b.n+int64(len(p)))/b.rate*float64(time.Second)))
		if due.After(b.deadline) {
			if err := b.rc.SetReadDeadline(due); err != nil {
				b.enforced = false // a writer without deadlines: the body is bounded by its size only
			} else {
				b.deadline = due
			}
		}
	}
	n, err := b.r.Read(p)
	b.n += int64(n)
	if err != nil && err != io.EOF && b.enforced && (errors.Is(err, os.ErrDeadlineExceeded) || !time.Now().Before(b.deadline)) {
		return n, fmt.Errorf("%w: the body arrived below the minimum rate of %d octets/s (%d octets in %v)", errSlowBody, int64(b.rate), b.n, time.Since(b.start).Round(time.Millisecond))
	}
	return n, err
}

// done clears the deadline, so the response can be sent and, on HTTP/1.1,
// the connection reused.
func (b *minRateBody) done() {
	if b.enforced {
		b.rc.SetReadDeadline(time.Time{})
	}
}

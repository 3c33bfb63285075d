// Package simnet is an in-memory network for the deterministic simulation
// (RELIABILITY DS1, F10): the real HTTP handlers of every role, reached
// through the real clients, with no socket in between, so a whole
// deployment runs inside a testing/synctest bubble on its fake clock.
//
// A Fabric maps host:port names to handlers. A client's Transport
// presents the identity of one certificate, as mutual TLS would (the
// request carries a TLS connection state with that peer certificate, so
// the servers authorize it by their policy exactly as over TLS). Requests
// and responses stream through pipes, so token streams and block bodies
// flow as they are written. A seeded fault plan drops requests (before
// they reach the server, or after it answered, so the client cannot tell),
// delays them, and takes hosts down (in-flight exchanges are cut) and back
// up: the crash and restart of a process.
package simnet

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// ErrRefused is a request to a host that is down or unknown.
var ErrRefused = errors.New("simnet: connection refused")

// ErrReset is a request lost to a fault.
var ErrReset = errors.New("simnet: connection reset")

// Faults are the message faults of a fabric.
type Faults struct {
	// Drop is the probability that a request is lost: half of the time
	// before it reaches the server, half after the server answered.
	Drop float64
	// Delay is the largest delay added before a request is delivered
	// (uniform in [0, Delay]).
	Delay time.Duration
}

// Fabric is an in-memory network.
type Fabric struct {
	mu     sync.Mutex
	hosts  map[string]*host
	rng    *rand.Rand
	faults Faults
	// Stats count what the fabric did.
	stats Stats
}

// Stats count requests and the faults injected.
type Stats struct {
	Requests, Dropped, Delayed, Refused, Cut int
}

type host struct {
	h      http.Handler
	ctx    context.Context // ended when the host goes down
	cancel context.CancelFunc
}

// New returns a fabric whose faults are drawn from seed.
func New(seed uint64) *Fabric {
	return &Fabric{hosts: map[string]*host{}, rng: rand.New(rand.NewPCG(seed, 0x51))}
}

// SetFaults changes the message faults.
func (f *Fabric) SetFaults(x Faults) {
	f.mu.Lock()
	f.faults = x
	f.mu.Unlock()
}

// Stats returns the counts so far.
func (f *Fabric) Stats() Stats {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stats
}

// Up serves h at hostport ("ii1.sim:443"), replacing what was there.
func (f *Fabric) Up(hostport string, h http.Handler) {
	ctx, cancel := context.WithCancel(context.Background())
	f.mu.Lock()
	old := f.hosts[hostport]
	f.hosts[hostport] = &host{h: h, ctx: ctx, cancel: cancel}
	f.mu.Unlock()
	if old != nil {
		old.cancel()
	}
}

// Down takes hostport off the network: new requests are refused and the
// exchanges in flight are cut, as when its process dies.
func (f *Fabric) Down(hostport string) {
	f.mu.Lock()
	old := f.hosts[hostport]
	delete(f.hosts, hostport)
	f.mu.Unlock()
	if old != nil {
		old.cancel()
	}
}

// Transport returns a round tripper whose requests present peer's
// identity. Close it when the process that uses it crashes: a dead
// process sends nothing more, whatever its goroutines were doing.
func (f *Fabric) Transport(peer *x509.Certificate) *Transport {
	ctx, cancel := context.WithCancel(context.Background())
	return &Transport{f: f, peer: peer, ctx: ctx, cancel: cancel}
}

// Transport is one process's side of the fabric.
type Transport struct {
	f      *Fabric
	peer   *x509.Certificate
	ctx    context.Context // ended by Close
	cancel context.CancelFunc
}

// Close cuts the process's exchanges in flight and refuses its new ones.
func (t *Transport) Close() error {
	t.cancel()
	return nil
}

// plan draws the fate of one request.
func (f *Fabric) plan(hostport string) (h *host, delay time.Duration, dropBefore, dropAfter bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stats.Requests++
	h = f.hosts[hostport]
	if h == nil {
		f.stats.Refused++
		return nil, 0, false, false
	}
	if f.faults.Delay > 0 {
		delay = time.Duration(f.rng.Int64N(int64(f.faults.Delay) + 1))
		f.stats.Delayed++
	}
	if f.faults.Drop > 0 && f.rng.Float64() < f.faults.Drop {
		f.stats.Dropped++
		if f.rng.IntN(2) == 0 {
			return h, delay, true, false
		}
		return h, delay, false, true
	}
	return h, delay, false, false
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	closeBody := func() {
		if req.Body != nil {
			req.Body.Close()
		}
	}
	if t.ctx.Err() != nil {
		closeBody()
		return nil, ErrRefused
	}
	h, delay, dropBefore, dropAfter := t.f.plan(req.URL.Host)
	if h == nil {
		closeBody()
		return nil, ErrRefused
	}
	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-req.Context().Done():
			closeBody()
			return nil, req.Context().Err()
		}
	}
	if dropBefore {
		closeBody()
		return nil, ErrReset
	}
	// The server's side of the exchange ends with the client's request,
	// the host, or the client closing the response body.
	ctx, cancel := context.WithCancel(req.Context())
	pr, pw := io.Pipe()
	stopHost := context.AfterFunc(h.ctx, func() { pw.CloseWithError(ErrReset); cancel() })
	stopSender := context.AfterFunc(t.ctx, func() { pw.CloseWithError(ErrReset); cancel() })
	stopReq := context.AfterFunc(req.Context(), func() { pw.CloseWithError(req.Context().Err()) })
	stop := func() { stopHost(); stopSender(); stopReq() }
	sreq := req.Clone(ctx)
	sreq.Proto, sreq.ProtoMajor, sreq.ProtoMinor = "HTTP/2.0", 2, 0
	sreq.RequestURI = req.URL.RequestURI()
	sreq.RemoteAddr = "simnet:1"
	sreq.Host = req.URL.Host
	sreq.TLS = &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true, NegotiatedProtocol: "h2", PeerCertificates: []*x509.Certificate{t.peer}}
	if sreq.Body == nil {
		sreq.Body = http.NoBody
	}
	w := &writer{hdr: http.Header{}, ready: make(chan struct{}), pw: pw}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			w.WriteHeader(http.StatusOK)
			pw.Close()
			if sreq.Body != nil {
				sreq.Body.Close()
			}
		}()
		defer func() {
			// A handler aborts a response it started (http.ErrAbortHandler):
			// the client sees the stream reset, as over HTTP/2.
			if r := recover(); r != nil {
				if r != http.ErrAbortHandler {
					panic(r)
				}
				pw.CloseWithError(ErrReset)
			}
		}()
		h.h.ServeHTTP(w, sreq)
	}()
	select {
	case <-w.ready:
	case <-ctx.Done():
		pr.CloseWithError(ErrReset)
		<-done
		cancel()
		stop()
		if req.Context().Err() != nil {
			return nil, req.Context().Err()
		}
		return nil, ErrReset
	}
	if dropAfter { // the server acted; the answer is lost
		pr.CloseWithError(ErrReset)
		cancel()
		<-done
		stop()
		return nil, ErrReset
	}
	body := &body{pr: pr, ctx: ctx, cancel: cancel, stop: stop, done: done}
	resp := &http.Response{Status: strconv.Itoa(w.status) + " " + http.StatusText(w.status), StatusCode: w.status, Proto: "HTTP/2.0", ProtoMajor: 2,
		Header: w.sent, Body: body, ContentLength: -1, Request: req}
	if n, err := strconv.ParseInt(w.sent.Get("Content-Length"), 10, 64); err == nil {
		resp.ContentLength = n
	}
	if req.Method == http.MethodHead {
		resp.Body.Close()
		resp.Body = http.NoBody
	}
	return resp, nil
}

// body is a response body: the handler's output, or the error that cut
// the exchange (the host went down: ErrReset).
type body struct {
	pr     *io.PipeReader
	ctx    context.Context
	cancel context.CancelFunc
	stop   func()
	done   chan struct{}
	once   sync.Once
}

func (b *body) Read(p []byte) (int, error) { return b.pr.Read(p) }

func (b *body) Close() error {
	b.once.Do(func() {
		b.pr.CloseWithError(io.ErrClosedPipe)
		b.cancel()
		<-b.done
		b.stop()
	})
	return nil
}

// writer is the server's http.ResponseWriter and http.Flusher.
type writer struct {
	mu     sync.Mutex
	hdr    http.Header
	sent   http.Header
	status int
	ready  chan struct{}
	pw     *io.PipeWriter
}

func (w *writer) Header() http.Header { return w.hdr }

func (w *writer) WriteHeader(code int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.sent != nil {
		return
	}
	w.status, w.sent = code, w.hdr.Clone()
	close(w.ready)
}

func (w *writer) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.pw.Write(p)
}

// Flush implements http.Flusher: written octets are already with the
// reader (the pipe holds nothing).
func (w *writer) Flush() { w.WriteHeader(http.StatusOK) }

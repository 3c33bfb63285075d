package quicbulk

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/kvsp/kvsp/internal/udpbuf"
)

// DefaultConfig is the QUIC configuration of bulk connections: stream
// windows that take a whole block without waiting for a window update
// (quic-go starts every stream at 512 KiB, which stalls each 2 MiB block
// a round trip per window), a connection window for 16 such streams, and
// room for 256 concurrent bulk streams. A server may give it to its whole
// QUIC listener: HTTP/3 works under it too.
func DefaultConfig() *quic.Config {
	return &quic.Config{
		InitialStreamReceiveWindow:     4 << 20,
		MaxStreamReceiveWindow:         16 << 20,
		InitialConnectionReceiveWindow: 32 << 20,
		MaxConnectionReceiveWindow:     128 << 20,
		MaxIncomingStreams:             256,
		// Unidirectional streams stay at quic-go's default: a server's
		// listener shares this configuration with HTTP/3, whose control
		// and QPACK streams are unidirectional.
		MaxIdleTimeout:  60 * time.Second,
		KeepAlivePeriod: 20 * time.Second,
	}
}

// Transport is an http.RoundTripper over bulk streams: one request per
// stream, over Conns QUIC connections per peer (round robin), all from
// one UDP socket. Only https URLs; the peer's UDP port is the URL's port.
type Transport struct {
	// TLS is the client configuration (certificate and roots); its
	// NextProtos is replaced by ALPN.
	TLS *tls.Config
	// Conns is the number of QUIC connections per peer; default 1. One
	// connection's congestion controller and pacer bound all its streams.
	Conns int
	// QUIC configures the connections; default DefaultConfig().
	QUIC *quic.Config
	// BufferSize is the UDP socket buffer asked for; default udpbuf's.
	BufferSize int
	// Logger; default: discard.
	Logger *slog.Logger

	once    sync.Once
	initErr error
	udp     *net.UDPConn
	tr      *quic.Transport
	report  udpbuf.Report
	tls     *tls.Config

	mu     sync.Mutex
	peers  map[string]*peer
	closed bool
}

type peer struct {
	next  atomic.Uint32
	slots []slot
}

type slot struct {
	mu   sync.Mutex
	conn *quic.Conn
}

// DialError is a failure to reach a peer's bulk endpoint (no UDP answer,
// a refused handshake, a peer that does not speak ALPN): the request was
// not sent. NotServed reports true, so callers can fall back to HTTPS.
type DialError struct {
	Addr string
	Err  error
}

func (e *DialError) Error() string { return "quicbulk: dialing " + e.Addr + ": " + e.Err.Error() }
func (e *DialError) Unwrap() error { return e.Err }

// NotServed reports that the request never reached the peer.
func (e *DialError) NotServed() bool { return true }

func (t *Transport) init() error {
	t.once.Do(func() {
		if t.TLS == nil {
			t.initErr = errors.New("quicbulk: TLS configuration required")
			return
		}
		t.tls = t.TLS.Clone()
		t.tls.NextProtos = []string{ALPN}
		t.tls.MinVersion = tls.VersionTLS13
		if t.QUIC == nil {
			t.QUIC = DefaultConfig()
		}
		if t.Logger == nil {
			t.Logger = slog.New(slog.DiscardHandler)
		}
		t.udp, t.report, t.initErr = udpbuf.Listen(":0", t.BufferSize)
		if t.initErr != nil {
			return
		}
		if t.report.Capped() {
			t.Logger.Warn("quicbulk: "+t.report.String(), "receive", t.report.Receive, "send", t.report.Send, "asked", t.report.Want)
		}
		t.tr = &quic.Transport{Conn: t.udp}
		t.peers = make(map[string]*peer)
	})
	return t.initErr
}

// BufferReport says what UDP socket buffers the kernel granted (after the
// first request).
func (t *Transport) BufferReport() udpbuf.Report { return t.report }

// Close closes every connection and the socket.
func (t *Transport) Close() error {
	t.mu.Lock()
	t.closed = true
	peers := t.peers
	t.peers = nil
	t.mu.Unlock()
	for _, p := range peers {
		for i := range p.slots {
			s := &p.slots[i]
			s.mu.Lock()
			if s.conn != nil {
				s.conn.CloseWithError(0, "")
			}
			s.mu.Unlock()
		}
	}
	if t.tr != nil {
		return t.tr.Close()
	}
	return nil
}

// conn returns a live connection to addr, dialing it when needed.
func (t *Transport) conn(ctx context.Context, addr string) (*quic.Conn, error) {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil, errors.New("quicbulk: transport closed")
	}
	p := t.peers[addr]
	if p == nil {
		p = &peer{slots: make([]slot, max(1, t.Conns))}
		t.peers[addr] = p
	}
	t.mu.Unlock()
	s := &p.slots[int(p.next.Add(1))%len(p.slots)]
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn != nil && s.conn.Context().Err() == nil {
		return s.conn, nil
	}
	ua, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return nil, &DialError{addr, err}
	}
	tc := t.tls
	if tc.ServerName == "" {
		tc = tc.Clone()
		tc.ServerName, _, _ = net.SplitHostPort(addr)
	}
	c, err := t.tr.Dial(ctx, ua, tc, t.QUIC)
	if err != nil {
		return nil, &DialError{addr, err}
	}
	s.conn = c
	return c, nil
}

// RoundTrip sends req on a new stream and returns the response once its
// head arrived; the body streams. It closes req.Body.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := t.roundTrip(req)
	if err != nil && req.Body != nil {
		req.Body.Close()
	}
	return resp, err
}

func (t *Transport) roundTrip(req *http.Request) (*http.Response, error) {
	if err := t.init(); err != nil {
		return nil, err
	}
	if req.URL.Scheme != "https" {
		return nil, fmt.Errorf("quicbulk: scheme %q: https only", req.URL.Scheme)
	}
	addr := req.URL.Host
	if req.URL.Port() == "" {
		addr = net.JoinHostPort(req.URL.Hostname(), "443")
	}
	ctx := req.Context()
	head := &Request{Method: req.Method, Target: req.URL.RequestURI(), Header: req.Header}
	hasBody := req.Body != nil && req.Body != http.NoBody
	if hasBody && req.ContentLength > 0 {
		head.Header = req.Header.Clone()
		head.Header.Set("Content-Length", strconv.FormatInt(req.ContentLength, 10))
	}
	hb, err := AppendRequest(nil, head)
	if err != nil {
		return nil, err
	}
	var str *quic.Stream
	for attempt := 0; ; attempt++ {
		conn, err := t.conn(ctx, addr)
		if err != nil {
			return nil, err
		}
		if str, err = conn.OpenStreamSync(ctx); err == nil {
			break
		}
		if ctx.Err() != nil || attempt == 1 {
			return nil, fmt.Errorf("quicbulk: opening a stream to %s: %w", addr, err)
		}
		// The connection died since its last use: dial again, once.
	}
	stop := context.AfterFunc(ctx, func() {
		str.CancelRead(CodeCancelled)
		str.CancelWrite(CodeCancelled)
	})
	fail := func(err error) (*http.Response, error) {
		stop()
		str.CancelRead(CodeCancelled)
		str.CancelWrite(CodeCancelled)
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, err
	}
	if _, err := str.Write(hb); err != nil {
		return fail(fmt.Errorf("quicbulk: sending the request to %s: %w", addr, err))
	}
	// The write side has one owner at a time: the body copy, then the
	// response body, which ends it (FIN) once the response is read.
	copied := make(chan bool, 1)
	if !hasBody {
		copied <- true
	} else {
		// The body goes while the answer is awaited: a server may answer
		// (412, 413) before reading it, and then stops the stream's read
		// side, which ends this copy.
		delimited := req.ContentLength > 0
		go func() {
			defer req.Body.Close()
			if _, err := io.Copy(str, req.Body); err != nil {
				str.CancelWrite(CodeCancelled)
				copied <- false
				return
			}
			if !delimited {
				str.Close() // the body ends at the FIN
			}
			copied <- delimited
		}()
	}
	rh, err := ReadResponse(str)
	if err != nil {
		return fail(fmt.Errorf("quicbulk: reading the response of %s: %w", addr, err))
	}
	resp := &http.Response{
		Status:        strconv.Itoa(rh.Status) + " " + http.StatusText(rh.Status),
		StatusCode:    rh.Status,
		Proto:         "KVSP-BULK/1",
		ProtoMajor:    1,
		Header:        rh.Header,
		ContentLength: -1,
		Body:          &responseBody{str: str, stop: stop, copied: copied},
		Request:       req,
	}
	if cl := rh.Header.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 {
			resp.ContentLength = n
		}
	}
	return resp, nil
}

// responseBody reads a response body up to the stream's FIN; a reset
// (CodeAborted) is an error, never an end.
type responseBody struct {
	str    *quic.Stream
	stop   func() bool
	copied chan bool // the request body's copy ended; true: FIN still to send
	eof    bool
	closed bool
}

func (b *responseBody) Read(p []byte) (int, error) {
	if b.closed {
		return 0, errors.New("quicbulk: read on a closed body")
	}
	n, err := b.str.Read(p)
	if err == io.EOF && !b.eof {
		b.eof = true
		b.stop()
		if <-b.copied {
			b.str.Close() // the whole response arrived: say so
		}
	}
	return n, err
}

// Close stops the rest of the body (STOP_SENDING) unless it was read.
func (b *responseBody) Close() error {
	if b.closed {
		return nil
	}
	b.closed = true
	b.stop()
	if !b.eof {
		b.str.CancelRead(CodeCancelled)
		b.str.CancelWrite(CodeCancelled)
	}
	return nil
}

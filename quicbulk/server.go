package quicbulk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/kvsp/kvsp"
)

// Server serves bulk streams of QUIC connections whose ALPN is ALPN,
// handing each to Handler as an HTTP request: the TLS state of the
// connection (the verified client chain) is the request's, so the
// handler authenticates and authorizes it as any HTTPS request.
type Server struct {
	// Handler serves the requests (a server.Server's Handler()).
	Handler http.Handler
	// ReadHeadTimeout bounds the wait for a stream's head; default 5s.
	ReadHeadTimeout time.Duration
	// Logger; default: discard.
	Logger *slog.Logger

	mu       sync.Mutex
	conns    map[*quic.Conn]*connState
	shutdown bool
}

type connState struct {
	active int           // streams being served
	idle   chan struct{} // closed when active drops to 0 during shutdown
}

// ServeQUICConn serves conn's streams until it closes.
func (s *Server) ServeQUICConn(conn *quic.Conn) error {
	if p := conn.ConnectionState().TLS.NegotiatedProtocol; p != ALPN {
		conn.CloseWithError(0x10, "not "+ALPN)
		return fmt.Errorf("quicbulk: connection with ALPN %q", p)
	}
	cs := &connState{}
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		conn.CloseWithError(0, "shutting down")
		return http.ErrServerClosed
	}
	if s.conns == nil {
		s.conns = make(map[*quic.Conn]*connState)
	}
	s.conns[conn] = cs
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, conn)
		s.mu.Unlock()
	}()
	for {
		str, err := conn.AcceptStream(conn.Context())
		if err != nil {
			return nil // the connection closed
		}
		s.mu.Lock()
		if s.shutdown {
			s.mu.Unlock()
			str.CancelRead(CodeShutdown)
			str.CancelWrite(CodeShutdown)
			continue
		}
		cs.active++
		s.mu.Unlock()
		go func() {
			defer s.streamDone(cs)
			s.serveStream(conn, str)
		}()
	}
}

func (s *Server) streamDone(cs *connState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cs.active--; cs.active == 0 && cs.idle != nil {
		close(cs.idle)
		cs.idle = nil
	}
}

// Shutdown refuses new streams (reset with CodeShutdown), lets the
// streams being served finish until ctx ends, then closes every
// connection.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.shutdown = true
	var waits []chan struct{}
	for _, cs := range s.conns {
		if cs.active > 0 {
			cs.idle = make(chan struct{})
			waits = append(waits, cs.idle)
		}
	}
	s.mu.Unlock()
	var err error
	for _, w := range waits {
		select {
		case <-w:
		case <-ctx.Done():
			err = ctx.Err()
		}
		if err != nil {
			break
		}
	}
	s.mu.Lock()
	for c := range s.conns {
		c.CloseWithError(0, "shutting down")
	}
	s.mu.Unlock()
	return err
}

func (s *Server) log() *slog.Logger {
	if s.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Logger
}

func (s *Server) serveStream(conn *quic.Conn, str *quic.Stream) {
	timeout := s.ReadHeadTimeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	str.SetReadDeadline(time.Now().Add(timeout))
	head, err := ReadRequest(str)
	str.SetReadDeadline(time.Time{})
	w := &responseWriter{str: str, header: make(http.Header)}
	if err != nil {
		if !errors.Is(err, errHead) { // cut, reset or slow: nothing to answer
			str.CancelRead(CodeBadHead)
			str.CancelWrite(CodeBadHead)
			return
		}
		// A client that passed the mutual-TLS handshake sent a head it
		// cannot have meant: say so, then close.
		str.CancelRead(CodeBadHead)
		w.problem(fmt.Errorf("%w: %v", kvsp.ErrInvalid, err))
		str.Close()
		return
	}
	u, err := url.ParseRequestURI(head.Target)
	if err != nil {
		str.CancelRead(CodeBadHead)
		w.problem(fmt.Errorf("%w: request target", kvsp.ErrInvalid))
		str.Close()
		return
	}
	tlsState := conn.ConnectionState().TLS
	req := &http.Request{
		Method:     head.Method,
		URL:        u,
		Proto:      "KVSP-BULK/1",
		ProtoMajor: 1,
		Header:     head.Header,
		Host:       tlsState.ServerName,
		RemoteAddr: conn.RemoteAddr().String(),
		RequestURI: head.Target,
		TLS:        &tlsState,
	}
	body := &requestBody{str: str, remaining: -1}
	switch cl := head.Header.Get("Content-Length"); {
	case cl != "":
		n, err := strconv.ParseInt(cl, 10, 64)
		if err != nil || n < 0 {
			str.CancelRead(CodeBadHead)
			w.problem(fmt.Errorf("%w: Content-Length", kvsp.ErrInvalid))
			str.Close()
			return
		}
		req.ContentLength, body.remaining = n, n
	case head.Method == http.MethodGet || head.Method == http.MethodHead || head.Method == http.MethodDelete:
		req.ContentLength, body.remaining = 0, 0
	default:
		req.ContentLength = -1 // up to the client's FIN
	}
	req.Body = body
	req = req.WithContext(str.Context())
	defer func() {
		if p := recover(); p != nil {
			// The handler gave up after its response started
			// (http.ErrAbortHandler) or failed: cut the stream so the
			// client cannot take a partial body for a whole one.
			if p != http.ErrAbortHandler {
				s.log().Error("quicbulk: handler panic", "panic", fmt.Sprint(p))
			}
			str.CancelWrite(CodeAborted)
			str.CancelRead(CodeAborted)
		}
	}()
	s.Handler.ServeHTTP(w, req)
	if !w.wroteHead {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		str.CancelWrite(CodeAborted)
		str.CancelRead(CodeCancelled)
		return
	}
	str.Close()
	// The client ends its side once it has read the whole response: wait
	// for that (bounded), so that a stream counted done is one the client
	// has, and Shutdown closes no connection under an answer in flight.
	// What the handler left of the request body is drained up to a
	// little, then refused.
	str.SetReadDeadline(time.Now().Add(finTimeout))
	if _, err := io.CopyN(io.Discard, str, 64<<10); err != io.EOF {
		str.CancelRead(CodeCancelled)
	}
}

// finTimeout bounds the wait for a client to finish reading a response.
const finTimeout = time.Minute

// requestBody is a request body on a stream: Content-Length octets
// (remaining >= 0), or up to the FIN.
type requestBody struct {
	str       *quic.Stream
	remaining int64
	done      bool
}

// The body of a request with Content-Length ends there; the client's FIN
// comes after the response (see serveStream).

func (b *requestBody) Read(p []byte) (int, error) {
	if b.done || b.remaining == 0 {
		b.done = true
		return 0, io.EOF
	}
	if b.remaining > 0 && int64(len(p)) > b.remaining {
		p = p[:b.remaining]
	}
	n, err := b.str.Read(p)
	if b.remaining > 0 {
		b.remaining -= int64(n)
		if b.remaining == 0 {
			b.done = true
			return n, nil
		}
		if err == io.EOF {
			err = io.ErrUnexpectedEOF // FIN before Content-Length
		}
	}
	if err == io.EOF {
		b.done = true
	}
	return n, err
}

func (b *requestBody) Close() error { return nil }

// responseWriter is an http.ResponseWriter on a stream. Body writes go
// straight to the stream (quic-go frames them from the caller's buffer).
type responseWriter struct {
	str       *quic.Stream
	header    http.Header
	wroteHead bool
	err       error
}

func (w *responseWriter) Header() http.Header { return w.header }

func (w *responseWriter) WriteHeader(code int) {
	if w.wroteHead || code < 200 { // informational answers are not sent
		return
	}
	w.wroteHead = true
	b, err := AppendResponse(nil, &Response{Status: code, Header: w.header})
	if err != nil {
		w.err = err
		return
	}
	if _, err := w.str.Write(b); err != nil {
		w.err = err
	}
}

func (w *responseWriter) Write(p []byte) (int, error) {
	if !w.wroteHead {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	n, err := w.str.Write(p)
	if err != nil {
		w.err = err
	}
	return n, err
}

// Flush is a no-op: stream data is sent as soon as flow control allows.
func (w *responseWriter) Flush() {}

// SetWriteDeadline bounds the response (http.ResponseController).
func (w *responseWriter) SetWriteDeadline(t time.Time) error { return w.str.SetWriteDeadline(t) }

// SetReadDeadline bounds the request body (http.ResponseController).
func (w *responseWriter) SetReadDeadline(t time.Time) error { return w.str.SetReadDeadline(t) }

// problem answers err as problem details (before any handler ran).
func (w *responseWriter) problem(err error) {
	p := kvsp.ProblemFor(err)
	body, merr := kvsp.MarshalProblem(p)
	if merr != nil {
		return
	}
	w.header.Set("Content-Type", kvsp.MediaTypeProblem)
	w.header.Set("Cache-Control", "no-store")
	w.header.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(p.Status)
	w.Write(body)
}

// Package h2 is an HTTP/2 server (RFC 9113) for net/http handlers, put
// in an http.Server as its TLSNextProto["h2"].
//
// It exists for the holder's block path. net/http's HTTP/2 server copies
// every DATA frame's payload into its framer's buffer, hands each write
// from the handler to the connection's serve goroutine and from there to
// a goroutine of its own, and writes through a 4 KiB buffer: measured on
// a holder serving 2 MiB blocks (make bench-holder), that copy alone was
// 15% of the server's CPU, and HTTP/2 cost the holder a third more CPU per
// GB than nginx. Here a handler writes its frames itself, under the
// connection's write lock, with no goroutine between it and the TLS
// connection: a DATA frame's header and the first octets of its payload
// fill one TLS record (16 KiB), the rest of the payload goes to the
// TLS connection from the handler's own memory in whole records, and
// frames are sized to whole records. A writer that lets go of the lock
// while another waits for it leaves its last part-record for that one to
// complete, so streams share records and system calls. Handlers run on
// worker goroutines that keep the stacks they grew (worker.go). The frames are read with golang.org/x/net/http2's Framer and
// its HPACK decoder (which bound header blocks and CONTINUATION runs);
// headers are encoded with its hpack package.
//
// Bounds: MAX_CONCURRENT_STREAMS handlers run at once per connection
// (streams reset by the client still count until their handler returns,
// so a rapid reset queues them; with 4x the limit queued the connection
// is not read until handlers make room, and ends with ENHANCE_YOUR_CALM
// when none do within 5 s); the client's flow-control
// windows hold what a connection buffers; control frames the client
// provokes (PING, SETTINGS, RST_STREAM answers) are queued up to a bound
// past which the connection is closed; an idle connection is closed after
// the idle timeout, and every write has a deadline: the connection's
// (WriteTimeout) for what it writes to the socket, and a stream's
// (http.ResponseController.SetWriteDeadline) for its waits for window and
// for the write lock, past which the stream is reset (CANCEL) and its
// handler's context ends; a frame is never cut half written.
package h2

import (
	"context"
	"crypto/tls"
	"net/http"
	"sync"
	"time"
)

// Config configures a Server. Zero values take the defaults.
type Config struct {
	// MaxConcurrentStreams is SETTINGS_MAX_CONCURRENT_STREAMS, and the
	// number of handlers that run at once per connection; default 250.
	MaxConcurrentStreams uint32
	// MaxReadFrameSize is SETTINGS_MAX_FRAME_SIZE: the largest frame
	// the client may send; default 1 MiB.
	MaxReadFrameSize uint32
	// StreamWindow and ConnWindow are the flow-control windows the
	// client may fill per stream and per connection (request bodies);
	// default 3 MiB each, so a block PUT is not throttled by 64 KiB
	// windows.
	StreamWindow, ConnWindow uint32
	// MaxHeaderBytes bounds a request's header list (decoded); default:
	// the http.Server's MaxHeaderBytes, or 1 MiB.
	MaxHeaderBytes int
	// IdleTimeout closes a connection without streams; default: the
	// http.Server's IdleTimeout, or 120 s.
	IdleTimeout time.Duration
	// PrefaceTimeout bounds the time from the handshake to the client's
	// preface and first SETTINGS; default: the http.Server's
	// ReadHeaderTimeout, or 10 s.
	PrefaceTimeout time.Duration
	// QueueWait is how long a connection whose handler queue is full
	// (4x MaxConcurrentStreams) goes unread waiting for room before it
	// ends with ENHANCE_YOUR_CALM; default 5 s.
	QueueWait time.Duration
	// WriteTimeout bounds a write to the connection that has no stream
	// deadline of its own (control frames, responses of routes without
	// one): a client that stops reading loses its connection after it;
	// default: the idle timeout.
	WriteTimeout time.Duration
}

const (
	defaultMaxStreams   = 250
	defaultFrameSize    = 1 << 20
	defaultWindow       = 3 << 20
	maxQueuedControl    = 10000 // control frames queued for a client that does not read
	handlerQueueFactor  = 4     // queued handlers per MAX_CONCURRENT_STREAMS before reading pauses
	recordPayload       = 16 << 10
	goAwayReadAllowance = 64 << 10 // octets read (and dropped) after a GOAWAY for an error
	goAwayLinger        = time.Second
)

// Server serves HTTP/2 connections.
type Server struct {
	cfg Config

	mu       sync.Mutex
	conns    map[*conn]struct{}
	shutdown bool
}

// New returns a Server.
func New(cfg Config) *Server {
	return &Server{cfg: cfg, conns: map[*conn]struct{}{}}
}

// Configure makes s the HTTP/2 server of hs: TLSNextProto["h2"], and a
// graceful GOAWAY to every connection when hs shuts down. hs's TLS
// configuration must offer "h2" in NextProtos.
func (s *Server) Configure(hs *http.Server) {
	if hs.TLSNextProto == nil {
		hs.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){}
	}
	hs.TLSNextProto["h2"] = s.ServeConn
	hs.RegisterOnShutdown(s.startShutdown)
}

// ServeConn serves one connection whose TLS handshake negotiated h2,
// until it ends. h is net/http's handler for the connection (it carries
// the connection's base context).
func (s *Server) ServeConn(hs *http.Server, tc *tls.Conn, h http.Handler) {
	c := newConn(s, hs, tc, h)
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		tc.NetConn().Close()
		return
	}
	s.conns[c] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
	}()
	c.serve()
}

// startShutdown sends every connection a GOAWAY: each finishes the
// streams under way and closes.
func (s *Server) startShutdown() {
	s.mu.Lock()
	s.shutdown = true
	conns := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		c.goAwayGracefully()
	}
}

func (c *Config) withDefaults(hs *http.Server) Config {
	out := *c
	if out.MaxConcurrentStreams == 0 {
		out.MaxConcurrentStreams = defaultMaxStreams
	}
	if out.MaxReadFrameSize == 0 {
		out.MaxReadFrameSize = defaultFrameSize
	}
	out.MaxReadFrameSize = min(max(out.MaxReadFrameSize, 16<<10), 1<<24-1)
	if out.StreamWindow == 0 {
		out.StreamWindow = defaultWindow
	}
	if out.ConnWindow == 0 {
		out.ConnWindow = defaultWindow
	}
	out.StreamWindow = min(max(out.StreamWindow, 65535), 1<<31-1)
	out.ConnWindow = min(max(out.ConnWindow, 65535), 1<<31-1)
	if out.MaxHeaderBytes == 0 {
		out.MaxHeaderBytes = hs.MaxHeaderBytes
	}
	if out.MaxHeaderBytes <= 0 {
		out.MaxHeaderBytes = 1 << 20
	}
	if out.IdleTimeout == 0 {
		out.IdleTimeout = hs.IdleTimeout
	}
	if out.IdleTimeout <= 0 {
		out.IdleTimeout = 120 * time.Second
	}
	if out.PrefaceTimeout == 0 {
		out.PrefaceTimeout = hs.ReadHeaderTimeout
	}
	if out.PrefaceTimeout <= 0 {
		out.PrefaceTimeout = 10 * time.Second
	}
	if out.WriteTimeout == 0 {
		out.WriteTimeout = out.IdleTimeout
	}
	if out.QueueWait <= 0 {
		out.QueueWait = 5 * time.Second
	}
	return out
}

// baseContexter is net/http's handler for a TLSNextProto connection: it
// carries the connection's context (http.Server.ConnContext applied).
type baseContexter interface {
	BaseContext() context.Context
}

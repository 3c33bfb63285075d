package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/h2"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/sockio"
	"github.com/kvsp/kvsp/internal/udpbuf"
)

// Config configures a Server. Validate runs first, then defaults fill the
// zero values (STYLE rule 8).
type Config struct {
	// Credentials are this process's certificate and client CA bundle.
	Credentials *mtls.Credentials
	// Policy is the current authorization policy.
	Policy *PolicyStore
	// HTTP3 also serves HTTP/3 over QUIC on the same port (UDP) and
	// advertises it with Alt-Svc.
	HTTP3 bool
	// QUIC serves other application protocols on the same UDP port,
	// by ALPN (the bulk path's "kvsp-bulk/1"): each connection that
	// negotiates one is handed to its handler.
	QUIC map[string]QUICHandler
	// QUICConfig configures the QUIC listener (HTTP/3 and QUIC); nil:
	// quic-go's defaults.
	QUICConfig *quic.Config
	// UDPBuffer is the UDP socket buffer asked for (internal/udpbuf);
	// what the kernel grants is logged when it is less.
	UDPBuffer int
	// ReadHeaderTimeout cuts off clients that send headers too slowly
	// (slowloris); default 5s.
	ReadHeaderTimeout time.Duration
	// IdleTimeout closes idle keep-alive connections; default 120s.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds request headers; default 64 KiB.
	MaxHeaderBytes int
	// MinWriteRate is the rate, in octets per second, at which a client
	// must read every response once WriteGrace has passed (RELIABILITY
	// B11): the time a response's writes wait for their reader (for HTTP/2
	// window, the socket) may not exceed WriteGrace plus the time their
	// octets take at this rate; time the handler spends producing between
	// writes does not count. A response that falls behind is cut (its
	// HTTP/2 or HTTP/3 stream reset, its HTTP/1.1 connection closed) and
	// its handler's context ends (ErrSlowReader). Defaults
	// DefaultMinWriteRate and DefaultWriteGrace; a negative rate turns
	// it off. A route's Timeout still bounds its response as a whole.
	MinWriteRate int64
	WriteGrace   time.Duration
	// Logger receives one line per request; default: discard.
	Logger *slog.Logger
	// Registerer receives the HTTP metrics; nil: not registered.
	Registerer prometheus.Registerer
	// NetHTTP2 serves HTTP/2 with net/http's server rather than the
	// project's (internal/h2, which writes block bodies without copying
	// them): for comparison in benchmarks, and as a way back.
	NetHTTP2 bool
	// PlainSockets reads and writes TCP connections with net.TCPConn's own
	// Read and Write rather than internal/sockio's raw system calls (which
	// keep the Go runtime's monitor thread asleep while blocks stream):
	// for comparison in benchmarks, and as a way back.
	PlainSockets bool
	// Now is the clock requests are authenticated against (a client
	// certificate's validity, checked on every request); default
	// time.Now.
	Now func() time.Time
}

// QUICHandler serves the QUIC connections of one application protocol.
type QUICHandler interface {
	// ServeQUICConn serves conn until it closes.
	ServeQUICConn(conn *quic.Conn) error
	// Shutdown lets the requests under way finish until ctx ends.
	Shutdown(ctx context.Context) error
}

// Validate reports the first missing or bad field.
func (c *Config) Validate() error {
	switch {
	case c.Credentials == nil:
		return errors.New("server: tls: credentials required")
	case c.Policy == nil || c.Policy.Policy() == nil:
		return errors.New("server: policy required")
	case c.QUIC[http3.NextProtoH3] != nil:
		return errors.New("server: quic: h3 is the HTTP3 option's")
	case c.ReadHeaderTimeout < 0 || c.IdleTimeout < 0 || c.MaxHeaderBytes < 0 || c.WriteGrace < 0:
		return errors.New("server: negative timeout or limit")
	}
	return nil
}

// Write-rate defaults (RELIABILITY B11). The rate is the one a holder asks
// of a block PUT's body (holder.DefaultMinBodyRate): a reader is held to
// what a writer is. It applies to each response, so it must hold for a
// client that splits a slow link among many streams: 16 block GETs at
// once at 1 MiB/s each take 134 Mbit/s, far below the links KV caches
// travel on. The grace is longer than a body's (1 s): it absorbs a reader's
// pauses (a collection, TCP's backoff after losses, a client reading its
// streams one after another through a shared connection window) and is
// how long a client that reads nothing holds its handler: a zero-window
// stream waiting on a 2 MiB block is cut after 5 s + 2 s.
const (
	DefaultMinWriteRate = 1 << 20 // octets per second
	DefaultWriteGrace   = 5 * time.Second
)

func (c *Config) populate() {
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = 5 * time.Second
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = 120 * time.Second
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	if c.MinWriteRate == 0 {
		c.MinWriteRate = DefaultMinWriteRate
	}
	if c.WriteGrace == 0 {
		c.WriteGrace = DefaultWriteGrace
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Server serves the routes of the roles a process hosts, each under its own
// base path, on one listener.
type Server struct {
	cfg     Config
	log     *slog.Logger
	policy  *PolicyStore
	mux     *http.ServeMux
	metrics *metrics
	hs      *http.Server
	h3      *http3.Server
	quicLn  *quic.Listener
	quicTr  *quic.Transport
	altSvc  string
	now     func() time.Time
	logs    *limiter // floods of one kind of line

	mu      sync.Mutex
	methods map[string][]string // path pattern -> registered methods
}

// New returns a Server; routes are added with Mount before Serve.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.populate()
	s := &Server{
		cfg:     cfg,
		log:     cfg.Logger,
		policy:  cfg.Policy,
		mux:     http.NewServeMux(),
		metrics: newMetrics(cfg.Registerer),
		methods: make(map[string][]string),
		now:     cfg.Now,
		logs:    newLimiter(time.Now),
	}
	// Anything no role serves: 404 problem, after authentication.
	// Whatever its body (never read): 404, not 413.
	s.mux.Handle("/", s.wrap("/", Route{}, func(w http.ResponseWriter, r *http.Request) error {
		// Not a KVSP resource, so not kvsp-not-found (which names blocks,
		// leases, sessions and directives).
		return &kvsp.Problem{Type: "about:blank", Title: "Not Found", Status: http.StatusNotFound, Detail: "no such resource"}
	}))
	tlsConf := mtls.ServerTLSConfig(cfg.Credentials)
	s.hs = &http.Server{
		Handler:           s.mux,
		TLSConfig:         tlsConf,
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		ErrorLog:          log.New(errorLog{s}, "", 0),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey, c)
		},
		// No WriteTimeout: block streams take as long as their size needs;
		// routes set their own deadlines (Route.Timeout).
		// Bulk-friendly HTTP/2: large frames and flow-control windows, so a
		// 2 MiB block is not throttled by 64 KiB windows (PUTs read by us).
		HTTP2: bulkHTTP2(),
	}
	if !cfg.NetHTTP2 {
		// The same windows and frame size as bulkHTTP2.
		h2c := h2.Config{MaxReadFrameSize: 1 << 20, StreamWindow: 3 << 20, ConnWindow: 3 << 20}
		if cfg.MinWriteRate > 0 {
			// The socket's deadline, under every stream's: what one lock
			// holder writes (a frame of up to 1 MiB, as kvsp's clients
			// allow) keeps up the rate too, or the connection, whose
			// client reads none of its streams, ends. internal/h2 moves
			// it when half is left: at least grace plus a frame's time.
			h2c.WriteTimeout = 2 * (cfg.WriteGrace + time.Duration(float64(1<<20)/float64(cfg.MinWriteRate)*float64(time.Second)))
		}
		h2.New(h2c).Configure(s.hs)
	}
	if cfg.HTTP3 {
		s.h3 = &http3.Server{
			Handler:        s.mux,
			TLSConfig:      http3.ConfigureTLSConfig(tlsConf.Clone()),
			MaxHeaderBytes: cfg.MaxHeaderBytes,
			IdleTimeout:    cfg.IdleTimeout,
		}
	}
	return s, nil
}

// bulkHTTP2 is the HTTP/2 configuration of a KVSP server: 1 MiB frames
// and 3 MiB flow-control windows (the most net/http takes is just under
// 4 MiB), so a block PUT is not throttled by 64 KiB windows. The client
// package sets the same for the GETs it receives.
func bulkHTTP2() *http.HTTP2Config {
	return &http.HTTP2Config{MaxReadFrameSize: 1 << 20, MaxReceiveBufferPerConnection: 3 << 20, MaxReceiveBufferPerStream: 3 << 20}
}

// Router adds the routes of one role under its base path.
type Router struct {
	s    *Server
	base string
}

// Mount returns the Router of the role whose base URI has path base (for
// example "/is/" for https://host:8443/is/). The spec defines no path
// prefix: everything is relative to the base (R-HTTP-2, R-HTTP-3).
func (s *Server) Mount(base string) *Router {
	if !strings.HasPrefix(base, "/") {
		base = "/" + base
	}
	if !strings.HasSuffix(base, "/") {
		base += "/"
	}
	return &Router{s: s, base: base}
}

// Policy returns the server's policy store: a role that decides what to
// send to whom (the PC placing a scope's requests) reads it there.
func (r *Router) Policy() *PolicyStore { return r.s.policy }

// Handle adds a route: method and a path relative to the base, with
// ServeMux wildcards ("replicas/{holder}/{key}"). Other methods on the same
// path get 405 with Allow (R-HTTP-1).
func (r *Router) Handle(method, path string, rt Route, h HandlerFunc) {
	full := r.base + strings.TrimPrefix(path, "/")
	pattern := method + " " + full
	r.s.mux.Handle(pattern, r.s.wrap(pattern, rt, h))
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	ms, seen := r.s.methods[full]
	ms = append(ms, method)
	slices.Sort(ms)
	r.s.methods[full] = ms
	if !seen {
		// Any other method is 405, whatever its body (never read: the
		// default limit only bounds what a handler would read).
		r.s.mux.Handle(full, r.s.wrap(full, Route{}, func(w http.ResponseWriter, req *http.Request) error {
			r.s.mu.Lock()
			allow := strings.Join(r.s.methods[full], ", ")
			r.s.mu.Unlock()
			w.Header().Set("Allow", allow)
			return fmt.Errorf("%w: allowed: %s", kvsp.ErrMethodNotAllowed, allow)
		}))
	}
}

// Routes returns every route mounted, "METHOD /base/path" with ServeMux
// wildcards, sorted (the catch-all and the 405 answers of each path are
// not routes): what api/openapi.yaml must describe, and only that.
func (s *Server) Routes() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for path, ms := range s.methods {
		for _, m := range ms {
			out = append(out, m+" "+path)
		}
	}
	slices.Sort(out)
	return out
}

// Handler returns the server's handler, for tests that bring their own
// listener (httptest).
func (s *Server) Handler() http.Handler { return s.mux }

// TLSConfig returns the listener's TLS configuration.
func (s *Server) TLSConfig() *tls.Config { return s.hs.TLSConfig }

// Serve accepts TCP connections on ln (and, with HTTP3 or QUIC handlers,
// QUIC on the same port over UDP, dispatched by ALPN) until Shutdown. It
// returns nil after a clean shutdown.
func (s *Server) Serve(ln net.Listener) error {
	errc := make(chan error, 2)
	if s.h3 != nil || len(s.cfg.QUIC) > 0 {
		addr := ln.Addr().(*net.TCPAddr)
		udp, report, err := udpbuf.Listen(net.JoinHostPort(addr.IP.String(), strconv.Itoa(addr.Port)), s.cfg.UDPBuffer)
		if err != nil {
			return fmt.Errorf("server: quic: %w", err)
		}
		if report.Capped() {
			s.log.Warn("server: "+report.String(), "receive", report.Receive, "send", report.Send, "asked", report.Want)
		}
		tc := s.hs.TLSConfig.Clone()
		tc.NextProtos = nil
		if s.h3 != nil {
			tc.NextProtos = append(tc.NextProtos, http3.NextProtoH3)
			s.altSvc = `h3=":` + strconv.Itoa(addr.Port) + `"; ma=86400`
		}
		for p := range s.cfg.QUIC {
			tc.NextProtos = append(tc.NextProtos, p)
		}
		slices.Sort(tc.NextProtos)
		qc := s.cfg.QUICConfig
		if qc == nil {
			qc = &quic.Config{}
		}
		tr := &quic.Transport{Conn: udp}
		qln, err := tr.Listen(tc, qc)
		if err != nil {
			udp.Close()
			return fmt.Errorf("server: quic: %w", err)
		}
		s.mu.Lock()
		s.quicLn, s.quicTr = qln, tr
		s.mu.Unlock()
		go func() { errc <- s.serveQUIC(qln) }()
	}
	if !s.cfg.PlainSockets {
		ln = sockio.Listener{Listener: ln}
	}
	go func() { errc <- s.hs.Serve(tls.NewListener(ln, s.hs.TLSConfig)) }()
	err := <-errc
	if errors.Is(err, http.ErrServerClosed) || errors.Is(err, quic.ErrServerClosed) {
		return nil
	}
	return err
}

// serveQUIC hands each QUIC connection to HTTP/3 or the handler of its
// ALPN.
func (s *Server) serveQUIC(ln *quic.Listener) error {
	for {
		conn, err := ln.Accept(context.Background())
		if err != nil {
			return err
		}
		p := conn.ConnectionState().TLS.NegotiatedProtocol
		if p == http3.NextProtoH3 && s.h3 != nil {
			go s.h3.ServeQUICConn(conn)
		} else if h := s.cfg.QUIC[p]; h != nil {
			go h.ServeQUICConn(conn)
		} else {
			conn.CloseWithError(0x10, "no application protocol")
		}
	}
}

// Shutdown stops accepting, lets in-flight requests (block streams
// included) finish until ctx ends, then closes.
func (s *Server) Shutdown(ctx context.Context) error {
	var errs []error
	s.mu.Lock()
	qln, qtr := s.quicLn, s.quicTr
	s.mu.Unlock()
	if qln != nil {
		qln.Close()
	}
	if s.h3 != nil {
		errs = append(errs, s.h3.Shutdown(ctx))
	}
	for _, h := range s.cfg.QUIC {
		errs = append(errs, h.Shutdown(ctx))
	}
	if qtr != nil {
		qtr.Close() // the connections left, and the UDP socket
	}
	errs = append(errs, s.hs.Shutdown(ctx))
	return errors.Join(errs...)
}

// Package client holds the typed HTTPS clients of the four KVSP roles: the
// Index Service, holders, the Placement Controller and inference instances
// (spec section "HTTP Usage" and the resource table). One Client shares one
// mutual-TLS transport (HTTP/2 with connection reuse, HTTP/3 optional)
// among all of them. Problem details come back as the kvsp sentinel errors
// (errors.Is(err, kvsp.ErrStaleEpoch)); requests are retried only where
// the method is idempotent.
package client

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/sockio"
)

// Config configures a Client.
type Config struct {
	// TLS is the client TLS configuration: this process's certificate and
	// the CA bundle of its peers (see internal/mtls.ClientTLSConfig).
	TLS *tls.Config
	// HTTP3 sends requests over HTTP/3 (QUIC) instead of HTTP/2.
	HTTP3 bool
	// QUICConns spreads HTTP/3 requests over this many QUIC connections
	// per peer (round robin): one connection's congestion window and
	// pacer bound all its streams, and quic-go handles its packets in one
	// goroutine. Default 1.
	QUICConns int
	// QUICConfig configures the HTTP/3 connections. Default
	// BulkQUICConfig(); &quic.Config{} is quic-go's stock configuration.
	QUICConfig *quic.Config
	// HTTP/2 is used unless TLS.NextProtos leaves out "h2": with
	// NextProtos {"http/1.1"} requests go over a pool of HTTP/1.1
	// connections, which costs servers about half the CPU per request on
	// loopback and LANs (BenchmarkLookupServerCPU, BenchmarkGet).
	// Bulk, when set, carries block GETs and PUTs (quicbulk.Transport):
	// a request it reports it never sent (an error with NotServed() true:
	// the peer does not serve it) goes over the HTTPS transport instead.
	// Close closes it.
	Bulk http.RoundTripper
	// Timeout bounds each JSON request; block transfers use the caller's
	// context only. Default 10s.
	Timeout time.Duration
	// Attempts is the number of tries of an idempotent request (GET, PUT,
	// DELETE) on a transport error or a 502/503/504; default 3.
	Attempts int
	// Logger; default: discard.
	Logger *slog.Logger
	// Transport, when set, carries every request instead of HTTPS (the
	// in-memory fabric of the deterministic simulation, internal/simnet,
	// which presents the identity of TLS's certificate). TLS is still
	// required.
	Transport http.RoundTripper
}

// Client is a KVSP client for every role.
type Client struct {
	hc        *http.Client
	bulk      *http.Client // block transfers; hc when no Bulk
	closeBulk func()
	close     func()
	timeout   time.Duration
	attempts  int
	log       *slog.Logger
}

// New returns a Client.
func New(cfg Config) (*Client, error) {
	if cfg.TLS == nil {
		return nil, errors.New("client: TLS configuration required (mutual TLS on every role)")
	}
	if cfg.TLS.MinVersion < tls.VersionTLS13 {
		cfg.TLS = cfg.TLS.Clone()
		cfg.TLS.MinVersion = tls.VersionTLS13 // R-HTTP-4
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Attempts == 0 {
		cfg.Attempts = 3
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c := &Client{timeout: cfg.Timeout, attempts: cfg.Attempts, log: cfg.Logger}
	switch {
	case cfg.Transport != nil:
		c.hc, c.close = &http.Client{Transport: cfg.Transport}, func() {}
	case cfg.HTTP3:
		n := max(1, cfg.QUICConns)
		rr := &roundRobin{trs: make([]*http3.Transport, n)}
		for i := range rr.trs {
			rr.trs[i] = &http3.Transport{TLSClientConfig: cfg.TLS.Clone(), QUICConfig: cmp.Or(cfg.QUICConfig, BulkQUICConfig())}
		}
		c.hc, c.close = &http.Client{Transport: rr}, func() {
			for _, tr := range rr.trs {
				tr.Close()
			}
		}
	default:
		var d net.Dialer
		tr := &http.Transport{
			// Reads and writes as raw system calls (internal/sockio): a
			// client streaming blocks in does not wake the runtime's
			// monitor thread each time it waits for the server.
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := d.DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				return sockio.Wrap(c), nil
			},
			TLSClientConfig:     cfg.TLS.Clone(),
			ForceAttemptHTTP2:   len(cfg.TLS.NextProtos) == 0 || slices.Contains(cfg.TLS.NextProtos, "h2"),
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true, // blocks are sent with identity coding
			// Bulk-friendly HTTP/2 receive windows for block GETs (see
			// server's bulkHTTP2).
			HTTP2: &http.HTTP2Config{MaxReadFrameSize: 1 << 20, MaxReceiveBufferPerConnection: 3 << 20, MaxReceiveBufferPerStream: 3 << 20},
		}
		c.hc, c.close = &http.Client{Transport: tr}, tr.CloseIdleConnections
	}
	c.bulk = c.hc
	if cfg.Bulk != nil {
		c.closeBulk = func() {
			if cl, ok := cfg.Bulk.(interface{ Close() error }); ok {
				cl.Close()
			}
		}
		c.bulk = &http.Client{Transport: &fallback{bulk: cfg.Bulk, https: c.hc.Transport}}
	}
	return c, nil
}

// BulkQUICConfig is the default QUIC configuration of HTTP/3 clients:
// receive windows that take whole blocks (quic-go starts each stream at
// 512 KiB, which stalls a 2 MiB block a round trip per window update) and
// room for 16 of them per connection, as quicbulk's.
func BulkQUICConfig() *quic.Config {
	return &quic.Config{
		InitialStreamReceiveWindow:     4 << 20,
		MaxStreamReceiveWindow:         16 << 20,
		InitialConnectionReceiveWindow: 32 << 20,
		MaxConnectionReceiveWindow:     128 << 20,
	}
}

// roundRobin spreads requests over several HTTP/3 transports (one QUIC
// connection each per peer).
type roundRobin struct {
	trs  []*http3.Transport
	next atomic.Uint32
}

// RoundTrip implements http.RoundTripper.
func (r *roundRobin) RoundTrip(req *http.Request) (*http.Response, error) {
	return r.trs[int(r.next.Add(1))%len(r.trs)].RoundTrip(req)
}

// fallback sends over bulk, and over https what bulk says it never sent.
type fallback struct {
	bulk, https http.RoundTripper
}

// RoundTrip implements http.RoundTripper.
func (f *fallback) RoundTrip(req *http.Request) (*http.Response, error) {
	var body *guardedBody
	breq := req
	if req.Body != nil && req.Body != http.NoBody {
		// The bulk attempt gets a body it cannot close, so an unsent
		// request can still go over HTTPS with the body untouched.
		body = &guardedBody{rc: req.Body}
		breq = req.Clone(req.Context())
		breq.Body = body
	}
	resp, err := f.bulk.RoundTrip(breq)
	var ns interface{ NotServed() bool }
	unread := body == nil || !body.read.Load()
	if err != nil && unread && errors.As(err, &ns) && ns.NotServed() && req.Context().Err() == nil {
		return f.https.RoundTrip(req)
	}
	if err != nil && body != nil && unread {
		req.Body.Close()
	}
	return resp, err
}

// guardedBody is a request body whose Close is passed on only once it
// was read: an unread body may still go over another transport.
type guardedBody struct {
	rc   io.ReadCloser
	read atomic.Bool
	once sync.Once
}

func (b *guardedBody) Read(p []byte) (int, error) { b.read.Store(true); return b.rc.Read(p) }

func (b *guardedBody) Close() error {
	if b.read.Load() {
		b.once.Do(func() { b.rc.Close() })
	}
	return nil
}

// Close releases idle connections.
func (c *Client) Close() {
	c.close()
	if c.closeBulk != nil {
		c.closeBulk()
	}
}

// onceKey marks a context whose requests are sent once: an idempotent
// method whose repetition is still costly (a reshard).
type onceKey struct{}

// idempotent reports the methods that may be retried (RFC 9110 9.2.2).
func idempotent(method string) bool {
	return method == http.MethodGet || method == http.MethodPut || method == http.MethodDelete || method == http.MethodHead
}

func retryable(resp *http.Response, err error) bool {
	if err != nil {
		return !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
	}
	switch resp.StatusCode {
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// do sends a request whose body (if any) is in memory, retrying idempotent
// methods, and returns the response of the last attempt.
func (c *Client) do(ctx context.Context, method, url string, hdr http.Header, body []byte) (*http.Response, error) {
	return c.doOn(c.hc, ctx, method, url, hdr, body)
}

// doOn is do over hc.
func (c *Client) doOn(hc *http.Client, ctx context.Context, method, url string, hdr http.Header, body []byte) (*http.Response, error) {
	attempts := 1
	if idempotent(method) && ctx.Value(onceKey{}) == nil {
		attempts = c.attempts
	}
	var (
		resp *http.Response
		err  error
	)
	for i := 0; i < attempts; i++ {
		if i > 0 {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(time.Duration(i*i) * 50 * time.Millisecond):
			}
		}
		var rd io.Reader
		if body != nil {
			rd = bytes.NewReader(body)
		}
		req, rerr := http.NewRequestWithContext(ctx, method, url, rd)
		if rerr != nil {
			return nil, fmt.Errorf("client: %w", rerr)
		}
		for k, v := range hdr {
			req.Header[k] = v
		}
		resp, err = hc.Do(req)
		if !retryable(resp, err) || i == attempts-1 {
			break
		}
		if resp != nil {
			io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
		}
		c.log.Debug("retrying", "method", method, "attempt", i+2)
	}
	if err != nil {
		return nil, fmt.Errorf("client: %s %s: %w", method, url, err)
	}
	return resp, nil
}

// maxErrorBody bounds the problem details read from a peer.
const maxErrorBody = 64 << 10

// ProblemFrom turns a non-2xx response into an error: the peer's problem
// details when it sent them (as *kvsp.Problem, which errors.Is the
// sentinel), otherwise a problem of the status's class (R-HTTP-9). It
// consumes and closes the body.
func ProblemFrom(resp *http.Response) error {
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mt == kvsp.MediaTypeProblem || mt == kvsp.MediaType {
		if p, err := kvsp.ParseProblem(body, resp.StatusCode); err == nil {
			return p
		}
	}
	return &kvsp.Problem{Type: "about:blank", Status: resp.StatusCode, Title: http.StatusText(resp.StatusCode)}
}

// doJSON sends v (nil: no body) as application/kvsp+json and decodes a 2xx
// answer into out (nil: no body expected), returning the status.
func (c *Client) doJSON(ctx context.Context, method, url string, v any, out kvsp.Validator) (int, http.Header, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	var body []byte
	hdr := http.Header{"Accept": {kvsp.MediaType + ", " + kvsp.MediaTypeProblem}}
	if v != nil {
		var err error
		if body, err = kvsp.Marshal(v); err != nil {
			return 0, nil, fmt.Errorf("client: encoding %T: %w", v, err)
		}
		hdr.Set("Content-Type", kvsp.MediaType)
	}
	resp, err := c.do(ctx, method, url, hdr, body)
	if err != nil {
		return 0, nil, err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return resp.StatusCode, resp.Header, ProblemFrom(resp)
	}
	defer resp.Body.Close()
	if out == nil {
		io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
		return resp.StatusCode, resp.Header, nil
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mt != kvsp.MediaType {
		return resp.StatusCode, resp.Header, fmt.Errorf("%w: response Content-Type %q", kvsp.ErrInvalid, mt)
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return resp.StatusCode, resp.Header, fmt.Errorf("client: reading response: %w", err)
	}
	if err := kvsp.Decode(data, out); err != nil {
		return resp.StatusCode, resp.Header, fmt.Errorf("client: response of %s %s: %w", method, url, err)
	}
	return resp.StatusCode, resp.Header, nil
}

// join appends a relative path to a base URI ending in "/" (R-HTTP-3).
func join(base, rel string) string {
	return strings.TrimSuffix(base, "/") + "/" + strings.TrimPrefix(rel, "/")
}

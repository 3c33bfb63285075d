package server_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"log/slog"
	"math/big"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/pki"
	"github.com/kvsp/kvsp/server"
)

// rig is a running server like kvsptest.StartServer's, with what the
// reliability rows (RELIABILITY.md) observe besides responses: the
// server's log at debug level (handshake failures included), its metrics
// registry, and the TCP connections it holds open.
type rig struct {
	*server.Server
	Addr   string
	Policy *server.PolicyStore
	Creds  *mtls.Credentials
	PKI    *kvsptest.PKI
	Log    *logBuf
	Reg    *prometheus.Registry
	// Open counts the server's accepted TCP connections not yet closed.
	Open *atomic.Int64
	ln   *countingListener
}

type rigOptions struct {
	Policy            string // default kvsptest.Policy
	ReadHeaderTimeout time.Duration
	Now               func() time.Time // the server's clock (certificate validity per request)
	Level             slog.Leveler     // the log's level; nil: debug
	NetHTTP2          bool             // net/http's HTTP/2 server
	MinWriteRate      int64            // server.Config's (zero: its default)
	WriteGrace        time.Duration
}

func startRig(t *testing.T, p *kvsptest.PKI, o rigOptions, mount func(*server.Server)) *rig {
	t.Helper()
	if o.Policy == "" {
		o.Policy = kvsptest.Policy
	}
	p.WriteLeaf("server.pem", "server.key", p.Issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/server"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}))
	if err := os.WriteFile(p.Path("policy.yaml"), []byte(o.Policy), 0o644); err != nil {
		t.Fatal(err)
	}
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: p.Path("server.pem"), Key: p.Path("server.key"), ClientCA: p.Path("ca.pem")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pol, err := server.LoadPolicyStore(p.Path("policy.yaml"), nil)
	if err != nil {
		t.Fatal(err)
	}
	logs := &logBuf{}
	reg := prometheus.NewRegistry()
	var level slog.Leveler = slog.LevelDebug
	if o.Level != nil {
		level = o.Level
	}
	srv, err := server.New(server.Config{
		Credentials: creds, Policy: pol, ReadHeaderTimeout: o.ReadHeaderTimeout, Registerer: reg, Now: o.Now, NetHTTP2: o.NetHTTP2,
		MinWriteRate: o.MinWriteRate, WriteGrace: o.WriteGrace,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: level})),
	})
	if err != nil {
		t.Fatal(err)
	}
	if mount != nil {
		mount(srv)
	}
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := &countingListener{Listener: inner, open: new(atomic.Int64)}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-errc; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return &rig{Server: srv, Addr: inner.Addr().String(), Policy: pol, Creds: creds, PKI: p, Log: logs, Reg: reg, Open: ln.open, ln: ln}
}

func (r *rig) URL(path string) string { return "https://" + r.Addr + path }

// countingListener counts the connections it accepted that are not
// closed, and tells when the server closes each one.
type countingListener struct {
	net.Listener
	open   *atomic.Int64
	closed sync.Map // the peer's address -> *countedConn
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.open.Add(1)
	cc := &countedConn{Conn: c, open: l.open, accepted: time.Now(), done: make(chan struct{})}
	l.closed.Store(c.RemoteAddr().String(), cc)
	return cc, nil
}

type countedConn struct {
	net.Conn
	open     *atomic.Int64
	accepted time.Time    // when the server accepted it
	read     atomic.Int64 // octets the server read, TLS records included
	at       atomic.Int64 // when the server closed it, Unix nanoseconds
	done     chan struct{}
	once     sync.Once
}

func (c *countedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.at.Store(time.Now().UnixNano()); c.open.Add(-1); close(c.done) })
	return c.Conn.Close()
}

// ServerClosed returns a channel closed when the server closes its side of
// the client connection whose local address is addr (nil if the server
// does not accept it within a second).
func (r *rig) ServerClosed(addr string) <-chan struct{} {
	if c := r.serverConn(addr); c != nil {
		return c.done
	}
	return nil
}

// ServerClosedAt returns when the server closed its side of the client
// connection whose local address is addr (zero: not yet).
func (r *rig) ServerClosedAt(addr string) time.Time {
	if c := r.serverConn(addr); c != nil && c.at.Load() != 0 {
		return time.Unix(0, c.at.Load())
	}
	return time.Time{}
}

// ServerAcceptedAt returns when the server accepted the client connection
// whose local address is addr (zero: not accepted).
func (r *rig) ServerAcceptedAt(addr string) time.Time {
	if c := r.serverConn(addr); c != nil {
		return c.accepted
	}
	return time.Time{}
}

// ServerRead returns the octets the server read from the client
// connection whose local address is addr.
func (r *rig) ServerRead(addr string) int64 {
	if c := r.serverConn(addr); c != nil {
		return c.read.Load()
	}
	return -1
}

func (r *rig) serverConn(addr string) *countedConn {
	for end := time.Now().Add(time.Second); ; time.Sleep(time.Millisecond) {
		if c, ok := r.ln.closed.Load(addr); ok {
			return c.(*countedConn)
		}
		if time.Now().After(end) {
			return nil
		}
	}
}

// logBuf is a concurrency-safe log sink.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// Len is a mark for Since.
func (b *logBuf) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Len()
}

// Since returns what was logged after mark.
func (b *logBuf) Since(mark int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()[mark:]
}

// WaitFor reports whether substr is logged after mark within d (the server
// logs a failed handshake after the client has seen it fail).
func (b *logBuf) WaitFor(mark int, substr string, d time.Duration) bool {
	for end := time.Now().Add(d); ; time.Sleep(5 * time.Millisecond) {
		if strings.Contains(b.Since(mark), substr) {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

// customLeaf signs a leaf that pki.LeafOptions cannot describe (key usage,
// extended key usage).
func customLeaf(t *testing.T, ca *pki.CA, uri string, ku x509.KeyUsage, eku []x509.ExtKeyUsage) *pki.Leaf {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(uri)
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 100))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     ku,
		ExtKeyUsage:  eku,
		URIs:         []*url.URL{u},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &pki.Leaf{Cert: cert, Key: key}
}

// Package kvsptest is the test harness of the project: a test PKI, KVSP
// servers on loopback with mutual TLS, and client configurations per
// identity. Only tests import it (TestDependencyDirections checks).
package kvsptest

import (
	"context"
	"crypto/tls"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go"

	"github.com/kvsp/kvsp/internal/h2"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/pki"
	"github.com/kvsp/kvsp/server"
)

// Scope is the appendix scope_id (scope key 0x00..0x1f).
const Scope = "6d1c6481cd428737da312c089db3832a"

// Identities used across tests.
const (
	PC       = "spiffe://kvsp.test/pc"
	Holder1  = "spiffe://kvsp.test/holder/h1"
	ClientA  = "spiffe://kvsp.test/client/a"
	Stranger = "spiffe://kvsp.test/stranger"
	DNSOnly  = "dns-only.kvsp.test"
)

// Policy is a policy file for the identities above. ClientA is also a
// producer: the tests fill holders through it, as an instance storing
// the KV it computed would (a client alone may not store blocks, S13).
const Policy = `principals:
  - {id: "` + PC + `", roles: [controller], scopes: [` + Scope + `]}
  - {id: "` + Holder1 + `", roles: [holder], speaks_for: ["https://127.0.0.1/h1/"], scopes: [` + Scope + `]}
  - {id: "` + ClientA + `", roles: [client, producer], scopes: [` + Scope + `]}
  - {id: "` + DNSOnly + `", roles: [client]}
`

// PKI is a test CA with its files in a temporary directory.
type PKI struct {
	t   testing.TB
	Dir string
	CA  *pki.CA
}

// NewPKI creates a CA and writes ca.pem.
func NewPKI(t testing.TB) *PKI {
	t.Helper()
	ca, err := pki.NewCA("kvsp test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	p := &PKI{t: t, Dir: t.TempDir(), CA: ca}
	if err := os.WriteFile(p.Path("ca.pem"), pki.CertPEM(ca.Cert), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// Path returns a file name in the PKI's directory.
func (p *PKI) Path(name string) string { return filepath.Join(p.Dir, name) }

// Issue signs a leaf.
func (p *PKI) Issue(o pki.LeafOptions) *pki.Leaf {
	p.t.Helper()
	l, err := p.CA.Issue(o)
	if err != nil {
		p.t.Fatal(err)
	}
	return l
}

// Leaf signs a leaf whose URI SAN (or DNS SAN, for a name without a
// scheme) is id.
func (p *PKI) Leaf(id string) *pki.Leaf {
	if strings.Contains(id, ":") {
		return p.Issue(pki.LeafOptions{URIs: []string{id}})
	}
	return p.Issue(pki.LeafOptions{DNSNames: []string{id}})
}

// WriteLeaf writes a leaf's files.
func (p *PKI) WriteLeaf(cert, key string, l *pki.Leaf) {
	p.t.Helper()
	if err := l.WriteFiles(p.Path(cert), p.Path(key)); err != nil {
		p.t.Fatal(err)
	}
}

// ClientTLS returns a TLS 1.3 client configuration presenting leaf (nil:
// none) and trusting the CA.
func (p *PKI) ClientTLS(leaf *pki.Leaf) *tls.Config {
	c := &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: p.CA.Pool(), NextProtos: []string{"h2", "http/1.1"}}
	if leaf != nil {
		c.Certificates = []tls.Certificate{leaf.TLSCertificate()}
	}
	return c
}

// Server is a running server.Server on 127.0.0.1.
type Server struct {
	*server.Server
	Addr   string
	Policy *server.PolicyStore
	Creds  *mtls.Credentials
	PKI    *PKI
}

// Options configure StartServer.
type Options struct {
	Policy            string // policy file content; default Policy
	HTTP3             bool
	QUIC              map[string]server.QUICHandler // other ALPNs on the UDP port
	QUICConfig        *quic.Config
	ReadHeaderTimeout time.Duration
	Registerer        prometheus.Registerer
	// Wrap, when set, wraps the server's handler (a recording layer, S7),
	// served over TCP with the server's TLS configuration.
	Wrap func(http.Handler) http.Handler
	// Logger receives the server's request logs.
	Logger *slog.Logger
	// NetHTTP2 serves HTTP/2 with net/http's server (benchmarks compare).
	NetHTTP2 bool
	// PlainSockets serves with net.TCPConn's own reads and writes rather
	// than internal/sockio's (benchmarks compare).
	PlainSockets bool
	// MinWriteRate and WriteGrace are server.Config's (zero: its defaults).
	MinWriteRate int64
	WriteGrace   time.Duration
}

// StartServer starts a server with a fresh server certificate (URI SAN
// spiffe://kvsp.test/server, IP SAN 127.0.0.1), the given policy and the
// routes that mount adds; it is shut down when the test ends.
func StartServer(t testing.TB, p *PKI, o Options, mount func(*server.Server)) *Server {
	t.Helper()
	if o.Policy == "" {
		o.Policy = Policy
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
	srv, err := server.New(server.Config{Credentials: creds, Policy: pol, HTTP3: o.HTTP3, QUIC: o.QUIC, QUICConfig: o.QUICConfig, ReadHeaderTimeout: o.ReadHeaderTimeout, Registerer: o.Registerer, Logger: o.Logger, NetHTTP2: o.NetHTTP2, PlainSockets: o.PlainSockets,
		MinWriteRate: o.MinWriteRate, WriteGrace: o.WriteGrace})
	if err != nil {
		t.Fatal(err)
	}
	if mount != nil {
		mount(srv)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	shutdown := srv.Shutdown
	if o.Wrap != nil {
		hs := &http.Server{Handler: o.Wrap(srv.Handler()), TLSConfig: srv.TLSConfig()}
		if !o.NetHTTP2 { // the HTTP/2 server the roles serve with
			h2.New(h2.Config{MaxReadFrameSize: 1 << 20, StreamWindow: 3 << 20, ConnWindow: 3 << 20}).Configure(hs)
		}
		go func() {
			if err := hs.ServeTLS(ln, "", ""); err != http.ErrServerClosed {
				errc <- err
				return
			}
			errc <- nil
		}()
		shutdown = hs.Shutdown
	} else {
		go func() { errc <- srv.Serve(ln) }()
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-errc; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return &Server{Server: srv, Addr: ln.Addr().String(), Policy: pol, Creds: creds, PKI: p}
}

// URL returns https://addr + path.
func (s *Server) URL(path string) string { return "https://" + s.Addr + path }

// HTTPClient returns a client with its own transport, closed at the end of
// the test. A transport with a TLS configuration attempts HTTP/2, as that
// configuration's ALPN offers it.
func HTTPClient(t testing.TB, tr *http.Transport) *http.Client {
	if tr.TLSClientConfig != nil && len(tr.TLSClientConfig.NextProtos) > 0 && tr.TLSClientConfig.NextProtos[0] == "h2" {
		tr.ForceAttemptHTTP2 = true
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 5 * time.Second}
}

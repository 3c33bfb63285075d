package server_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go/http3"
	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/pki"
	"github.com/kvsp/kvsp/internal/sockio"
	"github.com/kvsp/kvsp/server"
)

func TestMain(m *testing.M) {
	mtls.ReloadInterval = 0 // tests rotate files and expect the next handshake to see them
	goleak.VerifyTestMain(m)
}

const testScope = kvsptest.Scope

const basePolicy = kvsptest.Policy

// env is a running Server with a test CA, policy file and client certs.
type env struct {
	t *testing.T
	*kvsptest.Server
	ca      *pki.CA
	srv     *server.Server
	addr    string
	policy  *server.PolicyStore
	clients map[string]*pki.Leaf
}

func newEnv(t *testing.T, http3on bool, mount func(*server.Server)) *env {
	t.Helper()
	p := kvsptest.NewPKI(t)
	s := kvsptest.StartServer(t, p, kvsptest.Options{HTTP3: http3on, ReadHeaderTimeout: 300 * time.Millisecond}, mount)
	e := &env{t: t, Server: s, ca: p.CA, srv: s.Server, addr: s.Addr, policy: s.Policy, clients: map[string]*pki.Leaf{}}
	for _, id := range []string{kvsptest.PC, kvsptest.Holder1, kvsptest.ClientA, kvsptest.Stranger, kvsptest.DNSOnly} {
		e.clients[id] = p.Leaf(id)
	}
	return e
}

func (e *env) path(name string) string { return e.PKI.Path(name) }

func (e *env) tlsFor(leaf *pki.Leaf) *tls.Config { return e.PKI.ClientTLS(leaf) }

func (e *env) client(leaf *pki.Leaf) *http.Client {
	return kvsptest.HTTPClient(e.t, &http.Transport{TLSClientConfig: e.tlsFor(leaf), ForceAttemptHTTP2: true})
}

func (e *env) clientWith(tr *http.Transport) *http.Client { return kvsptest.HTTPClient(e.t, tr) }

func (e *env) url(p string) string { return e.URL(p) }

// echoRoutes mounts a small role used by the tests.
func echoRoutes(s *server.Server) {
	r := s.Mount("/t/")
	r.Handle("GET", "any", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
		return server.WriteJSON(w, 200, &kvsp.StateBody{State: kvsp.StateActive})
	})
	r.Handle("POST", "ctl", server.Route{Roles: []server.Role{server.RoleController}}, func(w http.ResponseWriter, req *http.Request) error {
		return server.WriteJSON(w, 200, &kvsp.StateBody{State: kvsp.StateActive})
	})
	r.Handle("PUT", "pub/{holder}", server.Route{Roles: []server.Role{server.RoleHolder}}, func(w http.ResponseWriter, req *http.Request) error {
		if !server.PrincipalFrom(req.Context()).SpeaksFor("https://127.0.0.1/" + req.PathValue("holder") + "/") {
			return fmt.Errorf("%w: not this holder", kvsp.ErrForbidden)
		}
		return server.NoContent(w)
	})
	r.Handle("POST", "lookup", server.Route{Roles: []server.Role{server.RoleController, server.RoleClient}, MaxBody: 4096}, func(w http.ResponseWriter, req *http.Request) error {
		var q kvsp.LookupRequest
		if err := server.DecodeJSON(req, &q); err != nil {
			return err
		}
		if !server.PrincipalFrom(req.Context()).MayUseScope(q.ScopeID) {
			return kvsp.ErrScopeDenied
		}
		return server.WriteJSON(w, 200, &kvsp.LookupResponse{Replicas: [][]kvsp.ReplicaRecord{}})
	})
	r.Handle("DELETE", "lookup", server.Route{}, func(w http.ResponseWriter, req *http.Request) error { return nil })
	r.Handle("GET", "busy", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
		return fmt.Errorf("%w: backend down", kvsp.ErrUnavailable)
	})
	r.Handle("PUT", "stale", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
		return kvsp.NewProblem(kvsp.ErrStaleEpoch, "epoch 3 is below 4").With("epoch", 4)
	})
	r.Handle("GET", "stream", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
		w.Header().Set("Content-Type", "application/kvsp-block")
		for i := 0; i < 5; i++ {
			if _, err := w.Write(make([]byte, 1024)); err != nil {
				return err
			}
			http.NewResponseController(w).Flush()
			time.Sleep(40 * time.Millisecond)
		}
		return nil
	})
}

func get(c *http.Client, method, url, ctype, body string) (*http.Response, []byte, error) {
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, b, err
}

// TestS1_MTLSHandshakeMatrix is row S1 of RELIABILITY.md: every way in
// without a valid, authorized certificate ends in a handshake failure or a
// 403 problem, never 2xx, over HTTP/2 and HTTP/1.1, and the server logs a
// reason that names the defect (R-HTTP-4, R-HTTP-5, R-SEC-1, R-SEC-2, A-5,
// Identity failures are 403 about:blank, scope failures 403
// kvsp-scope-denied.
func TestS1_MTLSHandshakeMatrix(t *testing.T) {
	p := kvsptest.NewPKI(t)
	r := startRig(t, p, rigOptions{}, echoRoutes)
	const a = kvsptest.ClientA
	otherCA, _ := pki.NewCA("other", time.Hour)
	unknownCA, _ := otherCA.Issue(pki.LeafOptions{URIs: []string{a}})
	issue := func(o pki.LeafOptions) *pki.Leaf { return p.Issue(o) }
	tls12 := p.ClientTLS(p.Leaf(a))
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
	lookup := func(scope string) string {
		return `{"scope_id":"` + scope + `","compat_id":"` + strings.Repeat("ab", 32) + `","block_keys":[]}`
	}
	const handshake = 0 // want: the handshake fails
	for _, c := range []struct {
		name    string
		conf    *tls.Config
		path    string
		body    string
		want    int
		problem string // type of the 403 problem
		reason  string // what the server's log says
	}{
		{"no certificate", p.ClientTLS(nil), "/t/any", "", handshake, "", "didn't provide a certificate"},
		{"unknown CA", p.ClientTLS(unknownCA), "/t/any", "", handshake, "", "certificate signed by unknown authority"},
		{"expired", p.ClientTLS(issue(pki.LeafOptions{URIs: []string{a}, NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})), "/t/any", "", handshake, "", "expired or is not yet valid"},
		{"not yet valid", p.ClientTLS(issue(pki.LeafOptions{URIs: []string{a}, NotBefore: time.Now().Add(time.Hour)})), "/t/any", "", handshake, "", "expired or is not yet valid"},
		{"wrong extended key usage (serverAuth only)", p.ClientTLS(customLeaf(t, p.CA, a, x509.KeyUsageDigitalSignature, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth})), "/t/any", "", handshake, "", "incompatible key usage"},
		{"wrong key usage (no digitalSignature)", p.ClientTLS(customLeaf(t, p.CA, a, x509.KeyUsageCertSign, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})), "/t/any", "", handshake, "", "key usage"},
		{"TLS 1.2 only", tls12, "/t/any", "", handshake, "", "unsupported versions"},
		{"two URI SANs", p.ClientTLS(issue(pki.LeafOptions{URIs: []string{a, kvsptest.PC}})), "/t/any", "", handshake, "", "2 URI SANs"},
		{"two DNS SANs, no URI SAN", p.ClientTLS(issue(pki.LeafOptions{DNSNames: []string{"a.kvsp.test", "b.kvsp.test"}})), "/t/any", "", handshake, "", "2 DNS SANs"},
		{"no SAN at all", p.ClientTLS(issue(pki.LeafOptions{})), "/t/any", "", handshake, "", "no URI or DNS SAN"},
		// A DNS SAN spelling an identity of the policy's URI SANs is not
		// that identity: only a URI SAN is.
		{"DNS SAN that spells a URI identity", p.ClientTLS(issue(pki.LeafOptions{DNSNames: []string{a}})), "/t/lookup", lookup(testScope), handshake, "", "the DNS SAN is not a DNS name"},
		{"no URI SAN, DNS SAN not in the policy", p.ClientTLS(p.Leaf("other.kvsp.test")), "/t/any", "", 403, "about:blank", "identity not in the policy"},
		{"URI SAN not in the policy", p.ClientTLS(p.Leaf(kvsptest.Stranger)), "/t/any", "", 403, "about:blank", "identity not in the policy"},
		{"authorized, other scope", p.ClientTLS(p.Leaf(a)), "/t/lookup", lookup(strings.Repeat("ee", 16)), 403, "https://iana.org/assignments/kvsp#kvsp-scope-denied", "scope denied"},
		// Positive controls: the matrix can tell a good certificate.
		{"DNS SAN identity in the policy", p.ClientTLS(p.Leaf(kvsptest.DNSOnly)), "/t/any", "", 200, "", ""},
		{"authorized", p.ClientTLS(p.Leaf(a)), "/t/lookup", lookup(testScope), 200, "", ""},
	} {
		for _, proto := range []string{"h2", "http/1.1"} {
			conf := c.conf.Clone()
			conf.NextProtos = []string{proto}
			tr := &http.Transport{TLSClientConfig: conf, ForceAttemptHTTP2: proto == "h2"}
			mark := r.Log.Len()
			method := "GET"
			if c.body != "" {
				method = "POST"
			}
			resp, body, err := get(kvsptest.HTTPClient(t, tr), method, r.URL(c.path), kvsp.MediaType, c.body)
			tr.CloseIdleConnections()
			name := c.name + " over " + proto
			switch {
			case err == nil && resp.StatusCode >= 200 && resp.StatusCode < 300 && c.want != 200:
				t.Errorf("%s: served %d: a bad certificate got a 2xx", name, resp.StatusCode)
				continue
			case c.want == handshake && err == nil:
				t.Errorf("%s: got %d, want a handshake failure", name, resp.StatusCode)
				continue
			case c.want != handshake && err != nil:
				t.Errorf("%s: %v, want %d", name, err, c.want)
				continue
			case c.want != handshake && resp.StatusCode != c.want:
				t.Errorf("%s: status %d, want %d: %s", name, resp.StatusCode, c.want, body)
				continue
			}
			if c.want == 403 {
				pr, perr := kvsp.ParseProblem(body, resp.StatusCode)
				if perr != nil || resp.Header.Get("Content-Type") != kvsp.MediaTypeProblem || pr.Type != c.problem || pr.Status != 403 {
					t.Errorf("%s: problem %q %s (%v), want type %s", name, resp.Header.Get("Content-Type"), body, perr, c.problem)
				}
			}
			if c.reason != "" && !r.Log.WaitFor(mark, c.reason, 2*time.Second) {
				t.Errorf("%s: the server log does not say %q:\n%s", name, c.reason, r.Log.Since(mark))
			}
			// A refused handshake is a warning naming the peer (item 8:
			// it was at debug, under serve's info level).
			if c.want == handshake {
				if line := lineWith(r.Log.Since(mark), c.reason); !strings.Contains(line, "level=WARN") || !strings.Contains(line, "peer=127.0.0.1:") {
					t.Errorf("%s: the refusal is not a warning naming the peer: %s", name, line)
				}
			}
			// A 403 names the identity refused (item 8).
			if c.want == 403 {
				if id := mtlsIdentity(c.conf); id != "" && !strings.Contains(lineWith(r.Log.Since(mark), c.reason), "principal="+id) {
					t.Errorf("%s: the refusal does not name %s:\n%s", name, id, r.Log.Since(mark))
				}
			}
		}
	}
	// Plain HTTP on the TLS port is never served.
	plain := kvsptest.HTTPClient(t, &http.Transport{})
	if resp, body, err := get(plain, "GET", "http://"+r.Addr+"/t/any", "", ""); err == nil && resp.StatusCode < 400 {
		t.Errorf("plain HTTP served: %d %s", resp.StatusCode, body)
	}
}

// TestS3_ResumptionAfterRevocation is row S3 of RELIABILITY.md: client A
// connects with session tickets on, is revoked by a policy reload, and is
// refused on its open connection and on a connection resumed from its
// ticket, over HTTP/1.1 and HTTP/2, because authorization runs per request
// against the current policy (R-SEC-2, golang/go 77217 and 77377); after a
// CA bundle rotation a session resumed from a ticket of the old CA is not
// served at all (VerifyConnection runs on resumption too).
func TestS3_ResumptionAfterRevocation(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	leaf := e.clients["spiffe://kvsp.test/client/a"]
	conf := e.tlsFor(leaf)
	conf.ClientSessionCache = tls.NewLRUClientSessionCache(8)
	conf.NextProtos = []string{"http/1.1"}
	dial := func() (*tls.Conn, error) {
		c, err := tls.Dial("tcp", e.addr, conf)
		if err != nil {
			return nil, err
		}
		// TLS 1.3 delivers the ticket after the handshake: read it in.
		c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		c.Read(make([]byte, 1))
		c.SetReadDeadline(time.Time{})
		return c, nil
	}
	roundTrip := func(c *tls.Conn) (int, error) {
		fmt.Fprintf(c, "GET /t/any HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	c1, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	if st, err := roundTrip(c1); err != nil || st != 200 {
		t.Fatalf("before revocation: %d %v", st, err)
	}
	c2, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	if !c2.ConnectionState().DidResume {
		t.Fatal("control: the second connection did not resume its session")
	}
	c2.Close()

	// Revoke the principal: the policy file changes and is reloaded.
	os.WriteFile(e.path("policy.yaml"), []byte(strings.Replace(basePolicy, `"spiffe://kvsp.test/client/a"`, `"spiffe://kvsp.test/client/b"`, 1)), 0o644)
	if err := e.policy.Reload(); err != nil {
		t.Fatal(err)
	}
	if st, err := roundTrip(c1); err != nil || st != 403 {
		t.Errorf("open connection after revocation: %d %v, want 403", st, err)
	}
	c1.Close()
	c3, err := dial()
	if err == nil {
		if !c3.ConnectionState().DidResume {
			t.Error("third connection did not resume: the check below proves less")
		}
		if st, err := roundTrip(c3); err == nil && st != 403 {
			t.Errorf("resumed session after revocation: %d, want 403", st)
		}
		c3.Close()
	}
	// The same over HTTP/2 through a Transport with its own ticket cache:
	// a ticket taken before the revocation, a resumed connection after it.
	os.WriteFile(e.path("policy.yaml"), []byte(basePolicy), 0o644)
	if err := e.policy.Reload(); err != nil {
		t.Fatal(err)
	}
	h2conf := e.tlsFor(leaf)
	h2conf.ClientSessionCache = tls.NewLRUClientSessionCache(8)
	h2 := e.clientWith(&http.Transport{TLSClientConfig: h2conf, ForceAttemptHTTP2: true})
	h2get := func() (*http.Response, error) {
		resp, _, err := get(h2, "GET", e.url("/t/any"), "", "")
		return resp, err
	}
	if resp, err := h2get(); err != nil || resp.StatusCode != 200 || resp.ProtoMajor != 2 {
		t.Fatalf("HTTP/2 before revocation: %v %v", resp, err)
	}
	h2.Transport.(*http.Transport).CloseIdleConnections()
	if resp, err := h2get(); err != nil || resp.StatusCode != 200 || !resp.TLS.DidResume {
		t.Fatalf("HTTP/2 control: the second connection did not resume: %v %v", resp, err)
	}
	h2.Transport.(*http.Transport).CloseIdleConnections()
	os.WriteFile(e.path("policy.yaml"), []byte(strings.Replace(basePolicy, `"spiffe://kvsp.test/client/a"`, `"spiffe://kvsp.test/client/b"`, 1)), 0o644)
	if err := e.policy.Reload(); err != nil {
		t.Fatal(err)
	}
	resp, err := h2get()
	switch {
	case err != nil: // refused at the handshake: denied too
	case !resp.TLS.DidResume:
		t.Error("HTTP/2 after revocation: not resumed: the check proves less")
	case resp.StatusCode != 403:
		t.Errorf("HTTP/2 resumed session after revocation: %d, want 403", resp.StatusCode)
	}
	h2.Transport.(*http.Transport).CloseIdleConnections()

	// Restore the policy, then rotate the CA: tickets of the old CA must
	// not get back in.
	os.WriteFile(e.path("policy.yaml"), []byte(basePolicy), 0o644)
	e.policy.Reload()
	c4, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	if st, err := roundTrip(c4); err != nil || st != 200 {
		t.Fatalf("after restore: %d %v", st, err)
	}
	c4.Close()
	newCA, _ := pki.NewCA("rotated", time.Hour)
	os.WriteFile(e.path("ca.pem"), pki.CertPEM(newCA.Cert), 0o644)
	time.Sleep(10 * time.Millisecond) // a different mtime granule for the reload check
	c5, err := dial()
	if err == nil {
		st, rerr := roundTrip(c5)
		c5.Close()
		if rerr == nil {
			t.Fatalf("session resumed after the CA rotation was served: %d (resumed: %v)", st, c5.ConnectionState().DidResume)
		}
	}
}

// TestRoleRouteTable: each route admits exactly its roles; holder publish
// also needs speaks_for (R-SEC-3, R-SEC-4, R-PF-12).
func TestRoleRouteTable(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	lookup := `{"scope_id":"` + testScope + `","compat_id":"` + strings.Repeat("ab", 32) + `","block_keys":[]}`
	otherScope := strings.Replace(lookup, testScope, strings.Repeat("ee", 16), 1)
	type call struct{ method, path, body string }
	calls := map[string]call{
		"any":          {"GET", "/t/any", ""},
		"ctl":          {"POST", "/t/ctl", ""},
		"pub h1":       {"PUT", "/t/pub/h1", ""},
		"pub h2":       {"PUT", "/t/pub/h2", ""},
		"lookup":       {"POST", "/t/lookup", lookup},
		"lookup other": {"POST", "/t/lookup", otherScope},
	}
	want := map[string]map[string]int{
		"spiffe://kvsp.test/pc":        {"any": 200, "ctl": 200, "pub h1": 403, "pub h2": 403, "lookup": 200, "lookup other": 403},
		"spiffe://kvsp.test/holder/h1": {"any": 200, "ctl": 403, "pub h1": 204, "pub h2": 403, "lookup": 403, "lookup other": 403},
		"spiffe://kvsp.test/client/a":  {"any": 200, "ctl": 403, "pub h1": 403, "pub h2": 403, "lookup": 200, "lookup other": 403},
		"spiffe://kvsp.test/stranger":  {"any": 403, "ctl": 403, "pub h1": 403, "pub h2": 403, "lookup": 403, "lookup other": 403},
	}
	for id, routes := range want {
		c := e.client(e.clients[id])
		for name, st := range routes {
			cl := calls[name]
			resp, body, err := get(c, cl.method, e.url(cl.path), kvsp.MediaType, cl.body)
			if err != nil {
				t.Fatalf("%s %s: %v", id, name, err)
			}
			if resp.StatusCode != st {
				t.Errorf("%s %s: %d, want %d: %s", id, name, resp.StatusCode, st, body)
			}
			if resp.Header.Get("Cache-Control") != "no-store" {
				t.Errorf("%s %s: Cache-Control %q (R-HTTP-10)", id, name, resp.Header.Get("Cache-Control"))
			}
		}
	}
}

// TestProblemDetails: the shape of every error response (R-HTTP-1,
// R-HTTP-7, R-HTTP-8, R-HTTP-10, R-ERR-10, R-ERR-11, A-7, A-29).
func TestProblemDetails(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	c := e.client(e.clients["spiffe://kvsp.test/pc"])
	lookup := `{"scope_id":"` + testScope + `","compat_id":"` + strings.Repeat("ab", 32) + `","block_keys":[]}`
	for _, x := range []struct {
		name, method, path, ctype, body string
		status                          int
		typ                             string
	}{
		{"unknown path", "GET", "/nowhere", "", "", 404, "about:blank"},
		{"unknown path with a body", "PUT", "/t/x/..", kvsp.MediaType, lookup, 404, "about:blank"},
		{"R-HTTP-1 method", "GET", "/t/lookup", "", "", 405, "about:blank"},
		{"R-HTTP-1 method with a body", "PUT", "/t/lookup", kvsp.MediaType, lookup, 405, "about:blank"}, // not 413: the body is not this route's
		{"A-29 media type", "POST", "/t/lookup", "application/json", lookup, 415, "about:blank"},
		{"R-REC-2 bad body", "POST", "/t/lookup", kvsp.MediaType, `{"Scope_ID":"x"}`, 400, "about:blank"},
		{"A-29 duplicate", "POST", "/t/lookup", kvsp.MediaType, strings.Replace(lookup, "{", `{"block_keys":[],`, 1), 400, "about:blank"},
		{"A-12 stale epoch", "PUT", "/t/stale", "", "", 409, "https://iana.org/assignments/kvsp#kvsp-stale-epoch"},
		{"503 unavailable", "GET", "/t/busy", "", "", 503, "about:blank"},
	} {
		resp, body, err := get(c, x.method, e.url(x.path), x.ctype, x.body)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != x.status || resp.Header.Get("Content-Type") != kvsp.MediaTypeProblem || resp.Header.Get("Cache-Control") != "no-store" {
			t.Errorf("%s: %d %q %q", x.name, resp.StatusCode, resp.Header.Get("Content-Type"), resp.Header.Get("Cache-Control"))
			continue
		}
		p, err := kvsp.ParseProblem(body, resp.StatusCode)
		if err != nil || p.Type != x.typ || p.Status != x.status || !strings.HasPrefix(p.Instance, "urn:kvsp:request:") {
			t.Errorf("%s: problem %s (%v)", x.name, body, err)
		}
		if x.status == 405 && resp.Header.Get("Allow") != "DELETE, POST" {
			t.Errorf("405 Allow = %q", resp.Header.Get("Allow"))
		}
		if x.status == 503 && resp.Header.Get("Retry-After") != "1" { // api/openapi.yaml: every 503 says when to come back
			t.Errorf("503 Retry-After = %q", resp.Header.Get("Retry-After"))
		}
		if x.status == 409 && (!errors.Is(p, kvsp.ErrStaleEpoch) || p.Extensions["epoch"] != float64(4)) {
			t.Errorf("stale epoch problem: %s", body)
		}
	}
	resp, _, _ := get(c, "POST", e.url("/t/lookup"), kvsp.MediaType+"; charset=utf-8", lookup)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != kvsp.MediaType {
		t.Errorf("success: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
}

// TestOversizedBody: a body over the route's limit is 413 and the server
// keeps serving.
func TestOversizedBody(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	c := e.client(e.clients["spiffe://kvsp.test/client/a"])
	resp, body, err := get(c, "POST", e.url("/t/lookup"), kvsp.MediaType, `{"x":"`+strings.Repeat("a", 10000)+`"}`)
	if err != nil || resp.StatusCode != 413 {
		t.Fatalf("oversized: %v %v %s", resp, err, body)
	}
	resp, _, err = get(c, "GET", e.url("/t/any"), "", "")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("after oversized: %v %v", resp, err)
	}
}

// TestB6_SlowlorisAndSlowReaders is row B6 of RELIABILITY.md: 200 TLS
// connections send their headers one byte per second, 20 raw connections
// stall inside the TLS handshake, and 20 clients read a 16 MiB block
// stream at 1 KiB/s, while a probe client on its own connection measures
// request latency. Every stalled connection is closed by the server:
// header and handshake stallers after ReadHeaderTimeout, slow readers at
// the route's deadline (Route.Timeout: the write deadline, then the
// aborted stream); the probe's p99 stays under 200 ms with no failure; and
// the server's connections and the process's goroutines return to their
// baseline (gosec G112: a peer cannot hold server resources without
// bound). The attack connections are opened first, 8 at a time; the probe
// measures the stalled steady state that follows.
//
// Each cut is timed on the server's own clock, from the event that starts
// its timeout (the connection's accept for handshake stallers and header
// tricklers, the handler's start for slow readers) to the server's close
// of the connection, so that a loaded machine (make chaos runs other
// packages' rows beside this one) delays the start of a timeout without
// being counted as the server holding a connection past it. The failure
// issue 25 saw (a slow reader open 8.06 s against its 3 s deadline) was
// the server's: crypto/tls closes a connection by sending close_notify
// under a fresh 5 s write deadline, which a peer that has stopped reading
// may never let through; the route now closes the raw connection at the
// deadline (server/handler.go). That wait needs close_notify's few
// octets not to fit in what the kernel still queues for the connection
// (they usually do, even for a peer that never reads: measured, Close
// returns in 80 us), a race this test loses only now and then (3 runs in
// 13 before the cut, 0 in 5 with it removed since), so the row's
// mutation is the header timeout's.
func TestB6_SlowlorisAndSlowReaders(t *testing.T) {
	const (
		headerTimeout = 3 * time.Second
		blockTimeout  = 3 * time.Second
		slack         = 2 * time.Second // 2 loaded cores, -race
		nSlowloris    = 200
		nHandshake    = 20
		nSlowReaders  = 20
		blockSize     = 16 << 20
	)
	p := kvsptest.NewPKI(t)
	var began sync.Map // a slow reader's address -> when its handler began
	r := startRig(t, p, rigOptions{ReadHeaderTimeout: headerTimeout}, func(s *server.Server) {
		echoRoutes(s)
		s.Mount("/s/").Handle("GET", "block", server.Route{Timeout: blockTimeout}, func(w http.ResponseWriter, req *http.Request) error {
			began.Store(req.RemoteAddr, time.Now())
			w.Header().Set("Content-Type", "application/kvsp-block")
			w.Header().Set("Content-Length", strconv.Itoa(blockSize))
			chunk := make([]byte, 32<<10)
			for n := 0; n < blockSize; n += len(chunk) {
				if _, err := w.Write(chunk); err != nil {
					return err
				}
			}
			return nil
		})
	})
	leaf := p.Leaf(kvsptest.ClientA)
	h1conf := p.ClientTLS(leaf)
	h1conf.NextProtos = []string{"http/1.1"}
	probe := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: p.ClientTLS(leaf), ForceAttemptHTTP2: true})
	if resp, _, err := get(probe, "GET", r.URL("/t/any"), "", ""); err != nil || resp.StatusCode != 200 || resp.ProtoMajor != 2 {
		t.Fatalf("probe warm-up: %v %v", resp, err)
	}
	// The probe's connection goes before each count: its idle handler
	// workers (at most 16, kept while it is open) are not a leak.
	probe.CloseIdleConnections()
	base := kvsptest.QuietGoroutines()
	baseOpen := r.Open.Load()

	type stalled struct {
		kind   string
		c      net.Conn
		up     time.Time // handshake done (TCP connect for handshake stallers)
		closed <-chan struct{}
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		all   []stalled
		fails []error
		dials = make(chan struct{}, 8)
	)
	add := func(st stalled) {
		mu.Lock()
		defer mu.Unlock()
		all = append(all, st)
	}
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		fails = append(fails, err)
	}
	start := time.Now()
	for i := range nSlowloris + nSlowReaders {
		wg.Go(func() {
			dials <- struct{}{}
			defer func() { <-dials }()
			c, err := tls.Dial("tcp", r.Addr, h1conf)
			if err != nil {
				fail(err)
				return
			}
			up := time.Now()
			if i < nSlowReaders {
				fmt.Fprintf(c, "GET /s/block HTTP/1.1\r\nHost: x\r\n\r\n")
				go func() { // 1 KiB/s until the connection ends
					buf := make([]byte, 1024)
					for {
						if _, err := c.Read(buf); err != nil {
							return
						}
						time.Sleep(time.Second)
					}
				}()
				add(stalled{"slow reader", c, up, r.ServerClosed(c.LocalAddr().String())})
				return
			}
			fmt.Fprintf(c, "GET /t/any HTTP/1.1\r\nHost: x\r\nX-Slow: ")
			go func() { // one header byte per second until the server hangs up
				for {
					time.Sleep(time.Second)
					if _, err := c.Write([]byte("a")); err != nil {
						return
					}
				}
			}()
			add(stalled{"slowloris", c, up, r.ServerClosed(c.LocalAddr().String())})
		})
	}
	for range nHandshake {
		wg.Go(func() {
			c, err := net.Dial("tcp", r.Addr)
			if err != nil {
				fail(err)
				return
			}
			up := time.Now()
			c.Write([]byte{0x16, 0x03, 0x01, 0x02}) // a TLS record header, and no more
			add(stalled{"handshake staller", c, up, r.ServerClosed(c.LocalAddr().String())})
		})
	}
	wg.Wait()
	dialPhase := time.Since(start)
	defer func() {
		for _, st := range all {
			st.c.Close()
		}
	}()
	if len(fails) > 0 {
		t.Fatalf("%d attack connections failed to open, e.g. %v", len(fails), fails[0])
	}
	allClosed := make(chan struct{})
	unserved := 0                       // slow readers whose handler never began
	worst := map[string]time.Duration{} // the server's clock: timeout start to close
	wall := map[string]time.Duration{}  // the client's: connection up to close
	count := map[string]int{}
	go func() {
		defer close(allClosed)
		deadline := time.After(headerTimeout + blockTimeout + 2*slack)
		for _, st := range all {
			if st.closed == nil {
				continue
			}
			select {
			case <-st.closed:
				mu.Lock()
				addr := st.c.LocalAddr().String()
				at := r.ServerClosedAt(addr)
				from := r.ServerAcceptedAt(addr)
				if st.kind == "slow reader" {
					b, ok := began.Load(addr)
					if !ok {
						unserved++
						break
					}
					from = b.(time.Time)
				}
				worst[st.kind] = max(worst[st.kind], at.Sub(from))
				wall[st.kind] = max(wall[st.kind], at.Sub(st.up))
				count[st.kind]++
				mu.Unlock()
			case <-deadline:
				return
			}
		}
	}()

	// The probe, against the stalled steady state.
	var lat []time.Duration
	probeFailures := 0
probing:
	for {
		select {
		case <-allClosed:
			break probing
		case <-time.After(10 * time.Millisecond):
		}
		t0 := time.Now()
		resp, _, err := get(probe, "GET", r.URL("/t/any"), "", "")
		lat = append(lat, time.Since(t0))
		if err != nil || resp.StatusCode != 200 {
			probeFailures++
		}
	}
	mu.Lock()
	limits := map[string]time.Duration{"slowloris": headerTimeout + slack, "handshake staller": headerTimeout + slack, "slow reader": blockTimeout + slack}
	for kind, n := range map[string]int{"slowloris": nSlowloris, "handshake staller": nHandshake, "slow reader": nSlowReaders} {
		if count[kind] != n {
			t.Errorf("%s: the server closed %d of %d connections", kind, count[kind], n)
		}
		if worst[kind] > limits[kind] {
			t.Errorf("%s: open for up to %v, want at most %v", kind, worst[kind], limits[kind])
		}
	}
	mu.Unlock()

	slices.Sort(lat)
	if len(lat) < 50 {
		t.Fatalf("only %d probe requests", len(lat))
	}
	p99 := lat[(len(lat)*99+99)/100-1]
	t.Logf("%d connections opened in %v; closed by the server, from the start of their timeout, after at most: slowloris %v, handshake stallers %v, slow readers %v (from the client's connection: %v, %v, %v); probe: %d requests, p50 %v, p99 %v, max %v",
		len(all), dialPhase, worst["slowloris"], worst["handshake staller"], worst["slow reader"], wall["slowloris"], wall["handshake staller"], wall["slow reader"],
		len(lat), lat[len(lat)/2], p99, lat[len(lat)-1])
	if unserved > 0 {
		t.Errorf("%d slow readers closed before their handler began", unserved)
	}
	if probeFailures > 0 {
		t.Errorf("%d probe requests failed", probeFailures)
	}
	if p99 >= 200*time.Millisecond {
		t.Errorf("probe p99 %v, want < 200ms", p99)
	}
	// Server-side connections and goroutines back to the baseline.
	for _, st := range all {
		st.c.Close()
	}
	probe.CloseIdleConnections()
	for end := time.Now().Add(5 * time.Second); r.Open.Load() > baseOpen && time.Now().Before(end); {
		time.Sleep(10 * time.Millisecond)
	}
	if n := r.Open.Load(); n > baseOpen {
		t.Errorf("server holds %d connections, baseline %d", n, baseOpen)
	}
	if n := kvsptest.SettleGoroutines(base, 5*time.Second); n > base {
		t.Errorf("%d goroutines, baseline %d", n, base)
	}
	figures.Report(t, figures.Row{Row: "B6", Inputs: int64(len(all)),
		Held: fmt.Sprintf("%d hostile connections (%d header tricklers, %d stalled handshakes, %d 1 KiB/s readers) each closed within %v of its timeout; probe p99 %v, 0 failed",
			len(all), nSlowloris, nHandshake, nSlowReaders, max(worst["slowloris"]-headerTimeout, worst["handshake staller"]-headerTimeout, worst["slow reader"]-blockTimeout).Round(time.Millisecond), p99.Round(100*time.Microsecond)),
		Detail: map[string]float64{"connections": float64(len(all)), "probe_p99_ms": float64(p99.Microseconds()) / 1000}})
}

// TestGracefulShutdown: Shutdown lets an in-flight stream finish.
func TestGracefulShutdown(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	c := e.client(e.clients["spiffe://kvsp.test/client/a"])
	var wg sync.WaitGroup
	wg.Add(1)
	var n int
	var serr error
	go func() {
		defer wg.Done()
		resp, err := c.Get(e.url("/t/stream"))
		if err != nil {
			serr = err
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		n, serr = len(b), err
	}()
	time.Sleep(60 * time.Millisecond) // the stream has started
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if serr != nil || n != 5*1024 {
		t.Fatalf("stream cut by shutdown: %d octets, %v", n, serr)
	}
}

// TestHTTP3: with http3 on, responses advertise Alt-Svc and the same routes
// answer over QUIC with the same authorization.
func TestHTTP3(t *testing.T) {
	e := newEnv(t, true, echoRoutes)
	c := e.client(e.clients["spiffe://kvsp.test/client/a"])
	resp, _, err := get(c, "GET", e.url("/t/any"), "", "")
	if err != nil || !strings.HasPrefix(resp.Header.Get("Alt-Svc"), `h3=":`) {
		t.Fatalf("Alt-Svc: %v %v", resp, err)
	}
	for id, want := range map[string]int{"spiffe://kvsp.test/client/a": 200, "spiffe://kvsp.test/stranger": 403} {
		tr := &http3.Transport{TLSClientConfig: e.tlsFor(e.clients[id])}
		h3 := &http.Client{Transport: tr, Timeout: 5 * time.Second}
		resp, body, err := get(h3, "GET", e.url("/t/any"), "", "")
		tr.Close()
		if err != nil || resp.StatusCode != want || resp.Proto != "HTTP/3.0" {
			t.Errorf("%s over HTTP/3: %v %v %s", id, resp, err, body)
		}
	}
	tr := &http3.Transport{TLSClientConfig: e.tlsFor(nil)}
	defer tr.Close()
	if _, _, err := get(&http.Client{Transport: tr, Timeout: 5 * time.Second}, "GET", e.url("/t/any"), "", ""); err == nil {
		t.Error("HTTP/3 without a client certificate was served")
	}
}

// TestS4_CertificateRotationUnderLoad is row S4 of RELIABILITY.md: the
// server's certificate (GetCertificate over mtls.Credentials) and a
// client's (GetClientCertificate over its own Credentials) are swapped, each
// every 2 s (one side every s4Rotate), while workers send mixed traffic
// (small GETs, PUTs with bodies, 160 ms streams) over HTTP/2 and HTTP/1.1,
// on kept-alive and on fresh connections. No request fails; after every
// swap a new handshake shows the new leaf serial (server side and client
// side); connections opened before the first swap keep serving (old
// connections drain rather than break), and Shutdown is clean (R-HTTP-5,
// It runs s4Duration; KVSP_S4_DURATION (a Go duration, "60s" for
// the row's full run) overrides it.
func TestS4_CertificateRotationUnderLoad(t *testing.T) {
	duration := s4Duration
	if d := os.Getenv("KVSP_S4_DURATION"); d != "" {
		var err error
		if duration, err = time.ParseDuration(d); err != nil {
			t.Fatalf("KVSP_S4_DURATION: %v", err)
		}
	}
	p := kvsptest.NewPKI(t)
	serverLeaf := func() *pki.Leaf {
		return p.Issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/server"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	}
	r := startRig(t, p, rigOptions{}, func(s *server.Server) {
		rt := s.Mount("/r/")
		rt.Handle("GET", "who", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
			w.Header().Set("X-Client-Serial", req.TLS.PeerCertificates[0].SerialNumber.String())
			return server.NoContent(w)
		})
		rt.Handle("PUT", "echo", server.Route{MaxBody: 1 << 20}, func(w http.ResponseWriter, req *http.Request) error {
			b, err := io.ReadAll(req.Body)
			if err != nil {
				return err
			}
			w.Header().Set("Cache-Control", "no-store")
			_, err = w.Write(b)
			return err
		})
		rt.Handle("GET", "stream", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
			for range 8 {
				if _, err := w.Write(make([]byte, 4096)); err != nil {
					return err
				}
				http.NewResponseController(w).Flush()
				time.Sleep(20 * time.Millisecond)
			}
			return nil
		})
	})
	// Rotation as an operator does it: each file replaced by a rename.
	write := func(cert, key string, l *pki.Leaf) {
		t.Helper()
		p.WriteLeaf(cert+".new", key+".new", l)
		if err := os.Rename(p.Path(cert+".new"), p.Path(cert)); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(p.Path(key+".new"), p.Path(key)); err != nil {
			t.Fatal(err)
		}
	}
	first := p.Leaf(kvsptest.ClientA)
	write("me.pem", "me.key", first)
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: p.Path("me.pem"), Key: p.Path("me.key"), ClientCA: p.Path("ca.pem")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	serverSerial0 := r.Creds.Certificate().Leaf
	if serverSerial0 == nil {
		l, _ := x509.ParseCertificate(r.Creds.Certificate().Certificate[0])
		serverSerial0 = l
	}
	initial := serverSerial0.SerialNumber.String()

	type stats struct{ ok, failed, oldConn int }
	var (
		mu      sync.Mutex
		rotated atomic.Bool // the server certificate was swapped once
		errs    []string
		total   = map[string]*stats{}
		stop    = make(chan struct{})
		wg      sync.WaitGroup
		rotate  = duration / time.Duration(max(1, int(duration/s4Rotate)))
	)
	worker := func(name, proto string, fresh bool) {
		conf := mtls.ClientTLSConfig(creds)
		conf.NextProtos = []string{proto}
		tr := &http.Transport{TLSClientConfig: conf, ForceAttemptHTTP2: proto == "h2", DisableKeepAlives: fresh}
		c := kvsptest.HTTPClient(t, tr)
		st := &stats{}
		mu.Lock()
		total[name] = st
		mu.Unlock()
		wg.Go(func() {
			defer tr.CloseIdleConnections()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				var resp *http.Response
				var body []byte
				var err error
				want := 0
				switch i % 3 {
				case 0:
					resp, body, err = get(c, "GET", r.URL("/r/who"), "", "")
				case 1:
					want = 1000 + i%5000
					resp, body, err = get(c, "PUT", r.URL("/r/echo"), "application/octet-stream", strings.Repeat("x", want))
				case 2:
					want = 8 * 4096
					resp, body, err = get(c, "GET", r.URL("/r/stream"), "", "")
				}
				mu.Lock()
				switch {
				case err != nil:
					st.failed++
					errs = append(errs, name+": "+err.Error())
				case resp.StatusCode/100 != 2 || len(body) != want:
					st.failed++
					errs = append(errs, fmt.Sprintf("%s: %d, %d octets, want %d", name, resp.StatusCode, len(body), want))
				default:
					st.ok++
					if !fresh && rotated.Load() && resp.TLS.PeerCertificates[0].SerialNumber.String() == initial {
						st.oldConn++
					}
				}
				mu.Unlock()
			}
		})
	}
	worker("h2 kept-alive", "h2", false)
	worker("http/1.1 kept-alive", "http/1.1", false)
	worker("h2 fresh", "h2", true)
	worker("http/1.1 fresh", "http/1.1", true)

	// probe makes a new handshake and returns the serials each side saw.
	probe := func() (serverSerial, clientSerial string, err error) {
		tr := &http.Transport{TLSClientConfig: mtls.ClientTLSConfig(creds), ForceAttemptHTTP2: true, DisableKeepAlives: true}
		defer tr.CloseIdleConnections()
		resp, _, err := get(&http.Client{Transport: tr, Timeout: 5 * time.Second}, "GET", r.URL("/r/who"), "", "")
		if err != nil {
			return "", "", err
		}
		if resp.TLS.DidResume {
			return "", "", errors.New("probe resumed a session")
		}
		return resp.TLS.PeerCertificates[0].SerialNumber.String(), resp.Header.Get("X-Client-Serial"), nil
	}
	rotations := 0
	end := time.Now().Add(duration)
	for side := 0; time.Now().Add(rotate).Before(end.Add(time.Millisecond)); side++ {
		time.Sleep(rotate)
		var want string
		if side%2 == 0 {
			l := serverLeaf()
			write("server.pem", "server.key", l)
			rotated.Store(true)
			want = l.Cert.SerialNumber.String()
		} else {
			l := p.Leaf(kvsptest.ClientA)
			write("me.pem", "me.key", l)
			want = l.Cert.SerialNumber.String()
		}
		rotations++
		ss, cs, err := probe()
		if err != nil {
			t.Errorf("rotation %d: probe: %v", rotations, err)
			continue
		}
		if got := map[bool]string{true: ss, false: cs}[side%2 == 0]; got != want {
			t.Errorf("rotation %d (%s): a new handshake shows serial %s, want the new leaf's %s", rotations, map[bool]string{true: "server", false: "client"}[side%2 == 0], got, want)
		}
	}
	close(stop)
	wg.Wait()

	mu.Lock()
	defer mu.Unlock()
	var ok, failed int
	for name, st := range total {
		ok += st.ok
		failed += st.failed
		if st.ok == 0 {
			t.Errorf("%s: no successful request", name)
		}
		if !strings.Contains(name, "fresh") && st.oldConn == 0 {
			t.Errorf("%s: no request on its pre-rotation connection after the rotations began", name)
		}
	}
	t.Logf("%v: %d rotations, %d requests ok, %d failed", duration, rotations, ok, failed)
	if failed > 0 {
		t.Errorf("%d requests failed during rotation, e.g. %v", failed, errs[:min(len(errs), 5)])
	}
	if rotations < 2 || ok < 50 {
		t.Errorf("too little exercised: %d rotations, %d requests", rotations, ok)
	}
	figures.Report(t, figures.Row{Row: "S4", Faults: int64(rotations), Requests: int64(ok),
		Held:   fmt.Sprintf("%v of certificate rotation under load: %d rotations, %d requests, 0 failed", duration, rotations, ok),
		Detail: map[string]float64{"seconds": duration.Seconds(), "rotations": float64(rotations), "requests": float64(ok)}})
}

// s4Duration and s4Rotate size row S4 for make test; each side is swapped
// every 2*s4Rotate.
const (
	s4Duration = 6 * time.Second
	s4Rotate   = time.Second
)

// TestMetrics: requests are counted by route and status on the configured
// registry, with their response octets and durations by route.
// TestSocketsReadAndWriteRaw: Serve reads and writes its TCP connections
// through internal/sockio (raw system calls that leave the runtime's
// monitor thread asleep: TestRawCallsLeaveTheMonitorAsleep), over HTTP/2
// and HTTP/1.1, and with Config.PlainSockets through net.TCPConn's own.
func TestSocketsReadAndWriteRaw(t *testing.T) {
	for _, plain := range []bool{false, true} {
		p := kvsptest.NewPKI(t)
		conns := make(chan net.Conn, 2)
		s := kvsptest.StartServer(t, p, kvsptest.Options{PlainSockets: plain}, func(s *server.Server) {
			s.Mount("/t/").Handle("GET", "conn", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
				conns <- server.NetConnForTest(r)
				return nil
			})
		})
		for _, protos := range [][]string{{"h2"}, {"http/1.1"}} {
			tc := p.ClientTLS(p.Leaf(kvsptest.ClientA))
			tc.NextProtos = protos
			c := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: protos[0] == "h2"})
			resp, err := c.Get(s.URL("/t/conn"))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			got := <-conns
			_, raw := got.(*sockio.Conn)
			if _, tcp := got.(*net.TCPConn); raw == plain || (plain && !tcp) {
				t.Errorf("PlainSockets %v, %s: the request came on a %T", plain, protos[0], got)
			}
		}
	}
}

func TestMetrics(t *testing.T) {
	p := kvsptest.NewPKI(t)
	reg := prometheus.NewRegistry()
	s := kvsptest.StartServer(t, p, kvsptest.Options{Registerer: reg}, echoRoutes)
	c := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: p.ClientTLS(p.Leaf(kvsptest.ClientA))})
	var octets int
	for i := 0; i < 3; i++ {
		resp, err := c.Get(s.URL("/t/any"))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		octets += len(b)
		resp.Body.Close()
	}
	// A request is counted when its handler returns, which may be after
	// the client has read the response.
	counted := func() float64 {
		return kvsptest.MetricSum(t, reg, "kvsp_http_requests_total", map[string]string{"route": "GET /t/any", "code": "200"})
	}
	kvsptest.WaitFor(t, "3 requests counted", func() bool { return counted() >= 3 })
	if n := counted(); n != 3 {
		t.Fatalf("kvsp_http_requests_total{route=GET /t/any,code=200} = %v, want 3", n)
	}
	route := map[string]string{"route": "GET /t/any"}
	if n := kvsptest.MetricSum(t, reg, "kvsp_http_response_bytes_total", route); n != float64(octets) {
		t.Fatalf("kvsp_http_response_bytes_total{route=GET /t/any} = %v, want the %d octets read", n, octets)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var observed uint64
	for _, mf := range mfs {
		if mf.GetName() != "kvsp_http_request_duration_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "route" && l.GetValue() == "GET /t/any" {
					observed += m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	if observed != 3 {
		t.Fatalf("kvsp_http_request_duration_seconds{route=GET /t/any}: %d observations, want 3", observed)
	}
}

// lineWith is the first line of log that holds substr.
func lineWith(log, substr string) string {
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, substr) {
			return l
		}
	}
	return ""
}

// mtlsIdentity is the identity of a client configuration's certificate.
func mtlsIdentity(c *tls.Config) string {
	if len(c.Certificates) == 0 || c.Certificates[0].Leaf == nil {
		return ""
	}
	id, _ := mtls.Identity(c.Certificates[0].Leaf)
	return id
}

// TestS1_ConnectionDoesNotOutliveItsCertificate (RELIABILITY S1, issue
// item 4): a client whose certificate expires while its connection is open
// is refused on that connection (403, the log says why) from the moment
// it expired, over HTTP/2 and HTTP/1.1; the server's clock decides.
func TestS1_ConnectionDoesNotOutliveItsCertificate(t *testing.T) {
	p := kvsptest.NewPKI(t)
	var skew atomic.Int64
	r := startRig(t, p, rigOptions{Now: func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }}, echoRoutes)
	leaf := p.Issue(pki.LeafOptions{URIs: []string{kvsptest.ClientA}, NotAfter: time.Now().Add(time.Hour)})
	for _, proto := range []string{"h2", "http/1.1"} {
		skew.Store(0)
		conf := p.ClientTLS(leaf)
		conf.NextProtos = []string{proto}
		tr := &http.Transport{TLSClientConfig: conf, ForceAttemptHTTP2: proto == "h2"}
		c := kvsptest.HTTPClient(t, tr)
		var conns atomic.Int64
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) {
			if !i.Reused {
				conns.Add(1)
			}
		}}
		do := func() (*http.Response, []byte) {
			req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), "GET", r.URL("/t/any"), nil)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatalf("%s: %v", proto, err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp, b
		}
		if resp, b := do(); resp.StatusCode != 200 {
			t.Fatalf("%s: before expiry: %d %s", proto, resp.StatusCode, b)
		}
		mark := r.Log.Len()
		skew.Store(int64(2 * time.Hour)) // the certificate expired an hour ago
		resp, b := do()
		if resp.StatusCode != 403 || conns.Load() != 1 {
			t.Fatalf("%s: after expiry on the open connection (%d connections): %d %s", proto, conns.Load(), resp.StatusCode, b)
		}
		if !r.Log.WaitFor(mark, "expired", time.Second) {
			t.Fatalf("%s: the log does not say the certificate expired:\n%s", proto, r.Log.Since(mark))
		}
		tr.CloseIdleConnections()
	}
}

// TestHandlerPanicIsAProblem (issue item 8; RELIABILITY B10's "never a
// reset stream"): a handler that panics is answered 500 problem details
// on HTTP/2 and HTTP/1.1, counted, and logged once at warn with the peer
// and where it panicked, without the stack's argument words; the server
// goes on serving.
func TestHandlerPanicIsAProblem(t *testing.T) {
	p := kvsptest.NewPKI(t)
	r := startRig(t, p, rigOptions{}, func(s *server.Server) {
		echoRoutes(s)
		s.Mount("/p/").Handle("GET", "boom", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
			var s []int
			_ = s[len(req.URL.Path)] // index out of range
			return nil
		})
	})
	for _, proto := range []string{"h2", "http/1.1"} {
		conf := p.ClientTLS(p.Leaf(kvsptest.ClientA))
		conf.NextProtos = []string{proto}
		c := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: conf, ForceAttemptHTTP2: proto == "h2"})
		mark := r.Log.Len()
		resp, b, err := get(c, "GET", r.URL("/p/boom"), "", "")
		if err != nil {
			t.Fatalf("%s: %v (a reset stream)", proto, err)
		}
		if resp.StatusCode != 500 || resp.Header.Get("Content-Type") != kvsp.MediaTypeProblem {
			t.Fatalf("%s: %d %q %s", proto, resp.StatusCode, resp.Header.Get("Content-Type"), b)
		}
		line := lineWith(r.Log.Since(mark), "handler panicked")
		if !strings.Contains(line, "level=WARN") || !strings.Contains(line, "peer=127.0.0.1:") || !strings.Contains(line, "index out of range") ||
			!strings.Contains(line, "server_test.go") || strings.Contains(line, "+0x") {
			t.Fatalf("%s: the panic's log line: %q", proto, line)
		}
		if resp, _, err := get(c, "GET", r.URL("/t/any"), "", ""); err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: after the panic: %v", proto, err)
		}
	}
	if n := kvsptest.MetricSum(t, r.Reg, "kvsp_http_handler_panics_total", nil); n != 2 {
		t.Fatalf("panics counted: %v", n)
	}
}

// TestRoutineTrafficIsQuiet (issue item 9): at serve's info level, 200
// successful requests write nothing; 200 identical refusals from one
// identity write a few lines (then one saying how many were left out),
// while the metrics count all 200; refused handshakes likewise.
func TestRoutineTrafficIsQuiet(t *testing.T) {
	p := kvsptest.NewPKI(t)
	r := startRig(t, p, rigOptions{Level: slog.LevelInfo}, echoRoutes)
	c := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: p.ClientTLS(p.Leaf(kvsptest.ClientA)), ForceAttemptHTTP2: true})
	mark := r.Log.Len()
	for range 200 {
		if resp, _, err := get(c, "GET", r.URL("/t/any"), "", ""); err != nil || resp.StatusCode != 200 {
			t.Fatal(err)
		}
	}
	if l := r.Log.Since(mark); l != "" {
		t.Fatalf("routine requests logged at info:\n%s", l)
	}
	for range 200 {
		if resp, _, err := get(c, "POST", r.URL("/t/ctl"), "", ""); err != nil || resp.StatusCode != 403 {
			t.Fatal(err)
		}
	}
	if n := strings.Count(r.Log.Since(mark), "\n"); n == 0 || n > 5 {
		t.Fatalf("200 identical refusals wrote %d lines:\n%s", n, r.Log.Since(mark))
	}
	refusals := func() float64 {
		return kvsptest.MetricSum(t, r.Reg, "kvsp_http_requests_total", map[string]string{"code": "403"})
	}
	kvsptest.WaitFor(t, "200 refusals counted", func() bool { return refusals() >= 200 })
	if n := refusals(); n != 200 {
		t.Fatalf("refusals counted: %v", n)
	}
	mark = r.Log.Len()
	for range 50 {
		conn, err := tls.Dial("tcp", r.Addr, p.ClientTLS(nil))
		if err == nil {
			conn.Read(make([]byte, 1)) // TLS 1.3: the refusal arrives with the first read
			conn.Close()
		}
	}
	time.Sleep(200 * time.Millisecond) // the server logs after the client saw the failure
	if n := strings.Count(r.Log.Since(mark), "TLS handshake refused"); n == 0 || n > 3 {
		t.Fatalf("50 refused handshakes wrote %d lines:\n%s", n, r.Log.Since(mark))
	}
	if n := kvsptest.MetricSum(t, r.Reg, "kvsp_tls_handshake_failures_total", nil); n < 50 {
		t.Fatalf("refused handshakes counted: %v", n)
	}
}

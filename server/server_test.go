package server_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/quic-go/quic-go/http3"
	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/pki"
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

func (e *env) issue(o pki.LeafOptions) *pki.Leaf { return e.PKI.Issue(o) }

func (e *env) write(cert, key string, l *pki.Leaf) { e.PKI.WriteLeaf(cert, key, l) }

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

// TestMTLSMatrix: every way in without a valid, authorized certificate ends
// in a handshake failure or 403, never 2xx (R-HTTP-4, R-HTTP-5, R-SEC-*,
//
func TestMTLSMatrix(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	otherCA, _ := pki.NewCA("other", time.Hour)
	unknownCA, _ := otherCA.Issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/client/a"}})
	expired := e.issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/client/a"}, NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})
	twoURIs := e.issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/client/a", "spiffe://kvsp.test/pc"}})
	twoDNS := e.issue(pki.LeafOptions{DNSNames: []string{"a.kvsp.test", "b.kvsp.test"}})
	tls12 := e.tlsFor(e.clients["spiffe://kvsp.test/client/a"])
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12

	for _, c := range []struct {
		name   string
		client *http.Client
		want   int // 0: a handshake failure
	}{
		{"no certificate", e.client(nil), 0},
		{"unknown CA", e.client(unknownCA), 0},
		{"expired", e.client(expired), 0},
		{"two URI SANs", e.client(twoURIs), 0},
		{"two DNS SANs", e.client(twoDNS), 0},
		{"TLS 1.2 only", e.clientWith(&http.Transport{TLSClientConfig: tls12}), 0},
		{"not in the policy", e.client(e.clients["spiffe://kvsp.test/stranger"]), 403},
		{"DNS SAN identity", e.client(e.clients["dns-only.kvsp.test"]), 200},
		{"authorized", e.client(e.clients["spiffe://kvsp.test/client/a"]), 200},
	} {
		resp, body, err := get(c.client, "GET", e.url("/t/any"), "", "")
		switch {
		case c.want == 0 && err == nil:
			t.Errorf("%s: got %d, want a handshake failure", c.name, resp.StatusCode)
		case c.want != 0 && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.want != 0 && resp.StatusCode != c.want:
			t.Errorf("%s: status %d, want %d: %s", c.name, resp.StatusCode, c.want, body)
		}
	}
	plain := e.clientWith(&http.Transport{})
	if resp, body, err := get(plain, "GET", "http://"+e.addr+"/t/any", "", ""); err == nil && resp.StatusCode < 400 {
		t.Errorf("plain HTTP served: %d %s", resp.StatusCode, body)
	}
}

// TestRevocation: a principal removed by a policy reload is refused on its
// open connection and on a resumed TLS session; a CA rotation refuses
// sessions resumed from tickets of the old CA.
func TestRevocation(t *testing.T) {
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
		{"R-HTTP-1 method", "GET", "/t/lookup", "", "", 405, "about:blank"},
		{"A-29 media type", "POST", "/t/lookup", "application/json", lookup, 415, "about:blank"},
		{"R-REC-2 bad body", "POST", "/t/lookup", kvsp.MediaType, `{"Scope_ID":"x"}`, 400, "about:blank"},
		{"A-29 duplicate", "POST", "/t/lookup", kvsp.MediaType, strings.Replace(lookup, "{", `{"block_keys":[],`, 1), 400, "about:blank"},
		{"A-12 stale epoch", "PUT", "/t/stale", "", "", 409, "https://iana.org/assignments/kvsp#kvsp-stale-epoch"},
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

// TestSlowloris: a client that never finishes its headers is cut off by
// ReadHeaderTimeout while another is served.
func TestSlowloris(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	conf := e.tlsFor(e.clients["spiffe://kvsp.test/client/a"])
	conf.NextProtos = []string{"http/1.1"}
	slow, err := tls.Dial("tcp", e.addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	fmt.Fprintf(slow, "GET /t/any HTTP/1.1\r\nHost: x\r\nX-Slow: ")
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		slow.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := slow.Read(make([]byte, 1))
		done <- err
	}()
	c := e.client(e.clients["spiffe://kvsp.test/client/a"])
	if resp, _, err := get(c, "GET", e.url("/t/any"), "", ""); err != nil || resp.StatusCode != 200 {
		t.Fatalf("other client not served: %v", err)
	}
	err = <-done
	if el := time.Since(start); err == nil || el > 3*time.Second {
		t.Fatalf("slow client not cut off: %v after %v", err, el)
	}
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

// TestCertificateReload: a new server certificate is used by the next
// handshake, without a restart.
func TestCertificateReload(t *testing.T) {
	e := newEnv(t, false, echoRoutes)
	conf := e.tlsFor(e.clients["spiffe://kvsp.test/client/a"])
	serial := func() string {
		c, err := tls.Dial("tcp", e.addr, conf)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	before := serial()
	e.write("server.pem", "server.key", e.issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/server"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}))
	if after := serial(); after == before {
		t.Fatal("server certificate not reloaded")
	}
	var _ = x509.NewCertPool
}

// TestMetrics: requests are counted by route and status on the configured
// registry.
func TestMetrics(t *testing.T) {
	p := kvsptest.NewPKI(t)
	reg := prometheus.NewRegistry()
	s := kvsptest.StartServer(t, p, kvsptest.Options{Registerer: reg}, echoRoutes)
	c := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: p.ClientTLS(p.Leaf(kvsptest.ClientA))})
	for i := 0; i < 3; i++ {
		resp, err := c.Get(s.URL("/t/any"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	n := testutil.ToFloat64(mustCounter(t, reg, "GET /t/any", "200"))
	if n != 3 {
		t.Fatalf("kvsp_http_requests_total{route=GET /t/any,code=200} = %v, want 3", n)
	}
}

func mustCounter(t *testing.T, reg *prometheus.Registry, route, code string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "kvsp_http_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["route"] == route && labels["code"] == code {
				c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
				c.Add(m.GetCounter().GetValue())
				return c
			}
		}
	}
	t.Fatalf("no counter for %s %s", route, code)
	return nil
}

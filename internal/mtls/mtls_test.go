package mtls_test

import (
	"io"
	"net/http"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/pki"
	"github.com/kvsp/kvsp/server"
)

func TestMain(m *testing.M) {
	mtls.ReloadInterval = 0
	goleak.VerifyTestMain(m)
}

// TestClientCertificateReload: a process's client certificate, rotated on
// disk, is presented on its next connection without a restart; server
// certificates are verified against the CA bundle.
func TestClientCertificateReload(t *testing.T) {
	p := kvsptest.NewPKI(t)
	s := kvsptest.StartServer(t, p, kvsptest.Options{}, func(srv *server.Server) {
		srv.Mount("/t/").Handle("GET", "whoami", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			w.Header().Set("Cache-Control", "no-store")
			_, err := io.WriteString(w, server.PrincipalFrom(r.Context()).ID)
			return err
		})
	})
	p.WriteLeaf("me.pem", "me.key", p.Leaf(kvsptest.ClientA))
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: p.Path("me.pem"), Key: p.Path("me.key"), ClientCA: p.Path("ca.pem")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	whoami := func() string {
		tr := &http.Transport{TLSClientConfig: mtls.ClientTLSConfig(creds), ForceAttemptHTTP2: true}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr}).Get(s.URL("/t/whoami"))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	if got := whoami(); got != kvsptest.ClientA {
		t.Fatalf("before rotation: %q", got)
	}
	p.WriteLeaf("me.pem", "me.key", p.Leaf(kvsptest.PC))
	if got := whoami(); got != kvsptest.PC {
		t.Fatalf("after rotation: %q", got)
	}
	// A server whose certificate does not chain to the bundle is refused.
	other, _ := pki.NewCA("other", 3600e9)
	otherLeaf, _ := other.Issue(pki.LeafOptions{URIs: []string{"spiffe://x"}})
	otherLeaf.WriteFiles(p.Path("server.pem"), p.Path("server.key"))
	tr := &http.Transport{TLSClientConfig: mtls.ClientTLSConfig(creds)}
	defer tr.CloseIdleConnections()
	if _, err := (&http.Client{Transport: tr}).Get(s.URL("/t/whoami")); err == nil {
		t.Fatal("a server outside the CA bundle was trusted")
	}
}

func TestIdentityRules(t *testing.T) {
	ca, _ := pki.NewCA("t", 3600e9)
	for _, c := range []struct {
		o    pki.LeafOptions
		want string
	}{
		{pki.LeafOptions{URIs: []string{"spiffe://a/b"}, DNSNames: []string{"x.example"}}, "spiffe://a/b"},
		{pki.LeafOptions{DNSNames: []string{"x.example"}}, "x.example"},
		{pki.LeafOptions{URIs: []string{"spiffe://a", "spiffe://b"}}, ""},
		{pki.LeafOptions{DNSNames: []string{"x.example", "y.example"}}, ""},
		{pki.LeafOptions{}, ""},
	} {
		l, err := ca.Issue(c.o)
		if err != nil {
			t.Fatal(err)
		}
		got, err := mtls.Identity(l.Cert)
		if got != c.want || (c.want == "") != (err != nil) {
			t.Errorf("%+v: %q, %v", c.o, got, err)
		}
	}
}

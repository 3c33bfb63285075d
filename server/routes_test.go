package server_test

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// TestKVSPRouteTable runs every principal kind against every KVSP route of
// the resource table, mounted behind the real adapter: the route answers
// 2xx exactly for its callers and 403 otherwise, with no-store
// (R-HTTP-12..21, R-SEC-3, R-SEC-4, R-PF-12). The handlers here only
// answer 204: the role handlers, with their own scope and speaks_for
// checks, come with their packages.
func TestKVSPRouteTable(t *testing.T) {
	policy := `principals:
  - {id: "spiffe://t/controller", roles: [controller]}
  - {id: "spiffe://t/index", roles: [index]}
  - {id: "spiffe://t/holder", roles: [holder]}
  - {id: "spiffe://t/instance", roles: [instance]}
  - {id: "spiffe://t/client", roles: [client]}
`
	bases := map[server.Role]string{server.RoleIndex: "/is/", server.RoleHolder: "/h1/", server.RoleController: "/pc/", server.RoleInstance: "/ii1/"}
	p := kvsptest.NewPKI(t)
	s := kvsptest.StartServer(t, p, kvsptest.Options{Policy: policy}, func(srv *server.Server) {
		for role, base := range bases {
			r := srv.Mount(base)
			for _, rt := range server.RoutesOf(role) {
				r.Handle(rt.Method, rt.Path, rt.Route(), func(w http.ResponseWriter, req *http.Request) error {
					return server.NoContent(w)
				})
			}
		}
	})
	fill := strings.NewReplacer("{holder}", "aGlk", "{key}", strings.Repeat("ab", 32), "{compat}", strings.Repeat("cd", 32),
		"{scope}", strings.Repeat("ef", 16), "{id}", "lease1", "{instance}", "aW5z", "{session}", "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11")
	if len(server.KVSPRoutes) != 15 {
		t.Fatalf("the spec's resource table has 15 method/path rows; KVSPRoutes has %d", len(server.KVSPRoutes))
	}
	// The table against the spec's rules, independently of the adapter.
	for _, rt := range server.KVSPRoutes {
		var want []server.Role
		switch {
		case rt.Role == server.RoleInstance:
			want = []server.Role{server.RoleController} // R-PF-12, R-SEC-15
		case rt.Role == server.RoleController:
			want = []server.Role{server.RoleInstance}
		case strings.HasPrefix(rt.Path, "replicas/"):
			want = []server.Role{server.RoleHolder} // R-IS-2
		default:
			want = []server.Role{server.RoleController, server.RoleIndex, server.RoleHolder, server.RoleInstance, server.RoleClient}
		}
		if !slices.Equal(rt.Callers, want) {
			t.Errorf("%s %s callers %v, want %v", rt.Method, rt.Path, rt.Callers, want)
		}
	}
	for _, who := range []server.Role{server.RoleController, server.RoleIndex, server.RoleHolder, server.RoleInstance, server.RoleClient} {
		c := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: p.ClientTLS(p.Leaf("spiffe://t/" + string(who))), ForceAttemptHTTP2: true})
		for _, rt := range server.KVSPRoutes {
			req, _ := http.NewRequest(rt.Method, s.URL(bases[rt.Role]+fill.Replace(rt.Path)), nil)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			want := http.StatusForbidden
			if slices.Contains(rt.Callers, who) {
				want = http.StatusNoContent
			}
			if resp.StatusCode != want || resp.Header.Get("Cache-Control") != "no-store" {
				t.Errorf("%s %s %s: %d, want %d", who, rt.Method, rt.Path, resp.StatusCode, want)
			}
		}
	}
}

// TestMountRole: every row needs its handler and every handler its row.
func TestMountRole(t *testing.T) {
	p := kvsptest.NewPKI(t)
	kvsptest.StartServer(t, p, kvsptest.Options{}, func(s *server.Server) {
		noop := func(http.ResponseWriter, *http.Request) error { return nil }
		if err := server.MountRole(s.Mount("/a/"), server.RoleIndex, map[string]server.HandlerFunc{"POST lookup": noop}); err == nil {
			t.Error("missing handlers accepted")
		}
		if err := server.MountRole(s.Mount("/b/"), server.RoleIndex, map[string]server.HandlerFunc{
			"POST lookup": noop, "PUT replicas/{holder}/{key}": noop, "DELETE replicas/{key}": noop}); err == nil {
			t.Error("a handler without a row accepted")
		}
		if err := server.MountRole(s.Mount("/c/"), server.RoleIndex, map[string]server.HandlerFunc{
			"POST lookup": noop, "PUT replicas/{holder}/{key}": noop, "DELETE replicas/{holder}/{key}": noop}); err != nil {
			t.Error(err)
		}
	})
}

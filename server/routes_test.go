package server_test

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// TestS2_RoleRouteAuthorizationMatrix is row S2 of RELIABILITY.md: every
// route of the spec's resource table (lookup, replicas PUT/DELETE, blocks
// GET/PUT, leases, status, checkpoint, prefetch, resume, reshard, state)
// against every identity (PC, IS, holders h1 and h2, a holder delegated for
// h1, instances ii7 and ii9, a producer tool, an outsider with a CA-signed
// certificate not in the policy), behind the real adapter, with the real Index Service on the
// IS routes. Only the allowed pairs succeed (R-SEC-2, R-SEC-3, R-SEC-4,
// R-SEC-6, R-SEC-15, R-PF-12); the IS refuses a record whose holder is not
// the caller unless the caller is delegated for it (R-IS-2, R-SEC-7);
// only instances and producers store blocks (S13); instances take
// directives from the PC only; every denial is a 403
// problem with no-store and increments kvsp_http_requests_total{code="403"}
// for its route; and authorization fails closed when the policy is missing
// or ambiguous (see s2FailClosed).
func TestS2_RoleRouteAuthorizationMatrix(t *testing.T) {
	const (
		pc, is, h1, h2, hd = "spiffe://kvsp.test/pc", "spiffe://kvsp.test/is", "spiffe://kvsp.test/holder/h1", "spiffe://kvsp.test/holder/h2", "spiffe://kvsp.test/holder/hd"
		ii7, ii9, outsider = "spiffe://kvsp.test/instance/ii7", "spiffe://kvsp.test/instance/ii9", "spiffe://kvsp.test/outsider"
		tool               = "spiffe://kvsp.test/producer/tool" // the producer role only
	)
	ids := []string{pc, is, h1, h2, hd, ii7, ii9, tool, outsider}
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
		case rt.Method == "PUT" && strings.HasPrefix(rt.Path, "blocks/"):
			want = []server.Role{server.RoleInstance, server.RoleProducer} // S13: producers of KV only
		default:
			want = []server.Role{server.RoleController, server.RoleIndex, server.RoleHolder, server.RoleInstance, server.RoleClient, server.RoleProducer}
		}
		if !slices.Equal(rt.Callers, want) {
			t.Errorf("%s %s callers %v, want %v", rt.Method, rt.Path, rt.Callers, want)
		}
	}

	reg := prometheus.NewRegistry()
	p := kvsptest.NewPKI(t)
	mem := index.NewMemory(time.Minute)
	t.Cleanup(func() { mem.Close() })
	is1, err := index.New(index.Config{MaxTTL: time.Hour, MaxLookupKeys: 64}, mem)
	if err != nil {
		t.Fatal(err)
	}
	// The other roles' handlers make the checks their packages make,
	// through the same Principal methods: scope membership for blocks and
	// leases (R-SEC-6), speaks_for for status and checkpoints (the session
	// here is assigned to ii7, A-24); directives need nothing beyond the
	// route's roles.
	scopeOf := func(r *http.Request) (kvsp.ScopeID, error) {
		if s := r.PathValue("scope"); s != "" {
			return kvsp.ParseScopeID(s)
		}
		var q kvsp.LeaseRequest
		if err := server.DecodeJSON(r, &q); err != nil {
			return kvsp.ScopeID{}, err
		}
		return q.ScopeID, nil
	}
	var base func(string) string
	srv := kvsptest.StartServer(t, p, kvsptest.Options{Registerer: reg, Policy: "principals: []\n"}, func(s *server.Server) {
		if err := is1.Mount(s.Mount("/is/")); err != nil {
			t.Fatal(err)
		}
		for _, b := range []string{"/h1/", "/pc/", "/ii7/"} {
			r := s.Mount(b)
			for _, rt := range server.RoutesOf(map[string]server.Role{"/h1/": server.RoleHolder, "/pc/": server.RoleController, "/ii7/": server.RoleInstance}[b]) {
				r.Handle(rt.Method, rt.Path, rt.Route(), func(w http.ResponseWriter, req *http.Request) error {
					pr := server.PrincipalFrom(req.Context())
					switch {
					case strings.HasPrefix(rt.Path, "blocks/") || (rt.Path == "leases" && rt.Method == "POST"):
						sc, err := scopeOf(req)
						if err != nil {
							return err
						}
						if !pr.MayUseScope(sc) {
							return kvsp.ErrScopeDenied
						}
					case rt.Path == "instances/{instance}/status":
						if req.PathValue("instance") != kvsp.ResourceID(base("/ii7/")) || !pr.SpeaksFor(base("/ii7/")) {
							return fmt.Errorf("%w: not this instance", kvsp.ErrForbidden)
						}
					case rt.Path == "sessions/{session}/checkpoint":
						if !pr.SpeaksFor(base("/ii7/")) {
							return fmt.Errorf("%w: not the session's instance", kvsp.ErrForbidden)
						}
					}
					return server.NoContent(w)
				})
			}
		}
	})
	base = func(b string) string { return srv.URL(b) }
	policy := `principals:
  - {id: "` + pc + `", roles: [controller], scopes: [` + testScope + `]}
  - {id: "` + is + `", roles: [index]}
  - {id: "` + h1 + `", roles: [holder], speaks_for: ["` + base("/h1/") + `"], scopes: [` + testScope + `]}
  - {id: "` + h2 + `", roles: [holder], speaks_for: ["` + base("/h2/") + `"], scopes: [` + testScope + `]}
  - {id: "` + hd + `", roles: [holder], speaks_for: ["` + base("/hd/") + `", "` + base("/h1/") + `"], scopes: [` + testScope + `]}
  - {id: "` + ii7 + `", roles: [instance, client], speaks_for: ["` + base("/ii7/") + `"], scopes: [` + testScope + `]}
  - {id: "` + ii9 + `", roles: [instance, client], speaks_for: ["` + base("/ii9/") + `"], scopes: [` + testScope + `]}
  - {id: "` + tool + `", roles: [producer], scopes: [` + testScope + `]}
`
	if err := os.WriteFile(p.Path("policy.yaml"), []byte(policy), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := srv.Policy.Reload(); err != nil {
		t.Fatal(err)
	}

	scope, _ := kvsp.ParseScopeID(testScope)
	key := strings.Repeat("ab", 32)
	replica := func(holder string) string {
		rec := kvsp.ReplicaRecord{
			BlockKey: mustParse(kvsp.ParseBlockKey(key)), CompatID: mustParse(kvsp.ParseCompatID(strings.Repeat("cd", 32))), ScopeID: scope,
			Holder: holder, Codec: kvsp.CodecRaw, Size: 4096, Digest: mustParse(kvsp.ParseDigest("sha-256:" + strings.Repeat("ef", 32))),
			Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 1}}}, TTLMs: 60000,
		}
		b, err := kvsp.Marshal(&rec)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	lookup := `{"scope_id":"` + testScope + `","compat_id":"` + strings.Repeat("cd", 32) + `","block_keys":["` + key + `"]}`
	lease := `{"scope_id":"` + testScope + `","compat_id":"` + strings.Repeat("cd", 32) + `","block_keys":["` + key + `"],"ttl_ms":1000}`
	h1id := kvsp.ResourceID(base("/h1/"))
	type call struct {
		name, method, path, body string
		route                    string // the adapter's pattern, for the metric
		ok                       []string
		okStatus                 int
	}
	calls := []call{
		{"lookup", "POST", "/is/lookup", lookup, "POST /is/lookup", []string{pc, h1, h2, hd, ii7, ii9, tool}, 200},
		{"publish for h1", "PUT", "/is/replicas/" + h1id + "/" + key, replica(base("/h1/")), "PUT /is/replicas/{holder}/{key}", []string{h1, hd}, 0},
		{"publish for h2", "PUT", "/is/replicas/" + kvsp.ResourceID(base("/h2/")) + "/" + key, replica(base("/h2/")), "PUT /is/replicas/{holder}/{key}", []string{h2}, 0},
		{"withdraw for h1", "DELETE", "/is/replicas/" + h1id + "/" + key, "", "DELETE /is/replicas/{holder}/{key}", []string{h1, hd}, 204},
		{"block GET", "GET", "/h1/blocks/" + strings.Repeat("cd", 32) + "/" + testScope + "/" + key, "", "GET /h1/blocks/{compat}/{scope}/{key}", []string{pc, h1, h2, hd, ii7, ii9, tool}, 204},
		{"block GET, other scope", "GET", "/h1/blocks/" + strings.Repeat("cd", 32) + "/" + strings.Repeat("ee", 16) + "/" + key, "", "GET /h1/blocks/{compat}/{scope}/{key}", nil, 204},
		{"block PUT", "PUT", "/h1/blocks/" + strings.Repeat("cd", 32) + "/" + testScope + "/" + key, "", "PUT /h1/blocks/{compat}/{scope}/{key}", []string{ii7, ii9, tool}, 204},
		{"lease", "POST", "/h1/leases", lease, "POST /h1/leases", []string{pc, h1, h2, hd, ii7, ii9, tool}, 204},
		{"lease renew", "PUT", "/h1/leases/l1", "", "PUT /h1/leases/{id}", []string{pc, is, h1, h2, hd, ii7, ii9, tool}, 204},
		{"lease release", "DELETE", "/h1/leases/l1", "", "DELETE /h1/leases/{id}", []string{pc, is, h1, h2, hd, ii7, ii9, tool}, 204},
		{"status of ii7", "PUT", "/pc/instances/" + kvsp.ResourceID(base("/ii7/")) + "/status", "", "PUT /pc/instances/{instance}/status", []string{ii7}, 204},
		{"checkpoint of ii7's session", "PUT", "/pc/sessions/6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11/checkpoint", "", "PUT /pc/sessions/{session}/checkpoint", []string{ii7}, 204},
		{"prefetch", "POST", "/ii7/prefetch", "", "POST /ii7/prefetch", []string{pc}, 204},
		{"prefetch status", "GET", "/ii7/prefetch/d1", "", "GET /ii7/prefetch/{id}", []string{pc}, 204},
		{"resume", "POST", "/ii7/sessions/6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11/resume", "", "POST /ii7/sessions/{session}/resume", []string{pc}, 204},
		{"reshard", "POST", "/ii7/reshard", "", "POST /ii7/reshard", []string{pc}, 204},
		{"state", "PUT", "/ii7/state", "", "PUT /ii7/state", []string{pc}, 204},
	}
	routesSeen := map[string]bool{}
	for _, c := range calls {
		routesSeen[c.route] = true
	}
	if len(routesSeen) != len(server.KVSPRoutes) {
		t.Fatalf("the matrix covers %d routes of %d", len(routesSeen), len(server.KVSPRoutes))
	}
	clients := map[string]*http.Client{}
	for _, id := range ids {
		clients[id] = kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: p.ClientTLS(p.Leaf(id)), ForceAttemptHTTP2: true})
	}
	do := func(id string, c call) (*http.Response, []byte) {
		t.Helper()
		req, _ := http.NewRequest(c.method, srv.URL(c.path), strings.NewReader(c.body))
		if c.body != "" {
			req.Header.Set("Content-Type", kvsp.MediaType)
		}
		resp, err := clients[id].Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", id, c.name, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, b
	}
	denials := func(route string) float64 { return counterValue(t, reg, route, "403") }
	allowed := 0
	for _, c := range calls {
		for _, id := range ids {
			if c.method == "DELETE" && strings.HasPrefix(c.path, "/is/") {
				// A record to withdraw, whoever asks.
				if resp, body := do(h1, calls[1]); resp.StatusCode/100 != 2 {
					t.Fatalf("setup publish: %d %s", resp.StatusCode, body)
				}
			}
			before := denials(c.route)
			resp, body := do(id, c)
			ok := slices.Contains(c.ok, id)
			if ok {
				allowed++
				want := c.okStatus
				if (want == 0 && resp.StatusCode/100 != 2) || (want != 0 && resp.StatusCode != want) {
					t.Errorf("%s %s: %d, want success (%d): %s", id, c.name, resp.StatusCode, want, body)
				}
				continue
			}
			if resp.StatusCode != http.StatusForbidden {
				t.Errorf("%s %s: %d, want 403: %s", id, c.name, resp.StatusCode, body)
				continue
			}
			if resp.Header.Get("Content-Type") != kvsp.MediaTypeProblem || resp.Header.Get("Cache-Control") != "no-store" {
				t.Errorf("%s %s: 403 without a no-store problem: %q %q", id, c.name, resp.Header.Get("Content-Type"), resp.Header.Get("Cache-Control"))
			}
			// Counted when the handler returns, maybe after the client read the 403.
			kvsptest.WaitFor(t, c.name+": its 403 counted", func() bool { return denials(c.route)-before >= 1 })
			if got := denials(c.route) - before; got != 1 {
				t.Errorf("%s %s: the 403 counter of %s moved by %v, want 1", id, c.name, c.route, got)
			}
		}
	}
	if allowed < 40 {
		t.Fatalf("only %d allowed pairs: the matrix proves little", allowed)
	}
	s2FailClosed(t, srv, reg, clients[pc], srv.URL("/ii7/state"), "PUT /ii7/state")
}

// s2FailClosed: with no policy in force every request is a counted 403,
// even the PC's on a PC route; a policy file that is ambiguous (two YAML
// documents, a duplicate identity or key, an unknown role or field, a role
// in another case) is refused at load and on reload, and the policy in
// force stays.
func s2FailClosed(t *testing.T, srv *kvsptest.Server, reg *prometheus.Registry, pc *http.Client, url, route string) {
	t.Helper()
	put := func() int {
		req, _ := http.NewRequest("PUT", url, nil)
		resp, err := pc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if st := put(); st != 204 {
		t.Fatalf("control: PC PUT state = %d", st)
	}
	good := srv.Policy.Policy()
	srv.Policy.Set(nil)
	before := counterValue(t, reg, route, "403")
	if st := put(); st != 403 {
		t.Errorf("policy missing: PC PUT state = %d, want 403", st)
	}
	kvsptest.WaitFor(t, "policy missing: the 403 counted", func() bool { return counterValue(t, reg, route, "403")-before >= 1 })
	if got := counterValue(t, reg, route, "403") - before; got != 1 {
		t.Errorf("policy missing: 403 counter moved by %v", got)
	}
	srv.Policy.Set(good)

	const ok = `  - {id: "spiffe://x/pc", roles: [controller]}` + "\n"
	for name, text := range map[string]string{
		"two YAML documents":      "principals:\n" + ok + "---\nprincipals:\n  - {id: \"spiffe://x/pc\", roles: [client]}\n",
		"identity listed twice":   "principals:\n" + ok + ok,
		"duplicate key":           "principals:\n  - {id: \"spiffe://x/pc\", roles: [controller], roles: [client]}\n",
		"duplicate top-level key": "principals:\n" + ok + "principals:\n" + ok,
		"unknown role":            "principals:\n  - {id: \"spiffe://x/pc\", roles: [admin]}\n",
		"role in another case":    "principals:\n  - {id: \"spiffe://x/pc\", roles: [Controller]}\n",
		"unknown field":           "principals:\n  - {id: \"spiffe://x/pc\", role: [controller]}\n",
		"no roles":                "principals:\n  - {id: \"spiffe://x/pc\"}\n",
		"no id":                   "principals:\n  - {roles: [controller]}\n",
		"null entry":              "principals:\n" + ok + "  - ~\n",
		"bad scope":               "principals:\n  - {id: \"spiffe://x/pc\", roles: [client], scopes: [ABCD]}\n",
		"unnormalised speaks_for": "principals:\n  - {id: \"spiffe://x/h\", roles: [holder], speaks_for: [\"https://H.example:443/h\"]}\n",
		"empty file":              "",
		"not a mapping":           "- a\n- b\n",
	} {
		if _, err := server.ParsePolicy([]byte(text)); err == nil {
			t.Errorf("%s: policy accepted", name)
		}
		path := srv.PKI.Path("ambiguous.yaml")
		os.WriteFile(path, []byte(text), 0o644)
		if _, err := server.LoadPolicyStore(path, nil); err == nil {
			t.Errorf("%s: a process would start with it", name)
		}
		os.WriteFile(srv.PKI.Path("policy.yaml"), []byte(text), 0o644)
		if err := srv.Policy.Reload(); err == nil {
			t.Errorf("%s: reloaded", name)
		}
		if srv.Policy.Policy() != good {
			t.Errorf("%s: the policy in force changed", name)
			srv.Policy.Set(good)
		}
	}
	if _, err := server.New(server.Config{Credentials: srv.Creds, Policy: server.NewStaticPolicyStore(nil)}); err == nil {
		t.Error("server.New accepted a missing policy")
	}
}

func mustParse[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// counterValue returns kvsp_http_requests_total{route, code}, 0 when the
// series does not exist yet.
func counterValue(t *testing.T, reg *prometheus.Registry, route, code string) float64 {
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
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
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

// TestCheckpointBodiesFit: the two routes whose body is a Session
// Checkpoint (PUT checkpoint at the PC, POST resume at the instance) take
// one of a session of 2^20 tokens (TestCheckpointOfTheLongestSession
// sends one to the PC); the default 1 MiB refused them.
func TestCheckpointBodiesFit(t *testing.T) {
	n := 0
	for _, rt := range server.KVSPRoutes {
		if rt.Path == "sessions/{session}/checkpoint" || rt.Path == "sessions/{session}/resume" {
			n++
			if rt.MaxBody < server.MaxCheckpointBody {
				t.Errorf("%s %s: body limit %d, under MaxCheckpointBody", rt.Method, rt.Path, rt.MaxBody)
			}
		}
	}
	if n != 2 {
		t.Fatalf("%d checkpoint routes, want 2", n)
	}
}

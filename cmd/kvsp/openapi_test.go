package main

import (
	"context"
	"io"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"

	"github.com/kvsp/kvsp/gateway"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/server"
)

// openAPIDoc is what the route test reads of api/openapi.yaml: each path
// item's operations and the role whose base URI they are under.
type openAPIDoc struct {
	Paths map[string]map[string]yaml.Node `yaml:"paths"`
}

// documentedRoutes returns "METHOD role /path" for every operation of
// api/openapi.yaml.
func documentedRoutes(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "api", "openapi.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var doc openAPIDoc
	if err := yaml.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	var out []string
	for path, item := range doc.Paths {
		for method, node := range item {
			switch method {
			case "get", "put", "post", "delete", "patch", "head", "options", "trace":
			default:
				continue // servers, parameters
			}
			var op struct {
				Role string   `yaml:"x-kvsp-role"`
				Tags []string `yaml:"tags"`
			}
			if err := node.Decode(&op); err != nil {
				t.Fatal(err)
			}
			role := op.Role
			if slices.Contains(op.Tags, "gateway") {
				role = "gateway"
			}
			if role == "" {
				t.Errorf("%s %s: no x-kvsp-role", method, path)
			}
			out = append(out, strings.ToUpper(method)+" "+role+" "+path)
		}
	}
	slices.Sort(out)
	return out
}

// TestOpenAPIMatchesRouter: every route `kvsp serve` mounts (every role
// of examples/dev/kvsp.yaml, a holder with RDMA reads, and the gateway)
// is an operation of api/openapi.yaml under its role, and every operation
// of the document is a mounted route; the catch-all and the 405 answers
// of each path are not routes.
func TestOpenAPIMatchesRouter(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"kvsp.yaml", "descriptor.json"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "examples", "dev", f))
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, dir, f, string(b))
	}
	cfgPath := filepath.Join(dir, "kvsp.yaml")
	if code, out, errs := runCLI(t, "certs", "--config", cfgPath); code != 0 {
		t.Fatalf("certs: %s %s", out, errs)
	}
	cfg, err := config.Load(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: cfg.TLS.Cert, Key: cfg.TLS.Key, ClientCA: cfg.TLS.ClientCA}, log)
	if err != nil {
		t.Fatal(err)
	}
	policy, err := server.LoadPolicyStore(cfg.Policy, log)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := server.New(server.Config{Credentials: creds, Policy: policy, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	var roles mounted
	closeRoles, err := mountRoles(srv, cfg, log, prometheus.NewRegistry(), &roles)
	if err != nil {
		t.Fatal(err)
	}
	defer closeRoles()
	// RDMA reads are mounted by a holder with an RDMA device only: one
	// on the in-process fabric, under its own base.
	target := rdma.NewTarget(rdma.NewFabric().Provider("h"))
	defer target.Close()
	h, err := holder.New(holder.Config{Base: "https://127.0.0.1:8443/hr/", RDMA: target, Capacity: 1 << 20, Registerer: prometheus.NewRegistry(),
		LeaseQuota: holder.LeaseQuota{Octets: 1 << 20, MaxTTL: 60e9, MaxLeases: 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(context.Background())
	if err := h.Mount(srv.Mount("/hr/")); err != nil {
		t.Fatal(err)
	}

	bases := map[string]string{"/hr/": "holder"}
	add := func(base, role string) {
		u, err := url.Parse(base)
		if err != nil {
			t.Fatal(err)
		}
		bases[u.Path] = role
	}
	add(cfg.Index.Base, "index")
	add(cfg.Controller.Base, "controller")
	for _, x := range cfg.Holders {
		add(x.Base, "holder")
	}
	for _, x := range cfg.Instances {
		add(x.Base, "instance")
	}
	seen := map[string]bool{}
	var mounted []string
	for _, r := range srv.Routes() {
		method, path, _ := strings.Cut(r, " ")
		role := ""
		for base, ro := range bases {
			if rel, ok := strings.CutPrefix(path, base); ok {
				role, path = ro, "/"+rel
			}
		}
		if role == "" {
			t.Errorf("%s: under no role's base", r)
			continue
		}
		if k := method + " " + role + " " + path; !seen[k] { // two holders mount the same routes
			seen[k] = true
			mounted = append(mounted, k)
		}
	}
	for _, r := range gateway.Routes() {
		method, path, _ := strings.Cut(r, " ")
		mounted = append(mounted, method+" gateway "+path)
	}
	slices.Sort(mounted)
	documented := documentedRoutes(t)
	for _, r := range mounted {
		if !slices.Contains(documented, r) {
			t.Errorf("mounted, not in api/openapi.yaml: %s", r)
		}
	}
	for _, r := range documented {
		if !slices.Contains(mounted, r) {
			t.Errorf("in api/openapi.yaml, not mounted: %s", r)
		}
	}
	if len(mounted) < 20 {
		t.Fatalf("only %d routes mounted: %v", len(mounted), mounted)
	}
	t.Logf("%d routes, each documented", len(mounted))
}

package kvsp_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// goPackage is what `go list -json` says of a package.
type goPackage struct {
	ImportPath string
	Deps       []string
	CgoFiles   []string
	Imports    []string
}

func goList(t *testing.T, env []string, tags string, args ...string) []goPackage {
	t.Helper()
	gobin := "go"
	if root := os.Getenv("GOROOT"); root != "" {
		if p := filepath.Join(root, "bin", "go"); fileExists(p) {
			gobin = p
		}
	}
	cmd := exec.Command(gobin, append([]string{"list", "-json", "-tags", tags}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil { // a rule that can be skipped is not a rule
		t.Fatalf("go list %v: %v\n%s", args, err, stderr.String())
	}
	var pkgs []goPackage
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for dec.More() {
		var p goPackage
		if err := dec.Decode(&p); err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// mayImport is the module's import graph as it is allowed to be: every
// package, by its path in the module ("" is kvsp itself), with the
// project packages its production code may import (tests import what
// they need). A package missing from the table fails the test, so a new
// one is placed in the graph when it is added; an import the table does
// not list fails it too. cmd/kvsp wires every role and may import any
// package.
var mayImport = map[string][]string{
	// The protocol core and the container: leaves.
	"":          {},
	"container": {},
	// Transports.
	"client":   {"", "container", "internal/sockio"},
	"server":   {"", "internal/h2", "internal/mtls", "internal/sockio", "internal/udpbuf"},
	"quicbulk": {"", "internal/udpbuf"},
	// Accelerator and fabric bindings: they import no project package,
	// and only tier and cmd/kvsp import them.
	"gpu":  {},
	"rdma": {},
	// Where a holder's blocks live.
	"tier": {"", "container", "gpu", "internal/failpoint"},
	// Engines.
	"engine":           {"", "container"},
	"engine/attach":    {""},
	"engine/connected": {"", "container", "engine", "engine/attach", "tier"},
	"engine/llamacpp":  {"", "container", "engine", "internal/gguf"},
	"engine/sim":       {"", "container", "engine"},
	// Roles.
	"holder":                 {"", "client", "container", "engine/attach", "internal/failpoint", "server", "tier"},
	"controlplane/index":     {"", "server"},
	"controlplane/instance":  {"", "client", "container", "engine", "server"},
	"controlplane/placement": {"", "client", "controlplane/index", "internal/failpoint", "server"},
	"gateway":                {"", "client", "engine/llamacpp", "server"}, // the OpenAI API: a front end, tokenizing with the model's vocabulary
	"cmd/kvsp":               {"*"},
	// Internal helpers.
	"internal/benchratio": {},
	"internal/chart":      {},
	"internal/config":     {""},
	"internal/dsim":       {},
	"internal/failpoint":  {},
	"internal/faultproxy": {},
	"internal/figures":    {},
	"internal/gguf":       {},
	"internal/h2":         {},
	"internal/kvsptest":   {"internal/h2", "internal/mtls", "internal/pki", "server"},
	"internal/mtls":       {},
	"internal/docs":       {},
	"internal/mutants":    {},
	"internal/nightly":    {"internal/figures"},
	"internal/pki":        {},
	"internal/simnet":     {},
	"internal/sockio":     {},
	"internal/vectors":    {"", "container"}, // make vectors: the shared test vectors, from the Go implementation
	"internal/udpbuf":     {},
}

// TestDependencyDirections enforces the layout rules of STYLE.md section 1:
//   - every package imports only the project packages mayImport gives it,
//     in the CPU build (-tags nogpu, CGO_ENABLED=0) and in the GPU node's
//     build (cgo, -tags rdma); only tier and cmd/... import gpu or rdma;
//   - kvsp and container are leaves: standard library (and, for kvsp, the
//     JSON and JCS modules) only, and never net/http;
//   - everything outside gpu, rdma and cmd builds with CGO_ENABLED=0;
//   - no production package imports testing or internal/kvsptest.
func TestDependencyDirections(t *testing.T) {
	const mod = "github.com/kvsp/kvsp"
	rel := func(p string) string { return strings.TrimPrefix(strings.TrimPrefix(p, mod), "/") }
	under := func(p, dir string) bool { r := rel(p); return r == dir || strings.HasPrefix(r, dir+"/") }
	for pkg, allowed := range mayImport {
		if (slices.Contains(allowed, "gpu") || slices.Contains(allowed, "rdma")) && pkg != "tier" && pkg != "cmd/kvsp" {
			t.Errorf("mayImport lets %q import gpu or rdma: only tier and cmd may", pkg)
		}
	}
	builds := []struct {
		env  []string
		tags string
	}{{[]string{"CGO_ENABLED=0"}, "nogpu"}, {[]string{"CGO_ENABLED=1"}, "rdma"}}
	for _, b := range builds {
		pkgs := goList(t, b.env, b.tags, "./...")
		if len(pkgs) == 0 {
			t.Fatal("go list found no packages")
		}
		seen := map[string]bool{}
		for _, p := range pkgs {
			r := rel(p.ImportPath)
			seen[r] = true
			allowed, ok := mayImport[r]
			if !ok {
				t.Errorf("%s is not in mayImport: give it its row (which project packages it may import)", p.ImportPath)
				continue
			}
			for _, d := range p.Imports {
				if d != mod && !strings.HasPrefix(d, mod+"/") {
					continue
				}
				if !slices.Contains(allowed, rel(d)) && !slices.Contains(allowed, "*") {
					t.Errorf("%s imports %s (%s build): mayImport does not allow it", p.ImportPath, d, b.tags)
				}
			}
		}
		for pkg := range mayImport {
			if !seen[pkg] {
				t.Errorf("mayImport has a row for %q, which go list does not find (%s build)", pkg, b.tags)
			}
		}
		if b.tags != "nogpu" {
			continue
		}
		for _, p := range pkgs {
			r := rel(p.ImportPath)
			switch r {
			case "", "container":
				for _, d := range p.Deps {
					if d == "net/http" || strings.HasPrefix(d, "net/http/") {
						t.Errorf("%s depends on %s: the protocol core does no network I/O", p.ImportPath, d)
					}
					if !isStd(d) && !strings.HasPrefix(d, "github.com/gowebpki/jcs") &&
						!strings.HasPrefix(d, "github.com/go-json-experiment/json") && !(r == "" && strings.HasPrefix(d, mod)) {
						t.Errorf("%s depends on %s: leaves import the standard library (kvsp: plus JSON/JCS)", p.ImportPath, d)
					}
				}
			}
			if !under(p.ImportPath, "gpu") && !under(p.ImportPath, "rdma") && !under(p.ImportPath, "cmd") && len(p.CgoFiles) > 0 {
				t.Errorf("%s has cgo files %v: it must build with CGO_ENABLED=0", p.ImportPath, p.CgoFiles)
			}
			if !under(p.ImportPath, "internal/kvsptest") {
				if slices.Contains(p.Deps, "testing") {
					t.Errorf("%s (production code) links package testing", p.ImportPath)
				}
				if slices.Contains(p.Deps, mod+"/internal/kvsptest") {
					t.Errorf("%s (production code) imports internal/kvsptest", p.ImportPath)
				}
			}
		}
	}
}

// isStd reports a standard-library import path: its first element has no
// dot (golang.org/x/... vendored into std appear as vendor/...).
func isStd(p string) bool {
	first, _, _ := strings.Cut(p, "/")
	return !strings.Contains(first, ".")
}

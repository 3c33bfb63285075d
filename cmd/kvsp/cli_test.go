package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const appendixDescriptor = `{
  "model": "example-model",
  "tokenizer_digest": "sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c",
  "model_digest": "sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda",
  "layers": 32, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16",
  "positional": "rope", "block_tokens": 4, "layout": "kvsp-layout-1"
}`

func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(args, &out, &errb)
	return code, out.String(), errb.String()
}

// TestCompat: a pretty-printed, reordered appendix descriptor gives the
// appendix compat_id (R-CMP-13, R-CMP-14).
func TestCompat(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "d.json")
	if err := os.WriteFile(p, []byte(appendixDescriptor), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, errs := runCLI(t, "keys", "compat", p)
	if code != 0 || strings.TrimSpace(out) != "5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f" {
		t.Fatalf("compat: code %d out %q err %q", code, out, errs)
	}
	if code, _, _ := runCLI(t, "keys", "compat"); code != 2 {
		t.Errorf("compat without file: code %d, want 2", code)
	}
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(strings.Replace(appendixDescriptor, `"bf16"`, `"BF16"`, 1)), 0o644)
	if code, _, errs := runCLI(t, "keys", "compat", bad); code != 1 || !strings.Contains(errs, "kv_dtype") {
		t.Errorf("bad descriptor: code %d err %q", code, errs)
	}
}

// TestKeys: a new key file is private, and its scope_id is reproducible;
// the key itself is never printed (R-KEY-1).
func TestKeys(t *testing.T) {
	p := filepath.Join(t.TempDir(), "scope.key")
	code, out, _ := runCLI(t, "keys", "new", p)
	if code != 0 || len(strings.TrimSpace(out)) != 32 {
		t.Fatalf("keys new: code %d out %q", code, out)
	}
	fi, err := os.Stat(p)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v, %v", fi.Mode(), err)
	}
	key, _ := os.ReadFile(p)
	if strings.Contains(out, strings.TrimSpace(string(key))) {
		t.Fatal("keys new printed the key")
	}
	code, out2, _ := runCLI(t, "keys", "id", p)
	if code != 0 || out2 != out {
		t.Fatalf("keys id: code %d out %q, want %q", code, out2, out)
	}
	if code, _, _ := runCLI(t, "keys", "new", p); code != 1 {
		t.Error("keys new overwrote an existing key file")
	}
}

func TestDigest(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "model-00001.safetensors"), []byte("abc"), 0o644)
	os.WriteFile(filepath.Join(dir, "config.json"), []byte("{}"), 0o644)
	code, out, _ := runCLI(t, "digest", "model", dir)
	// SHA-256("abc"): config.json is not a weight file.
	if code != 0 || strings.TrimSpace(out) != "sha-256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad" {
		t.Fatalf("digest model: %d %q", code, out)
	}
	code, out, _ = runCLI(t, "digest", "file", filepath.Join(dir, "config.json"))
	if code != 0 || strings.TrimSpace(out) != "sha-256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a" {
		t.Fatalf("digest file: %d %q", code, out)
	}
}

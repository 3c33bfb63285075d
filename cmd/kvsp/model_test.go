package main

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/gguf"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestModelTiny: the command writes exactly gguf.WriteTinyLlama's octets
// for its flags, atomically, and prints their size and digest.
func TestModelTiny(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "tiny.gguf")
	code, stdout, stderr := runCLI(t, "model", "tiny", "--out", out, "--layers", "1", "--embd", "32", "--heads", "2",
		"--kv-heads", "1", "--ff", "64", "--vocab", "64", "--context", "128", "--seed", "5", "--name", "t1")
	if code != 0 {
		t.Fatalf("code %d: %s", code, stderr)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var want bytes.Buffer
	p := gguf.TinyParams{Name: "t1", Layers: 1, Embd: 32, Heads: 2, KVHeads: 1, FF: 64, Vocab: 64, Context: 128, Seed: 5}
	if err := gguf.WriteTinyLlama(&want, p); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want.Bytes()) {
		t.Fatal("the file differs from WriteTinyLlama's output")
	}
	if line := fmt.Sprintf("%s: %d octets, sha256 %x\n", out, len(got), sha256.Sum256(got)); stdout != line {
		t.Errorf("stdout %q, want %q", stdout, line)
	}
	if fi, _ := os.Stat(out); fi.Mode().Perm() != 0o644 {
		t.Errorf("mode %v", fi.Mode())
	}
	f, err := gguf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	if name, _ := f.String("general.name"); name != "t1" {
		t.Errorf("general.name %q", name)
	}

	// Defaults: DefaultTiny; an existing file is replaced, no temporary left.
	if code, _, stderr := runCLI(t, "model", "tiny", "--out", out); code != 0 {
		t.Fatalf("defaults: code %d: %s", code, stderr)
	}
	f, err = gguf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := f.Uint("llama.block_count"); n != uint64(gguf.DefaultTiny().Layers) {
		t.Errorf("default layers %d", n)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("directory holds %d entries", len(ents))
	}
}

func TestModelUsage(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "m.gguf")
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"model"}, 2, "model takes tiny"},
		{[]string{"model", "nope"}, 2, `not "nope"`},
		{[]string{"model", "tiny"}, 2, "--out FILE"},
		{[]string{"model", "tiny", "--out", out, "extra"}, 2, "--out FILE"},
		{[]string{"model", "tiny", "--out", out, "--layers", "x"}, 2, "--out FILE"},
		{[]string{"model", "tiny", "--out", out, "--heads", "3"}, 1, "not a multiple of heads"},
		{[]string{"model", "tiny", "--out", filepath.Join(dir, "missing", "m.gguf")}, 1, "missing"},
	} {
		code, _, stderr := runCLI(t, tc.args...)
		if code != tc.code || !strings.Contains(stderr, tc.msg) {
			t.Errorf("%q: code %d stderr %q, want %d and %q", tc.args, code, stderr, tc.code, tc.msg)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("failed runs left %d entries", len(ents))
	}
}

// TestModelDescriptor: `kvsp model descriptor` prints the descriptor the
// llamacpp engine derives (JCS), the one examples/llamacpp/descriptor.json
// holds for the default tiny model, and refuses a file that is no model.
func TestModelDescriptor(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "tiny.gguf")
	if code, _, stderr := runCLI(t, "model", "tiny", "--out", out); code != 0 {
		t.Fatal(stderr)
	}
	code, stdout, stderr := runCLI(t, "model", "descriptor", out)
	if code != 0 {
		t.Fatalf("code %d: %s", code, stderr)
	}
	want, err := os.ReadFile("../../examples/llamacpp/descriptor.json")
	if err != nil {
		t.Fatal(err)
	}
	if stdout != string(want) {
		t.Fatalf("descriptor %s, examples/llamacpp/descriptor.json has %s", stdout, want)
	}
	if _, stdout, _ := runCLI(t, "model", "descriptor", out, "--block-tokens", "32"); !strings.Contains(stdout, `"block_tokens":32`) {
		t.Fatalf("--block-tokens 32: %s", stdout)
	}
	bad := filepath.Join(dir, "bad.gguf")
	os.WriteFile(bad, []byte("GGUF but not really"), 0o644)
	if code, _, stderr := runCLI(t, "model", "descriptor", bad); code != 1 || !strings.Contains(stderr, "gguf:") {
		t.Fatalf("a broken file: code %d, %s", code, stderr)
	}
}

// TestSmolLM2Descriptor (issue 49): the real model's descriptor,
// committed as examples/openai/descriptor.json, is what `kvsp model
// descriptor` derives from the GGUF make deps installs: llama
// architecture, 30 layers, GQA (3 KV heads of 64), RoPE with its base
// 100000, an f16 cache (23,040 octets of KV a token), Q4_1 weights.
func TestSmolLM2Descriptor(t *testing.T) {
	requireLlama(t)
	model := kvsptest.SmolLM2(t)
	code, stdout, stderr := runCLI(t, "model", "descriptor", model)
	if code != 0 {
		t.Fatalf("code %d: %s", code, stderr)
	}
	want, err := os.ReadFile("../../examples/openai/descriptor.json")
	if err != nil {
		t.Fatal(err)
	}
	if stdout != string(want) {
		t.Fatalf("descriptor %s, examples/openai/descriptor.json has %s", stdout, want)
	}
	d, err := kvsp.ParseDescriptor(want)
	if err != nil {
		t.Fatal(err)
	}
	if d.Layers != 30 || d.KVHeads != 3 || d.HeadDim != 64 || d.KVDType != "fp16" || d.Positional != "rope;theta=100000" ||
		2*d.Layers*d.KVHeads*d.HeadDim*2 != 23040 {
		t.Fatalf("descriptor %+v", d)
	}
}

// TestModelTokenize (issue 49): `kvsp model tokenize` prints the tokens
// the gateway makes: a chat laid out by SmolLM2's template (its markup as
// special tokens), a plain text with typed markup as text; bad input
// refused.
func TestModelTokenize(t *testing.T) {
	lib := requireLlama(t)
	model := kvsptest.SmolLM2(t)
	tok := func(in string, args ...string) (string, error) {
		var out bytes.Buffer
		err := cmdModelTokenize(append([]string{model, "--library", lib}, args...), strings.NewReader(in), &out)
		return strings.TrimSpace(out.String()), err
	}
	got, err := tok(`[{"role": "user", "content": "What is the capital of France?"}]`, "--chat")
	if err != nil || got != "[1,4093,198,1780,314,260,3575,282,4649,47,2,198,1,520,9531,198]" {
		t.Fatalf("chat: %s %v", got, err)
	}
	if got, err := tok("<|im_start|>"); err != nil || got == "[1]" || !strings.HasPrefix(got, "[") {
		t.Fatalf("typed markup: %s %v (want the characters' tokens, not the special token 1)", got, err)
	}
	if _, err := tok(`[{"role": "tool", "content": "x"}]`, "--chat"); err == nil {
		t.Fatal("a tool message was laid out")
	}
	if _, err := tok("a\x00b"); err == nil {
		t.Fatal("a NUL character was tokenized")
	}
}

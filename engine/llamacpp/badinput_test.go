package llamacpp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/internal/gguf"
)

// writeModel writes a llama GGUF of the default tiny shape whose
// metadata and tensor list mutate may change (tensor data are zeros: only
// Describe reads these files).
func writeModel(t *testing.T, arch string, skipTensor string, extra func(w *gguf.Writer)) string {
	t.Helper()
	return writeModelTokenizer(t, arch, "no_vocab", skipTensor, extra)
}

// writeModelTokenizer is writeModel with tokenizer.ggml.model tok.
func writeModelTokenizer(t *testing.T, arch, tok, skipTensor string, extra func(w *gguf.Writer)) string {
	t.Helper()
	p := gguf.DefaultTiny()
	path := filepath.Join(t.TempDir(), "m.gguf")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w := gguf.NewWriter(f)
	w.AddString("general.architecture", arch)
	w.AddString("general.name", "bad")
	for k, v := range map[string]int{"vocab_size": p.Vocab, "context_length": p.Context, "embedding_length": p.Embd, "feed_forward_length": p.FF,
		"block_count": p.Layers, "attention.head_count": p.Heads, "attention.head_count_kv": p.KVHeads} {
		w.AddUint32("llama."+k, uint32(v))
	}
	w.AddFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5)
	w.AddString("tokenizer.ggml.model", tok)
	if extra != nil {
		extra(w)
	}
	e, kv := uint64(p.Embd), uint64(p.KVHeads*p.HeadDim())
	type tensor struct {
		name string
		dims []uint64
	}
	ts := []tensor{{"token_embd.weight", []uint64{e, uint64(p.Vocab)}}, {"output_norm.weight", []uint64{e}}, {"output.weight", []uint64{e, uint64(p.Vocab)}}}
	for i := 0; i < p.Layers; i++ {
		for _, x := range []tensor{{"attn_norm", []uint64{e}}, {"attn_q", []uint64{e, e}}, {"attn_k", []uint64{e, kv}}, {"attn_v", []uint64{e, kv}},
			{"attn_output", []uint64{e, e}}, {"ffn_norm", []uint64{e}}, {"ffn_gate", []uint64{e, uint64(p.FF)}}, {"ffn_up", []uint64{e, uint64(p.FF)}}, {"ffn_down", []uint64{uint64(p.FF), e}}} {
			ts = append(ts, tensor{fmt.Sprintf("blk.%d.%s.weight", i, x.name), x.dims})
		}
	}
	var sizes []uint64
	for _, x := range ts {
		if x.name == skipTensor {
			continue
		}
		w.AddTensor(x.name, gguf.GGMLTypeF32, x.dims...)
		n := uint64(4)
		for _, d := range x.dims {
			n *= d
		}
		sizes = append(sizes, n)
	}
	if err := w.WriteHeader(); err != nil {
		t.Fatal(err)
	}
	for _, n := range sizes {
		if _, err := w.Write(make([]byte, n)); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestBadModels (issue 20, test 5): a model the engine cannot run is
// refused at start with an error naming the cause, before the library is
// asked to load it.
func TestBadModels(t *testing.T) {
	good := tinyModel(t, gguf.DefaultTiny())
	data, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(t.TempDir(), "truncated.gguf")
	os.WriteFile(truncated, data[:len(data)/2], 0o644)
	header := filepath.Join(t.TempDir(), "header.gguf")
	os.WriteFile(header, data[:1000], 0o644)
	for _, tc := range []struct {
		name, path, want string
	}{
		{"truncated data", truncated, "extends past the end of the file"},
		{"truncated header", header, "gguf:"},
		{"another architecture", writeModel(t, "gpt2", "", nil), `general.architecture "gpt2"`},
		{"a missing tensor", writeModel(t, "llama", "blk.2.attn_k.weight", nil), "tensor blk.2.attn_k.weight missing"},
		{"RoPE scaling", writeModel(t, "llama", "", func(w *gguf.Writer) { w.AddString("llama.rope.scaling.type", "linear") }), `RoPE scaling "linear"`},
		{"a fractional RoPE base", writeModel(t, "llama", "", func(w *gguf.Writer) { w.AddFloat32("llama.rope.freq_base", 10000.5) }), "RoPE base 10000.5"},
		{"partial rotary", writeModel(t, "llama", "", func(w *gguf.Writer) { w.AddUint32("llama.rope.dimension_count", 16) }), "RoPE over 16 of 32"},
		{"no such file", filepath.Join(t.TempDir(), "none.gguf"), "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{Model: tc.path, Library: "/nonexistent"})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrModel) {
				t.Fatalf("New: %v; want an ErrModel naming %q", err, tc.want)
			}
		})
	}
	// A model without general.name is named by the configuration, never by its file.
	if _, err := Describe(writeModel(t, "llama", "", nil), DescribeOptions{Name: "other", BlockTokens: 16}); err == nil || !strings.Contains(err.Error(), `general.name is "bad"`) {
		t.Fatalf("a configured name other than general.name: %v", err)
	}
	if _, err := Describe(good, DescribeOptions{BlockTokens: 16, KVType: "q8_0"}); err == nil || !strings.Contains(err.Error(), `cache type "q8_0"`) {
		t.Fatalf("a quantized cache: %v", err)
	}
	if info, err := Describe(writeModel(t, "llama", "", func(w *gguf.Writer) { w.AddFloat32("llama.rope.freq_base", 500000) }), DescribeOptions{BlockTokens: 16}); err != nil || info.Descriptor.Positional != "rope;theta=500000" {
		t.Fatalf("a RoPE base of 500000: %+v %v", info.Descriptor, err)
	}
}

// TestBadLibraries (issue 20, test 5): a library that is not the pinned
// release (another SONAME, another checksum, a shared object ggml would
// load that is not the release's, a missing one) is refused before
// anything is loaded, naming the file and the command that installs the
// right one.
func TestBadLibraries(t *testing.T) {
	src := libraryDir(t)
	clone := func(t *testing.T) string {
		dir := t.TempDir()
		entries, _ := os.ReadDir(src)
		for _, e := range entries {
			if l, err := os.Readlink(filepath.Join(src, e.Name())); err == nil {
				os.Symlink(l, filepath.Join(dir, e.Name()))
				continue
			}
			if e.Type().IsRegular() {
				os.Link(filepath.Join(src, e.Name()), filepath.Join(dir, e.Name()))
			}
		}
		return dir
	}
	if err := VerifyLibrary(clone(t)); err != nil {
		t.Fatalf("the release itself: %v", err)
	}
	for _, tc := range []struct {
		name  string
		spoil func(dir string)
		want  string
	}{
		{"another SONAME", func(d string) {
			os.Remove(filepath.Join(d, "libllama.so"))
			os.Symlink("libggml-base.so", filepath.Join(d, "libllama.so"))
		}, `libllama.so has SONAME "libggml-base.so"`},
		{"another checksum", func(d string) {
			p := filepath.Join(d, "libggml-cpu-x64.so")
			b, _ := os.ReadFile(p)
			b[len(b)-1] ^= 1
			os.Remove(p)
			os.WriteFile(p, b, 0o644)
		}, "libggml-cpu-x64.so has sha256"},
		{"an unknown backend", func(d string) {
			b, _ := os.ReadFile(filepath.Join(d, "libggml-cpu-x64.so"))
			os.WriteFile(filepath.Join(d, "libggml-cpu-evil.so"), b, 0o644)
		}, "libggml-cpu-evil.so"},
		{"not installed", func(d string) { os.Remove(filepath.Join(d, "libllama.so")) }, "make deps"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := clone(t)
			tc.spoil(d)
			err := VerifyLibrary(d)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrLibrary) {
				t.Fatalf("VerifyLibrary: %v; want an ErrLibrary naming %q", err, tc.want)
			}
			if !strings.Contains(err.Error(), "make deps") {
				t.Fatalf("the error does not say how to install the library: %v", err)
			}
		})
	}
}

// TestBadRequests (issue 20, test 5): a token outside the vocabulary and
// a prompt or output beyond the context are refused in Go, as
// kvsp-invalid problems naming the member, before anything reaches
// llama_decode (whose assertion would abort the process); the engine goes
// on serving.
func TestBadRequests(t *testing.T) {
	e := newEngine(t, Config{ContextTokens: 256, BatchSize: 2})
	v := e.Vocab()
	for _, tc := range []struct {
		name string
		req  engine.Request
		want string
	}{
		{"a token outside the vocabulary", request(t, e, append(tokensOf(3, 20, v), uint32(v)), 4), fmt.Sprintf("tokens[20]: %d is not in the model's vocabulary", v)},
		{"a prompt longer than the context", request(t, e, tokensOf(3, 300, v), 4), "tokens: 300 tokens exceed the engine's context of 256"},
		{"output beyond the context", request(t, e, tokensOf(3, 200, v), 100), "max_tokens: a prompt of 200 tokens leaves room for 56"},
		{"an empty prompt", engine.Request{Tokens: []uint32{}, MaxTokens: 4}, "tokens: the prompt is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.Generate(context.Background(), tc.req, func(engine.Token) error { return nil })
			var p *kvsp.Problem
			if !errors.As(err, &p) || !errors.Is(err, kvsp.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Generate: %v; want a kvsp-invalid problem naming %q", err, tc.want)
			}
		})
	}
	if out := collect(t, e, request(t, e, tokensOf(4, 40, v), 4)); len(out) != 4 {
		t.Fatalf("after the refusals: %d tokens", len(out))
	}
}

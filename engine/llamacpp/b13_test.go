package llamacpp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp/internal/gguf"
)

// TestB13_GGUFMetadataAmplification (RELIABILITY B13), at an instance's
// start: a header past gguf's caps, a block_count of 2^31 (which had
// Describe list 19 billion tensor names) and a vocabulary longer than the
// embeddings are refused by New before llama.cpp is asked to load them
// (it keeps more per key, tensor and token than the file spends), each
// with under 4 MiB allocated; a model at the key cap starts.
func TestB13_GGUFMetadataAmplification(t *testing.T) {
	keys := func(n int) func(w *gguf.Writer) {
		return func(w *gguf.Writer) {
			for i := range n {
				w.AddUint32(fmt.Sprintf("b13.%06x", i), 0)
			}
		}
	}
	// writeModel has 11 keys of its own.
	atCap := writeModel(t, "llama", "", keys(gguf.MaxKeys-11))
	tiny, err := os.ReadFile(tinyModel(t, gguf.DefaultTiny()))
	if err != nil {
		t.Fatal(err)
	}
	key := []byte("llama.block_count")
	i := bytes.Index(tiny, key) + len(key) + 4 // past the key and its type, uint32
	layers := bytes.Clone(tiny)
	binary.LittleEndian.PutUint32(layers[i:], 1<<31)
	layersPath := filepath.Join(t.TempDir(), "layers.gguf")
	if err := os.WriteFile(layersPath, layers, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path, want string
	}{
		{"past the key cap", writeModel(t, "llama", "", keys(gguf.MaxKeys-10)), fmt.Sprintf("%d keys exceed the cap of %d at offset 16", gguf.MaxKeys+1, gguf.MaxKeys)},
		{"2^31 layers", layersPath, "tensor blk.4.attn_norm.weight missing"},
		{"a vocabulary longer than the embeddings", writeModelTokenizer(t, "llama", "gpt2", "", func(w *gguf.Writer) {
			w.AddStrings("tokenizer.ggml.tokens", make([]string, gguf.DefaultTiny().Vocab+1))
		}), fmt.Sprintf("tokenizer.ggml.tokens has %d tokens, token_embd.weight %d rows", gguf.DefaultTiny().Vocab+1, gguf.DefaultTiny().Vocab)},
	} {
		var err error
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err = New(Config{Model: tc.path, Library: "/nonexistent"})
		runtime.ReadMemStats(&after)
		alloc := after.TotalAlloc - before.TotalAlloc
		if err == nil || !errors.Is(err, ErrModel) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want an ErrModel naming %q", tc.name, err, tc.want)
		}
		t.Logf("%s: refused with %d allocated", tc.name, alloc)
		if alloc > 4<<20 {
			t.Errorf("%s: %d allocated to refuse it", tc.name, alloc)
		}
	}
	if _, err := Describe(atCap, DescribeOptions{BlockTokens: 16}); err != nil {
		t.Fatalf("a model at the key cap: %v", err)
	}
	// A model without a vocabulary: llama.cpp ignores the array.
	if _, err := Describe(writeModel(t, "llama", "", func(w *gguf.Writer) {
		w.AddStrings("tokenizer.ggml.tokens", make([]string, gguf.DefaultTiny().Vocab+1))
	}), DescribeOptions{BlockTokens: 16}); err != nil {
		t.Fatalf("a no_vocab model with a tokens array: %v", err)
	}

	t.Run("llama.cpp", func(t *testing.T) {
		start := time.Now()
		e := newEngine(t, Config{Model: atCap, BatchSize: 1, ContextTokens: 64, Threads: 1})
		t.Logf("a model of %d keys started in %v", gguf.MaxKeys, time.Since(start).Round(time.Millisecond))
		if e.Descriptor().Layers != gguf.DefaultTiny().Layers {
			t.Errorf("descriptor %+v", e.Descriptor())
		}
	})
}

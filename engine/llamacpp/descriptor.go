package llamacpp

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/gguf"
)

// ErrModel is the error of a model file this engine does not run.
var ErrModel = errors.New("llamacpp: model")

// DescribeOptions are what the descriptor takes from the configuration
// rather than the model.
type DescribeOptions struct {
	// Name names a model whose metadata has no general.name (when both
	// are there they must agree).
	Name string
	// BlockTokens is block_tokens.
	BlockTokens int
	// KVType is the context's cache type, "f16" (the default), "bf16" or
	// "f32"; a quantized cache has no kvsp element type.
	KVType string
}

// Info is what Describe reads of a model.
type Info struct {
	Descriptor    kvsp.Descriptor
	Vocab         int
	ContextLength int
	Embedding     int
}

// theta is llama.cpp's RoPE base of the llama architecture, the registry's
// default for "rope".
const defaultTheta = 10000

// Describe derives a GGUF model's Compatibility Descriptor from the file,
// never from anything typed by hand:
//
//   - model is general.name (or opts.Name for a model without one; never
//     the file name, which would tie the compat_id to a rename);
//   - model_digest is the SHA-256 of the GGUF file, the one weight file
//     (decision A-31);
//   - tokenizer_digest is the SHA-256 of the GGUF's tokenizer definition:
//     every metadata entry whose key begins "tokenizer.", octet for octet
//     as the file encodes it (key, type, value), in ascending bytewise key
//     order. A GGUF carries its tokenizer there (model, tokens, scores,
//     merges, special ids), so two files with equal entries tokenize
//     alike whatever else differs. A no_vocab model (token ids fed
//     directly) has the single entry tokenizer.ggml.model = "no_vocab";
//   - layers, kv_heads and head_dim are the llama metadata's;
//   - kv_dtype is opts.KVType mapped to the registry;
//   - positional is "rope", with ";theta=N" when the model's RoPE base is
//     not 10000; RoPE scaling, partial rotary dimensions and a base that
//     is not an integer cannot be said in the registry's syntax and are
//     refused, never dropped;
//   - block_tokens is opts.BlockTokens and layout is kvsp-layout-1.
//
// Only the llama architecture is run, every tensor it needs must be in
// the file, and a vocabulary must have a token per row of
// token_embd.weight, as llama.cpp requires.
func Describe(path string, opts DescribeOptions) (Info, error) {
	f, err := gguf.Open(path)
	if err != nil {
		if errors.Is(err, gguf.ErrFormat) {
			return Info{}, fmt.Errorf("%w: %s: %v", ErrModel, path, err)
		}
		return Info{}, fmt.Errorf("%w: %v", ErrModel, err)
	}
	info, err := describe(f, opts)
	if err != nil {
		return Info{}, fmt.Errorf("%w: %s: %v", ErrModel, path, err)
	}
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	d, err := kvsp.FileDigest(os.DirFS(dir), base)
	if err != nil {
		return Info{}, fmt.Errorf("%w: %v", ErrModel, err)
	}
	info.Descriptor.ModelDigest = d
	if err := info.Descriptor.Validate(); err != nil {
		return Info{}, fmt.Errorf("%w: %s: %v", ErrModel, path, err)
	}
	return info, nil
}

func describe(f *gguf.File, opts DescribeOptions) (Info, error) {
	arch, _ := f.String("general.architecture")
	if arch != "llama" {
		return Info{}, fmt.Errorf("general.architecture %q: this engine runs \"llama\" models", arch)
	}
	name, ok := f.String("general.name")
	switch {
	case !ok && opts.Name == "":
		return Info{}, errors.New("no general.name: name the model in the configuration")
	case !ok:
		name = opts.Name
	case opts.Name != "" && opts.Name != name:
		return Info{}, fmt.Errorf("general.name is %q, the configuration says %q", name, opts.Name)
	}
	num := func(key string) (int, error) {
		v, ok := f.Uint("llama." + key)
		if !ok || v == 0 || v > 1<<31 {
			return 0, fmt.Errorf("llama.%s: missing or out of range", key)
		}
		return int(v), nil
	}
	var in Info
	layers, err := num("block_count")
	if err != nil {
		return in, err
	}
	embd, err := num("embedding_length")
	if err != nil {
		return in, err
	}
	heads, err := num("attention.head_count")
	if err != nil {
		return in, err
	}
	kvHeads := heads
	if _, ok := f.Uint("llama.attention.head_count_kv"); ok {
		if kvHeads, err = num("attention.head_count_kv"); err != nil {
			return in, err
		}
	}
	if embd%heads != 0 || heads%kvHeads != 0 {
		return in, fmt.Errorf("embedding_length %d, %d heads and %d KV heads do not divide", embd, heads, kvHeads)
	}
	headDim := embd / heads
	if _, ok := f.Uint("llama.attention.key_length"); ok {
		if headDim, err = num("attention.key_length"); err != nil {
			return in, err
		}
	}
	if v, ok := f.Uint("llama.attention.value_length"); ok && int(v) != headDim {
		return in, fmt.Errorf("attention.key_length %d and value_length %d differ: kvsp-layout-1 has one head_dim", headDim, v)
	}
	if in.ContextLength, err = num("context_length"); err != nil {
		return in, err
	}
	in.Embedding = embd
	pos, err := positional(f, headDim)
	if err != nil {
		return in, err
	}
	emb, ok := f.Tensor("token_embd.weight")
	if !ok || len(emb.Dims) != 2 || emb.Dims[0] != uint64(embd) {
		return in, errors.New("tensor token_embd.weight missing or not [embedding_length, vocab]")
	}
	in.Vocab = int(emb.Dims[1])
	if v, ok := f.Uint("llama.vocab_size"); ok && int(v) != in.Vocab {
		return in, fmt.Errorf("llama.vocab_size %d, token_embd.weight has %d rows", v, in.Vocab)
	}
	// llama.cpp builds its vocabulary from this array (a string, an id
	// map entry and more per token) before it finds the embeddings do not
	// match; checked here, a vocabulary costs no more than the rows of
	// embeddings the file holds for it. A model without a vocabulary
	// ("no_vocab", or "none") has its array ignored.
	if m, _ := f.String("tokenizer.ggml.model"); m != "no_vocab" && m != "none" {
		if _, n, ok := f.ArrayLen("tokenizer.ggml.tokens"); ok && n != uint64(in.Vocab) {
			return in, fmt.Errorf("tokenizer.ggml.tokens has %d tokens, token_embd.weight %d rows", n, in.Vocab)
		}
	}
	// The tensors are looked up as they are named, not listed first:
	// block_count is the file's, and a list of 9 names per claimed layer
	// would cost what it claims. The first layer missing one ends the
	// loop, so it runs at most once per 9 tensors the file has.
	if _, ok := f.Tensor("output_norm.weight"); !ok {
		return in, errors.New("tensor output_norm.weight missing")
	}
	for i := 0; i < layers; i++ {
		for _, t := range []string{"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"} {
			name := fmt.Sprintf("blk.%d.%s.weight", i, t)
			if _, found := f.Tensor(name); !found {
				return in, fmt.Errorf("tensor %s missing", name)
			}
		}
	}
	// The digest reads the entries where the File holds them: the
	// tokenizer may be most of the header, and a copy of it would add as
	// much again to the memory Describe needs.
	h := sha256.New()
	if n, _ := f.WriteRawEntries(h, "tokenizer."); n == 0 {
		return in, errors.New("no tokenizer.* metadata (a model without a vocabulary has tokenizer.ggml.model = \"no_vocab\")")
	}
	var tok kvsp.Digest
	h.Sum(tok[:0])
	dt, err := kvDType(opts.KVType)
	if err != nil {
		return in, err
	}
	in.Descriptor = kvsp.Descriptor{Model: name, TokenizerDigest: tok, Layers: layers, KVHeads: kvHeads, HeadDim: headDim,
		KVDType: dt, Positional: pos, BlockTokens: opts.BlockTokens, Layout: "kvsp-layout-1"}
	return in, nil
}

// kvDType maps a llama.cpp cache type to the registry's element type.
func kvDType(t string) (kvsp.ElementType, error) {
	switch t {
	case "", "f16":
		return "fp16", nil
	case "bf16":
		return "bf16", nil
	case "f32":
		return "fp32", nil
	}
	return "", fmt.Errorf("cache type %q: only f16, bf16 and f32 caches have a kvsp element type", t)
}

// positional is the descriptor's positional member of a llama model.
func positional(f *gguf.File, headDim int) (string, error) {
	if v, ok := f.Uint("llama.rope.dimension_count"); ok && int(v) != headDim {
		return "", fmt.Errorf("RoPE over %d of %d dimensions: the registry's \"rope\" has no partial form", v, headDim)
	}
	if s, ok := f.String("llama.rope.scaling.type"); ok && s != "none" {
		return "", fmt.Errorf("RoPE scaling %q: the registry's syntax names a method but not its factor", s)
	}
	for _, k := range []string{"llama.rope.scaling.factor", "llama.rope.freq_scale"} {
		if v, ok := f.Float(k); ok && v != 1 && v != 0 {
			return "", fmt.Errorf("%s %g: the registry's syntax cannot say it", k, v)
		}
	}
	theta, ok := f.Float("llama.rope.freq_base")
	if !ok || theta == defaultTheta {
		return "rope", nil
	}
	if theta <= 0 || theta != math.Trunc(theta) || theta > 1e15 {
		return "", fmt.Errorf("RoPE base %g: the registry's theta is a positive integer", theta)
	}
	return "rope;theta=" + strconv.FormatInt(int64(theta), 10), nil
}

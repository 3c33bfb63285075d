package gguf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"strconv"
	"unicode/utf8"
)

// TinyParams shapes the random-weight llama model of WriteTinyLlama.
type TinyParams struct {
	Name    string // general.name
	Layers  int    // llama.block_count
	Embd    int    // llama.embedding_length
	Heads   int    // llama.attention.head_count
	KVHeads int    // llama.attention.head_count_kv
	FF      int    // llama.feed_forward_length
	Vocab   int    // llama.vocab_size (the tokenizer is "no_vocab": callers feed token ids)
	Context int    // llama.context_length
	Seed    uint64 // the weights' random seed
}

// DefaultTiny is a 1.3 MB model: 4 layers, 128 wide, 4 heads of 32 with 2
// KV heads (GQA), FF 256, 256 tokens, context 4096. Seed 7 was picked
// because llama.cpp's greedy continuations of assorted 64-token prompts
// run 20 or more distinct tokens in 24 (seed 1 falls into a 3-cycle).
func DefaultTiny() TinyParams {
	return TinyParams{Name: "kvsp-tiny", Layers: 4, Embd: 128, Heads: 4, KVHeads: 2, FF: 256, Vocab: 256, Context: 4096, Seed: 7}
}

// HeadDim is Embd / Heads.
func (p TinyParams) HeadDim() int {
	if p.Heads <= 0 {
		return 0
	}
	return p.Embd / p.Heads
}

// Validate checks the parameters: all positive, Embd a multiple of Heads,
// Heads of KVHeads, an even head dimension (RoPE rotates pairs), Vocab and
// Context at most 2^31-1 (token ids and positions are int32), the other
// sizes at most 2^24, a non-empty UTF-8 name.
func (p TinyParams) Validate() error {
	for _, c := range []struct {
		name string
		v    int
		max  int
	}{
		{"layers", p.Layers, 1 << 24}, {"embd", p.Embd, 1 << 24}, {"heads", p.Heads, 1 << 24},
		{"kv-heads", p.KVHeads, 1 << 24}, {"ff", p.FF, 1 << 24},
		{"vocab", p.Vocab, math.MaxInt32}, {"context", p.Context, math.MaxInt32},
	} {
		if c.v <= 0 || c.v > c.max {
			return fmt.Errorf("gguf: tiny model: %s %d out of range 1..%d", c.name, c.v, c.max)
		}
	}
	switch {
	case p.Embd%p.Heads != 0:
		return fmt.Errorf("gguf: tiny model: embd %d is not a multiple of heads %d", p.Embd, p.Heads)
	case p.Heads%p.KVHeads != 0:
		return fmt.Errorf("gguf: tiny model: heads %d is not a multiple of kv-heads %d", p.Heads, p.KVHeads)
	case p.HeadDim()%2 != 0:
		return fmt.Errorf("gguf: tiny model: head dimension %d (embd/heads) is odd", p.HeadDim())
	case p.Name == "" || !utf8.ValidString(p.Name):
		return errors.New("gguf: tiny model: name is empty or not UTF-8")
	}
	return nil
}

// tinyTensor is one tensor of the tiny model and how to fill it.
type tinyTensor struct {
	name  string
	typ   uint32
	dims  []uint64
	scale float64 // entries uniform in [-scale, scale); 0: all 1.0 (norms)
}

func (p TinyParams) tensors() []tinyTensor {
	e, ff, v := uint64(p.Embd), uint64(p.FF), uint64(p.Vocab)
	kv := uint64(p.KVHeads * p.HeadDim())
	inv := func(fanIn uint64) float64 { return 1 / math.Sqrt(float64(fanIn)) }
	ts := []tinyTensor{
		{"token_embd.weight", GGMLTypeF16, []uint64{e, v}, 1},
		{"output_norm.weight", GGMLTypeF32, []uint64{e}, 0},
		{"output.weight", GGMLTypeF16, []uint64{e, v}, inv(e)},
	}
	for i := range p.Layers {
		blk := "blk." + strconv.Itoa(i) + "."
		ts = append(ts,
			tinyTensor{blk + "attn_norm.weight", GGMLTypeF32, []uint64{e}, 0},
			tinyTensor{blk + "attn_q.weight", GGMLTypeF16, []uint64{e, e}, inv(e)},
			tinyTensor{blk + "attn_k.weight", GGMLTypeF16, []uint64{e, kv}, inv(e)},
			tinyTensor{blk + "attn_v.weight", GGMLTypeF16, []uint64{e, kv}, inv(e)},
			tinyTensor{blk + "attn_output.weight", GGMLTypeF16, []uint64{e, e}, inv(e)},
			tinyTensor{blk + "ffn_norm.weight", GGMLTypeF32, []uint64{e}, 0},
			tinyTensor{blk + "ffn_gate.weight", GGMLTypeF16, []uint64{e, ff}, inv(e)},
			tinyTensor{blk + "ffn_up.weight", GGMLTypeF16, []uint64{e, ff}, inv(e)},
			tinyTensor{blk + "ffn_down.weight", GGMLTypeF16, []uint64{ff, e}, inv(ff)},
		)
	}
	return ts
}

// tinySeedDomain separates the tiny model's ChaCha8 stream from any other
// use of the same seed; changing it changes every tiny model.
const tinySeedDomain = "kvsp/gguf tiny llama v1"

// WriteTinyLlama writes a llama-architecture GGUF with random weights that
// llama.cpp loads and runs. The output is a function of p alone: the same
// params give the same octets on every platform and Go version.
//
// Metadata, in this order: general.architecture "llama", general.name,
// general.file_type 1 (mostly F16), llama.vocab_size, llama.context_length,
// llama.embedding_length, llama.feed_forward_length, llama.block_count,
// llama.attention.head_count, llama.attention.head_count_kv,
// llama.attention.layer_norm_rms_epsilon 1e-5, llama.rope.dimension_count
// (the head dimension), llama.rope.freq_base 10000 and
// tokenizer.ggml.model "no_vocab" (no tokenizer: callers feed token ids).
//
// Tensors: token_embd, output_norm, output, then per block attn_norm,
// attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
// ffn_down. Norms are F32 ones; matrices are F16 with entries uniform in
// ±1/sqrt(fan_in) (±1 for the embeddings), drawn in tensor order from one
// ChaCha8 stream keyed by tinySeedDomain and Seed: each entry is
// (u/2^23 - 1)·scale for u the top 24 bits of the stream's next Uint64,
// rounded to float32, then to float16 (both to nearest even).
//
// Data is streamed through a 64 KiB buffer, so memory does not grow with
// the model.
func WriteTinyLlama(out io.Writer, p TinyParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	w := NewWriter(out)
	w.AddString("general.architecture", "llama")
	w.AddString("general.name", p.Name)
	w.AddUint32("general.file_type", 1)
	w.AddUint32("llama.vocab_size", uint32(p.Vocab))
	w.AddUint32("llama.context_length", uint32(p.Context))
	w.AddUint32("llama.embedding_length", uint32(p.Embd))
	w.AddUint32("llama.feed_forward_length", uint32(p.FF))
	w.AddUint32("llama.block_count", uint32(p.Layers))
	w.AddUint32("llama.attention.head_count", uint32(p.Heads))
	w.AddUint32("llama.attention.head_count_kv", uint32(p.KVHeads))
	w.AddFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5)
	w.AddUint32("llama.rope.dimension_count", uint32(p.HeadDim()))
	w.AddFloat32("llama.rope.freq_base", 10000)
	w.AddString("tokenizer.ggml.model", "no_vocab")
	ts := p.tensors()
	for _, t := range ts {
		w.AddTensor(t.name, t.typ, t.dims...)
	}
	if err := w.WriteHeader(); err != nil {
		return err
	}

	var seed [32]byte
	copy(seed[:], tinySeedDomain)
	binary.LittleEndian.PutUint64(seed[24:], p.Seed)
	src := rand.NewChaCha8(seed)
	const bufSize = 64 << 10
	buf := make([]byte, 0, bufSize)
	for _, t := range ts {
		n := uint64(1)
		for _, d := range t.dims {
			n *= d
		}
		for range n {
			if len(buf) > bufSize-4 {
				if _, err := w.Write(buf); err != nil {
					return err
				}
				buf = buf[:0]
			}
			if t.scale == 0 {
				buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(1))
				continue
			}
			u := src.Uint64() >> 40
			// The explicit conversions forbid fused multiply-adds: the
			// same octets on every architecture.
			v := float32(float64(float64(u)/(1<<23)-1) * t.scale)
			buf = binary.LittleEndian.AppendUint16(buf, Float16Bits(v))
		}
	}
	if _, err := w.Write(buf); err != nil {
		return err
	}
	return w.Close()
}

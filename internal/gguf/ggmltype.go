package gguf

import (
	"fmt"
	"math"
)

// ggml tensor types used by this package (ggml/include/ggml.h enum ggml_type).
const (
	GGMLTypeF32  = 0
	GGMLTypeF16  = 1
	GGMLTypeQ4_0 = 2
	GGMLTypeQ8_0 = 8
	GGMLTypeQ4_K = 12
	GGMLTypeQ6_K = 14
	GGMLTypeBF16 = 30
)

type ggmlType struct {
	name   string
	block  uint64 // elements per block
	octets uint64 // octets per block
}

// ggmlTypes: ggml_type_name, ggml_blck_size and ggml_type_size of every
// type of llama.cpp v0.4.0's libggml-base (GGML_TYPE_COUNT = 43), as that
// library printed them. Numbers 4, 5, 31-33 and 36-38 are removed types,
// which gguf.cpp refuses too.
var ggmlTypes = [...]ggmlType{
	0: {"f32", 1, 4}, 1: {"f16", 1, 2}, 2: {"q4_0", 32, 18}, 3: {"q4_1", 32, 20},
	6: {"q5_0", 32, 22}, 7: {"q5_1", 32, 24}, 8: {"q8_0", 32, 34}, 9: {"q8_1", 32, 36},
	10: {"q2_K", 256, 84}, 11: {"q3_K", 256, 110}, 12: {"q4_K", 256, 144}, 13: {"q5_K", 256, 176},
	14: {"q6_K", 256, 210}, 15: {"q8_K", 256, 292}, 16: {"iq2_xxs", 256, 66}, 17: {"iq2_xs", 256, 74},
	18: {"iq3_xxs", 256, 98}, 19: {"iq1_s", 256, 50}, 20: {"iq4_nl", 32, 18}, 21: {"iq3_s", 256, 110},
	22: {"iq2_s", 256, 82}, 23: {"iq4_xs", 256, 136}, 24: {"i8", 1, 1}, 25: {"i16", 1, 2},
	26: {"i32", 1, 4}, 27: {"i64", 1, 8}, 28: {"f64", 1, 8}, 29: {"iq1_m", 256, 56},
	30: {"bf16", 1, 2}, 34: {"tq1_0", 256, 54}, 35: {"tq2_0", 256, 66}, 39: {"mxfp4", 32, 17},
	40: {"nvfp4", 64, 36}, 41: {"q1_0", 128, 18}, 42: {"q2_0", 64, 18},
}

// GGMLTypeName returns ggml's name of a tensor type ("f16", "q4_K") and
// whether the type is known.
func GGMLTypeName(t uint32) (string, bool) {
	if uint64(t) < uint64(len(ggmlTypes)) && ggmlTypes[t].block != 0 {
		return ggmlTypes[t].name, true
	}
	return "", false
}

// GGMLBlock returns the block size of a tensor type in elements and in
// octets, and whether the type is known.
func GGMLBlock(t uint32) (elems, octets uint64, ok bool) {
	if uint64(t) < uint64(len(ggmlTypes)) && ggmlTypes[t].block != 0 {
		return ggmlTypes[t].block, ggmlTypes[t].octets, true
	}
	return 0, 0, false
}

// TensorBytes returns the data size of a tensor of type t and dims, as
// ggml_nbytes does for a contiguous tensor. It fails for an unknown type,
// more than MaxDims dims, a dim above 2^63-1, an ne0 that is not a
// multiple of the type's block, or a size that overflows.
func TensorBytes(t uint32, dims []uint64) (uint64, error) {
	blk, octets, ok := GGMLBlock(t)
	if !ok {
		return 0, fmt.Errorf("unknown ggml type %d", t)
	}
	if len(dims) > MaxDims {
		return 0, fmt.Errorf("%d dimensions (at most %d)", len(dims), MaxDims)
	}
	n := uint64(1)
	for i, d := range dims {
		if d > math.MaxInt64 {
			return 0, fmt.Errorf("dimension %d is %d (at most 2^63-1)", i, d)
		}
		if d != 0 && n > math.MaxInt64/d {
			return 0, fmt.Errorf("element count overflows (dims %v)", dims)
		}
		n *= d
	}
	ne0 := uint64(1)
	if len(dims) > 0 {
		ne0 = dims[0]
	}
	if ne0%blk != 0 {
		name, _ := GGMLTypeName(t)
		return 0, fmt.Errorf("ne0 %d is not a multiple of the %s block of %d", ne0, name, blk)
	}
	blocks := n / blk
	if blocks > math.MaxInt64/octets {
		return 0, fmt.Errorf("data size overflows (dims %v)", dims)
	}
	return blocks * octets, nil
}

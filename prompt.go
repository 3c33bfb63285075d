package kvsp

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
)

// promptLabel separates prompt digests from every other SHA-256 input.
const promptLabel = "KVSP-PROMPT-1\x00"

// PromptDigest commits to a session's prompt by what a Session Checkpoint
// keeps of it (R-REC-19): the Block Keys of its complete blocks and the
// tokens after them. Two prompts of one scope and model have equal digests
// exactly when they are equal, so kvsp's PC compares a request or a
// checkpoint with the session it names without keeping the prompt
// (RELIABILITY S11). It is a kvsp decision; the spec compares nothing.
func PromptDigest(blocks []BlockKey, tail []uint32) [32]byte {
	h := sha256.New()
	var n [8]byte
	h.Write([]byte(promptLabel))
	binary.BigEndian.PutUint64(n[:], uint64(len(blocks)))
	h.Write(n[:])
	for i := range blocks {
		h.Write(blocks[i][:])
	}
	binary.BigEndian.PutUint64(n[:], uint64(len(tail)))
	h.Write(n[:])
	b := make([]byte, 4*len(tail))
	for i, t := range tail {
		binary.BigEndian.PutUint32(b[4*i:], t)
	}
	h.Write(b)
	var d [32]byte
	h.Sum(d[:0])
	return d
}

// The sampler methods kvsp's engines run (PlaceSampler, Sampler).
const (
	SamplerGreedy = "greedy" // the most likely token: deterministic
	SamplerTopP   = "top-p"  // nucleus sampling: params.p in (0, 1], with the seed
)

// ValidateSampler checks a sampler that kvsp is asked to run (RELIABILITY
// B10): a method of the fixed set, its parameters (top-p's "p" a number
// with 0 < p <= 1, nothing else; greedy takes none) and a seed within
// 2^53-1. where names the member in the error (400).
func ValidateSampler(where, method string, params map[string]any, seed uint64) error {
	switch method {
	case SamplerGreedy, SamplerTopP:
	case "":
		return invalidf("%s.method: required", where)
	default:
		return invalidf("%s.method: %q is not one of %q, %q", where, truncate(method, 32), SamplerGreedy, SamplerTopP)
	}
	for k, v := range params {
		if method != SamplerTopP || k != "p" {
			return invalidf("%s.params: %q is not a parameter of %s", where, truncate(k, 32), method)
		}
		p, ok := v.(float64)
		if !ok {
			return invalidf("%s.params.p: a number is required", where)
		}
		if !(p > 0 && p <= 1) || math.IsNaN(p) {
			return invalidf("%s.params.p: must satisfy 0 < p <= 1", where)
		}
	}
	if method == SamplerTopP {
		if _, ok := params["p"]; !ok {
			return invalidf("%s.params.p: required for %s", where, SamplerTopP)
		}
	}
	if seed > MaxJSONInt {
		return invalidf("%s.seed: 0..2^53-1", where)
	}
	return nil
}

// truncate bounds a client's string quoted back in an error.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return fmt.Sprintf("%s...", s[:n])
}

// Package llamacpp runs llama.cpp behind engine.Engine, so the KV caches
// kvsp stores, verifies and moves are a real engine's.
//
// # The binding
//
// llama.cpp is reached through github.com/hybridgroup/yzma's pkg/llama, a
// maintained pure-Go binding (purego and libffi, no cgo) whose v1.26.x
// matches the C API of llama.cpp v0.4.0, the release npm's
// @node-llama-cpp/linux-x64@3.21.1 ships as shared libraries. It was
// chosen over a cgo shim of ours because it needs no header at build
// time (the package builds with CGO_ENABLED=0, and on a machine without
// the library), and its struct layouts (llama_context_params,
// llama_batch) were checked field by field against that release's
// llama.h. Only pkg/llama is imported, never its downloader: the library
// is installed by make deps and checked here (LoadLibrary: each SONAME
// and the sha256 of every shared object, before anything is loaded).
//
// # KV memory
//
// Blocks live in host memory (engine.Blocks: kv_capacity blocks, least
// recently used out, pins honoured), each in kvsp-layout-1: per layer, K
// then V, token-major, then head, then dimension, little-endian. They are
// converted exactly to and from llama.cpp's per-sequence state (state.go
// documents its layout), whose V is rows with flash attention and
// transposed without. The state format has no version: the engine learns
// the running context's layout from a probe at start and refuses any
// other.
//
// # Generation
//
// One goroutine owns the llama.cpp context. A session's leading resident
// blocks are injected into a free sequence (llama_state_seq_set_data);
// the rest of its prompt is prefilled in chunks between decode steps;
// the complete prompt blocks it computed are read back (through a scratch
// sequence that shares their cells, so only those cells are copied) and
// kept; then up to batch_size sessions decode together, one token each
// per llama_decode. When a block of output tokens completes, its KV is
// read back and kept under the chain's key (R-SES-2). Sampling is Go over
// the logits: greedy, and top-p whose uniform variate is a function of
// (seed, step). llama.cpp is not batch invariant, so Deterministic is
// false: a block loaded from a holder is its producer's KV, which equals
// this instance's recomputation within a tolerance, not bit for bit.
//
// What llama_decode would abort the process on (a token outside the
// vocabulary, a sequence beyond the context) is refused in Go first
// (Check), since no recover catches a native abort.
package llamacpp

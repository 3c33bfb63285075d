// Package engine is what kvsp's instance agent needs of an inference
// engine: its model, its rates and load, its KV memory by Block Key and
// layer, and generation with a sampler. engine/sim simulates one (tests
// and kvsp demo run it); real engines attach through the same interface.
package engine

import (
	"context"
	"errors"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// Engine is an inference engine as the agent drives it.
type Engine interface {
	// Descriptor is the engine's model, as its Compatibility ID is
	// computed from.
	Descriptor() kvsp.Descriptor
	// Geometry is the shape of one KV block.
	Geometry() container.Geometry
	// Stats are the figures of the instance's status record.
	Stats() Stats
	// KV is the engine's KV memory.
	KV() KV
	// Generate runs a request: the prompt's blocks already resident in KV
	// are used as they are, the rest is prefilled (and its blocks become
	// resident), then tokens are decoded and passed to emit in order,
	// until the model's end-of-generation token (not emitted: the finish
	// is kvsp.FinishStop) or MaxTokens output tokens (kvsp.FinishLength).
	// An emit error stops generation and is returned; so is the context's
	// when it ends, and the request's sequence and pins are freed before
	// Generate returns.
	Generate(ctx context.Context, req Request, emit func(Token) error) (kvsp.FinishReason, error)
	// Check refuses, before anything is streamed, a request the engine
	// cannot run (a token outside its vocabulary, a prompt or output
	// beyond its context), with an error naming the member; Generate
	// refuses it too.
	Check(req *Request) error
	// Deterministic reports whether a greedy session's tokens are a
	// function of its tokens alone: true only of a batch-invariant engine.
	// Otherwise the agent holds every token, greedy ones included, until a
	// checkpoint covering it is acknowledged (R-SES-5..9).
	Deterministic() bool
}

// Limits are the requests an engine can run, reported in its instance's
// status so that the PC refuses a request beyond them before it places it
// (RELIABILITY B14: a request no instance can run took room and made a
// session before the instance refused it). Zero: no bound said.
type Limits struct {
	// VocabSize: every token id is below it.
	VocabSize uint64
	// ContextTokens bounds one session's prompt and output tokens.
	ContextTokens uint64
	// MaxOutputTokens bounds a request's max_tokens.
	MaxOutputTokens uint64
}

// Bounded is implemented by engines that know their Limits.
type Bounded interface {
	Limits() Limits
}

// External is implemented by engines that run their requests themselves
// (an attached real engine): the agent's generate is refused for them.
type External interface {
	External() bool
}

// Stats is an engine's load and speed.
type Stats struct {
	Running, Queued, BatchSize uint64
	KVUtilization              float64 // resident KV blocks / capacity
	KVBlocks                   int     // capacity, in blocks (0: not known)
	PrefillTokensPerS          float64
	DecodeTokensPerS           float64
	// Prefilled and PrefillTime are cumulative since the start: the
	// prompt tokens the engine computed, and the time its prefill steps
	// took (Prefilled/PrefillTime is the prefill rate it reached).
	Prefilled   uint64
	PrefillTime time.Duration
}

// Request is one generation, new or resumed.
type Request struct {
	// Tokens is the prompt. A resumed session may not know it: then Tail
	// holds the prompt tokens after its last complete block, and the
	// blocks must be resident (loaded), since KV cannot be recomputed
	// without its tokens.
	Tokens []uint32
	Tail   []uint32
	// Keys are the Block Keys of the prompt's complete blocks (the agent
	// computes them with the scope key; the engine stores KV under them).
	Keys []kvsp.BlockKey
	// Generated are output tokens already produced (a resumed session):
	// generation continues at index len(Generated), the sampler at that
	// step.
	Generated []uint32
	// GeneratedKeys are the Block Keys of the complete blocks after the
	// prompt's, over the prompt tail and Generated, in order: an engine
	// may load those resident instead of recomputing them.
	GeneratedKeys []kvsp.BlockKey
	// MaxTokens counts all output tokens, Generated included.
	MaxTokens int
	Sampler   Sampler
	// Chain, when set, continues the Block Key chain past the prompt and
	// Generated: the engine pushes each new output token, and when a block
	// of generated tokens completes it keeps that block's KV under the
	// chain's key and calls OnBlock, so the agent can publish it (R-SES-2).
	Chain   *kvsp.Chain
	OnBlock func(key kvsp.BlockKey)
	// OnPrefill, when set, is called once the prompt is in KV (prefill
	// done, before the first output token) with what it reused and
	// computed.
	OnPrefill func(PrefillStats)
}

// PrefillStats says how a request's prompt was served.
type PrefillStats struct {
	// CachedTokens were in resident KV (complete blocks: the leading run,
	// and those Joined); ComputedTokens were prefilled (the rest of the
	// prompt, and output tokens of a resumed session).
	CachedTokens, ComputedTokens int
	// Joined are the indexes (in Keys) of blocks past the leading run that
	// were resident when the prefill reached them (a prefetch that landed
	// after the request started, or a block after a gap): used, not
	// computed. Each block's KV depends only on the tokens up to its end,
	// which its key names, so a block after a computed one is as good as
	// one in the leading run.
	Joined []int
}

// PromptTail returns the prompt tokens after the last complete block.
func (r *Request) PromptTail(blockTokens int) []uint32 {
	if r.Tokens == nil {
		return r.Tail
	}
	return r.Tokens[len(r.Keys)*blockTokens:]
}

// Sampler chooses tokens: "greedy", or "top-p" with P and a seed.
type Sampler struct {
	Method string
	P      float64
	Seed   uint64
}

// Token is one output token with its position in the output.
type Token struct {
	Index int
	ID    uint32
}

// Sampler methods.
const (
	Greedy = kvsp.SamplerGreedy
	TopP   = kvsp.SamplerTopP
)

// KV is an engine's KV memory, addressed by Block Key and layer.
type KV interface {
	// Has reports whether all layers of the block are resident.
	Has(key kvsp.BlockKey) bool
	// WriteLayer stores one layer's K and V sections of a block being
	// loaded; the block is resident once all its layers are written.
	WriteLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error
	// ReadLayer copies layer of a resident block into k and v.
	ReadLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error
	// Drop forgets a block, resident or partly written, pinned or not.
	Drop(key kvsp.BlockKey)
	// Pin keeps a resident block from eviction until as many Unpin calls
	// (a sequence shard's memory stays in place, R-RSH-5); it reports
	// false when the block is not resident.
	Pin(key kvsp.BlockKey) bool
	// Unpin undoes one Pin; it reports whether the block is still pinned
	// (by another user: a block shared by two sharded contexts).
	Unpin(key kvsp.BlockKey) (stillPinned bool)
}

// Errors of engines.
var (
	ErrKVFull      = errors.New("engine: KV memory full")
	ErrNotResident = errors.New("engine: block not resident")
)

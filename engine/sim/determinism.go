package sim

import (
	"fmt"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
)

// Deterministic implements engine.Engine: the simulator's tokens are a
// function of the context and the sampler alone, whatever the batch.
func (e *Engine) Deterministic() bool { return true }

// Check implements engine.Engine: the simulator takes any token id (its
// KV and its next-token distribution are hashes of the context), within
// its context window when it has one.
func (e *Engine) Check(req *engine.Request) error {
	ctx := e.cfg.ContextTokens
	if ctx == 0 {
		return nil
	}
	n := uint64(len(req.Tokens))
	if req.Tokens == nil {
		n = uint64(len(req.Keys))*uint64(e.cfg.Descriptor.BlockTokens) + uint64(len(req.Tail))
	}
	if n > ctx {
		return kvsp.NewProblem(kvsp.ErrInvalid, fmt.Sprintf("tokens: %d tokens exceed the engine's context of %d", n, ctx))
	}
	if n+uint64(req.MaxTokens) > ctx {
		return kvsp.NewProblem(kvsp.ErrInvalid, fmt.Sprintf("max_tokens: a prompt of %d tokens leaves room for %d in the engine's context of %d", n, ctx-n, ctx))
	}
	return nil
}

// Limits implements engine.Bounded: the context window if there is one
// (no vocabulary: any token id is taken).
func (e *Engine) Limits() engine.Limits {
	ctx := e.cfg.ContextTokens
	if ctx == 0 {
		return engine.Limits{}
	}
	return engine.Limits{ContextTokens: ctx, MaxOutputTokens: min(ctx-1, kvsp.MaxGenerateTokens)}
}

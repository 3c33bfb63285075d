package sim

import "github.com/kvsp/kvsp/engine"

// Deterministic implements engine.Engine: the simulator's tokens are a
// function of the context and the sampler alone, whatever the batch.
func (e *Engine) Deterministic() bool { return true }

// Check implements engine.Engine: the simulator takes any token id (its
// KV and its next-token distribution are hashes of the context).
func (e *Engine) Check(*engine.Request) error { return nil }

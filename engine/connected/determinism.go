package connected

import (
	"fmt"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
)

// Deterministic implements engine.Engine: nothing is known of the
// attached engine's batching, so its tokens are held for checkpoints.
func (e *Engine) Deterministic() bool { return false }

// Check implements engine.Engine: the attached engine runs its requests
// itself.
func (e *Engine) Check(*engine.Request) error {
	return fmt.Errorf("%w: the attached engine runs its requests itself", kvsp.ErrInvalidState)
}

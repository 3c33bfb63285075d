package kvsp

// The prefetch directive and its status (Procedures).

// PrefetchBlock is one block of a prefetch directive with its sources.
type PrefetchBlock struct {
	BlockKey BlockKey `json:"block_key"`
	Sources  []string `json:"sources"`
}

// LayerOrderAscending is the only layer_order the spec defines.
const LayerOrderAscending = "ascending"

// PrefetchDirective is the body of POST prefetch (section "Prefetch
// Directives", R-PF-1, R-PF-10, R-PF-11).
type PrefetchDirective struct {
	Directive  UUID            `json:"directive"`
	RequestRef string          `json:"request_ref,omitempty"`
	ScopeID    ScopeID         `json:"scope_id"`
	CompatID   CompatID        `json:"compat_id"`
	Blocks     []PrefetchBlock `json:"blocks"`
	LayerOrder string          `json:"layer_order,omitempty"`
	DeadlineMs uint64          `json:"deadline_ms"`
	LeaseMs    uint64          `json:"lease_ms"`
}

// MaxRequestRefLen bounds the opaque request_ref.
const MaxRequestRefLen = 4096

// Validate implements Validator.
func (p *PrefetchDirective) Validate() error {
	switch {
	case p.Directive.IsZero():
		return invalidf("prefetch: directive: required")
	case p.ScopeID.IsZero():
		return invalidf("prefetch: scope_id: required")
	case p.CompatID.IsZero():
		return invalidf("prefetch: compat_id: required")
	case len(p.Blocks) == 0:
		return invalidf("prefetch: blocks: required, at least one")
	case len(p.RequestRef) > MaxRequestRefLen:
		return invalidf("prefetch: request_ref: longer than %d octets", MaxRequestRefLen)
	case p.LayerOrder != "" && p.LayerOrder != LayerOrderAscending:
		return invalidf("prefetch: layer_order: only %q is defined", LayerOrderAscending)
	case p.DeadlineMs == 0:
		return invalidf("prefetch: deadline_ms: required, at least 1")
	case p.LeaseMs == 0:
		return invalidf("prefetch: lease_ms: required, at least 1")
	}
	if err := checkInt("prefetch: deadline_ms", p.DeadlineMs); err != nil {
		return err
	}
	if err := checkInt("prefetch: lease_ms", p.LeaseMs); err != nil {
		return err
	}
	for i, b := range p.Blocks {
		if b.BlockKey.IsZero() {
			return invalidf("prefetch: blocks[%d].block_key: required", i)
		}
		if len(b.Sources) == 0 {
			return invalidf("prefetch: blocks[%d].sources: required, at least one", i)
		}
		for _, s := range b.Sources {
			if err := ValidateBaseURI("prefetch: blocks[].sources[]", s); err != nil {
				return err
			}
		}
	}
	return nil
}

// PrefetchState is the state of a directive (R-PF-7, A-18).
type PrefetchState string

// The directive states.
const (
	PrefetchPending  PrefetchState = "pending"
	PrefetchPartial  PrefetchState = "partial"
	PrefetchComplete PrefetchState = "complete"
	PrefetchFailed   PrefetchState = "failed"
)

// Valid reports whether s is one of the four states.
func (s PrefetchState) Valid() bool {
	switch s {
	case PrefetchPending, PrefetchPartial, PrefetchComplete, PrefetchFailed:
		return true
	}
	return false
}

// PrefetchStatus is the body of GET prefetch/{id}.
type PrefetchStatus struct {
	Directive UUID          `json:"directive"`
	State     PrefetchState `json:"state"`
	Loaded    []BlockKey    `json:"loaded"`
	Failed    []BlockKey    `json:"failed"`
}

// Validate implements Validator.
func (p *PrefetchStatus) Validate() error {
	switch {
	case p.Directive.IsZero():
		return invalidf("prefetch status: directive: required")
	case !p.State.Valid():
		return invalidf("prefetch status: state: must be pending, partial, complete or failed")
	case p.Loaded == nil || p.Failed == nil:
		return invalidf("prefetch status: loaded and failed: required (may be empty)")
	}
	return nil
}

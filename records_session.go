package kvsp

import (
	"github.com/go-json-experiment/json/jsontext"
)

// The records of a generation session (Procedures: checkpoint and
// migration): its sampler, its checkpoints and the resume request.

// Sampler is the sampler state of a Session Checkpoint (R-REC-21).
type Sampler struct {
	Method        string         `json:"method"`
	Params        map[string]any `json:"params"`
	Seed          uint64         `json:"seed"`
	Step          uint64         `json:"step"`
	Deterministic bool           `json:"deterministic"`
}

// UnmarshalJSONFrom checks that every member is present.
func (s *Sampler) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type Fields Sampler
	return unmarshalRequired(dec, "sampler", (*Fields)(s), "seed", "step", "deterministic")
}

// Validate implements Validator.
func (s *Sampler) Validate() error {
	switch {
	case s.Method == "":
		return invalidf("sampler: method: required")
	case s.Params == nil:
		return invalidf("sampler: params: required (an object)")
	}
	if err := checkInt("sampler: seed", s.Seed); err != nil {
		return err
	}
	return checkInt("sampler: step", s.Step)
}

// Checkpoint is the Session Checkpoint (section "Session Checkpoints and
// Migration", R-REC-16..21, A-24, A-25).
type Checkpoint struct {
	Session      UUID       `json:"session"`
	Epoch        uint64     `json:"epoch"`
	CompatID     CompatID   `json:"compat_id"`
	ScopeID      ScopeID    `json:"scope_id"`
	PromptBlocks []BlockKey `json:"prompt_blocks"`
	PromptTail   []uint32   `json:"prompt_tail"`
	// Generated is every output token [0, OutputOffset).
	Generated    []uint32 `json:"generated"`
	OutputOffset uint64   `json:"output_offset"`
	Sampler      Sampler  `json:"sampler"`
	// Finish, on a session's final checkpoint, says why its output ended
	// there (A-39, an extension member): the PC never resumes or migrates
	// a finished session.
	Finish FinishReason `json:"finish,omitempty"`
}

// FinishReason says why a session's output ended.
type FinishReason string

// The reasons an output ends.
const (
	FinishStop      FinishReason = "stop"      // the model's end-of-generation token (not part of the output)
	FinishLength    FinishReason = "length"    // max_tokens tokens
	FinishCancelled FinishReason = "cancelled" // the front end went away
)

// Valid reports a registered reason.
func (f FinishReason) Valid() bool {
	return f == FinishStop || f == FinishLength || f == FinishCancelled
}

// UnmarshalJSONFrom checks that the members whose zero is meaningful are
// present.
func (c *Checkpoint) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type Fields Checkpoint
	return unmarshalRequired(dec, "checkpoint", (*Fields)(c), "output_offset", "sampler")
}

// Validate implements Validator. It cannot check len(PromptTail) < B, which
// needs the descriptor: see [Checkpoint.ValidateFor].
func (c *Checkpoint) Validate() error {
	switch {
	case c.Session.IsZero():
		return invalidf("checkpoint: session: required")
	case c.Epoch == 0:
		return invalidf("checkpoint: epoch: required, at least 1")
	case c.CompatID.IsZero():
		return invalidf("checkpoint: compat_id: required")
	case c.ScopeID.IsZero():
		return invalidf("checkpoint: scope_id: required")
	case c.PromptBlocks == nil:
		return invalidf("checkpoint: prompt_blocks: required (may be empty)")
	case c.PromptTail == nil:
		return invalidf("checkpoint: prompt_tail: required (may be empty)")
	case c.Generated == nil:
		return invalidf("checkpoint: generated: required (may be empty)")
	case c.OutputOffset != uint64(len(c.Generated)):
		return invalidf("checkpoint: output_offset: must equal the number of generated tokens")
	case c.Finish != "" && !c.Finish.Valid():
		return invalidf("checkpoint: finish: one of stop, length, cancelled")
	}
	for i, k := range c.PromptBlocks {
		if k.IsZero() {
			return invalidf("checkpoint: prompt_blocks[%d]: zero key", i)
		}
	}
	if err := checkInt("checkpoint: epoch", c.Epoch); err != nil {
		return err
	}
	return c.Sampler.Validate()
}

// ValidateFor checks the parts of a checkpoint that depend on the block
// size: the prompt tail is shorter than one block (R-REC-19).
func (c *Checkpoint) ValidateFor(blockTokens int) error {
	if len(c.PromptTail) >= blockTokens {
		return invalidf("checkpoint: prompt_tail: must be shorter than one block")
	}
	return nil
}

// CheckpointAck is the body of the PC's 200 to a checkpoint PUT.
type CheckpointAck struct {
	OutputOffset uint64 `json:"output_offset"`
}

// Validate implements Validator.
func (a *CheckpointAck) Validate() error { return checkInt("output_offset", a.OutputOffset) }

// ResumeRequest is the body of POST sessions/{session}/resume.
type ResumeRequest struct {
	Epoch      uint64     `json:"epoch"`
	Checkpoint Checkpoint `json:"checkpoint"`
}

// Validate implements Validator.
func (r *ResumeRequest) Validate() error {
	if err := r.Checkpoint.Validate(); err != nil {
		return err
	}
	if r.Epoch == 0 {
		return invalidf("resume: epoch: required, at least 1")
	}
	if err := checkInt("resume: epoch", r.Epoch); err != nil {
		return err
	}
	if r.Epoch <= r.Checkpoint.Epoch {
		// A-23 maps this to 409 kvsp-stale-epoch, not 400.
		return NewProblem(ErrStaleEpoch, "resume: epoch must be above the checkpoint's epoch")
	}
	return nil
}

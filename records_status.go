package kvsp

import (
	"math"

	"github.com/go-json-experiment/json/jsontext"
)

// The instance status record (Data Model) and the state body of an
// instance's lifecycle (Procedures).

// Link is one entry of an instance's links: its rate and round-trip time to
// a holder (R-ST-17).
type Link struct {
	Holder   string `json:"holder"`
	MbitPerS uint64 `json:"mbit_per_s"`
	RTTUs    uint64 `json:"rtt_us"`
}

// InstanceStatus is the Instance Status Record (section "Instance Status and
// Lifecycle", R-REC-14, R-REC-15, R-ST-*).
type InstanceStatus struct {
	Instance          string        `json:"instance"`
	Epoch             uint64        `json:"epoch"`
	State             InstanceState `json:"state"`
	Running           uint64        `json:"running"`
	Queued            uint64        `json:"queued"`
	BatchSize         uint64        `json:"batch_size"`
	KVUtilization     float64       `json:"kv_utilization"`
	PrefillTokensPerS float64       `json:"prefill_tokens_per_s"`
	DecodeTokensPerS  float64       `json:"decode_tokens_per_s"`
	Links             []Link        `json:"links"`
	// RequestedState is nil (JSON null) or "sleeping".
	RequestedState *InstanceState `json:"requested_state"`
	TTLMs          uint64         `json:"ttl_ms"`
	// CompatID, a kvsp extension member (other PCs ignore it), tells the
	// PC which model the instance serves, for placement.
	CompatID CompatID `json:"compat_id,omitzero"`
	// Holder, a kvsp extension member, is the holder that stores the
	// instance's blocks: where peers fetch its shards from.
	Holder string `json:"holder,omitzero"`
	// VocabSize, ContextTokens and MaxOutputTokens, kvsp extension
	// members, bound the requests the instance runs (0: not said): token
	// ids below VocabSize, prompt and output within ContextTokens,
	// max_tokens at most MaxOutputTokens. The PC refuses a place beyond
	// them before it chooses an instance (RELIABILITY B14).
	VocabSize       uint64 `json:"vocab_size,omitzero"`
	ContextTokens   uint64 `json:"context_tokens,omitzero"`
	MaxOutputTokens uint64 `json:"max_output_tokens,omitzero"`
	// Started, a kvsp extension member, lists the placements (grant IDs)
	// whose generate the instance accepted since its last record the PC
	// acknowledged: from this record on they are in running or queued,
	// and the PC stops counting them as placements holding room
	// (RELIABILITY L5). At most MaxStarted.
	Started []GrantID `json:"started,omitempty"`
}

// MaxStarted bounds a status record's started list.
const MaxStarted = 4096

// UnmarshalJSONFrom checks that the members whose zero is meaningful are
// present.
func (s *InstanceStatus) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type Fields InstanceStatus
	return unmarshalRequired(dec, "status", (*Fields)(s), "running", "queued", "batch_size", "kv_utilization", "prefill_tokens_per_s", "decode_tokens_per_s")
}

// present reports the first of (name, ok) pairs that is not ok.
func present(record string, pairs ...any) error {
	for i := 0; i < len(pairs); i += 2 {
		if !pairs[i+1].(bool) {
			return invalidf("%s: %s: required", record, pairs[i].(string))
		}
	}
	return nil
}

// Validate implements Validator.
func (s *InstanceStatus) Validate() error {
	if err := ValidateBaseURI("status: instance", s.Instance); err != nil {
		return err
	}
	switch {
	case s.Epoch == 0:
		return invalidf("status: epoch: required, at least 1")
	case !s.State.Valid():
		return invalidf("status: state: required, a registered state")
	case s.TTLMs == 0:
		return invalidf("status: ttl_ms: required, at least 1")
	case !(s.KVUtilization >= 0 && s.KVUtilization <= 1):
		return invalidf("status: kv_utilization: must be in [0, 1]")
	case !finiteNonNegative(s.PrefillTokensPerS):
		return invalidf("status: prefill_tokens_per_s: must be a non-negative number")
	case !finiteNonNegative(s.DecodeTokensPerS):
		return invalidf("status: decode_tokens_per_s: must be a non-negative number")
	case s.Links == nil:
		return invalidf("status: links: required (may be empty)")
	case s.Holder != "" && ValidateBaseURI("status: holder", s.Holder) != nil:
		return invalidf("status: holder: must be a base URI")
	case s.RequestedState != nil && *s.RequestedState != StateSleeping:
		return invalidf("status: requested_state: must be null or \"sleeping\"")
	case len(s.Started) > MaxStarted:
		return invalidf("status: started: more than %d", MaxStarted)
	}
	for _, v := range []struct {
		n string
		v uint64
	}{{"epoch", s.Epoch}, {"running", s.Running}, {"queued", s.Queued}, {"batch_size", s.BatchSize}, {"ttl_ms", s.TTLMs},
		{"vocab_size", s.VocabSize}, {"context_tokens", s.ContextTokens}, {"max_output_tokens", s.MaxOutputTokens}} {
		if err := checkInt("status: "+v.n, v.v); err != nil {
			return err
		}
	}
	for i, l := range s.Links {
		if err := ValidateBaseURI("status: links[].holder", l.Holder); err != nil {
			return err
		}
		if l.MbitPerS == 0 {
			return invalidf("status: links[%d].mbit_per_s: required, at least 1", i)
		}
		if err := checkInt("status: links[].mbit_per_s", l.MbitPerS); err != nil {
			return err
		}
		if err := checkInt("status: links[].rtt_us", l.RTTUs); err != nil {
			return err
		}
	}
	return nil
}

func finiteNonNegative(f float64) bool { return f >= 0 && !math.IsInf(f, 0) }

// StateBody is the body of the PC's answer to a status PUT and of PUT state
// on an instance (R-ST-9, A-19).
type StateBody struct {
	State InstanceState `json:"state"`
}

// Validate implements Validator.
func (b *StateBody) Validate() error {
	if !b.State.Valid() {
		return invalidf("state: required, a registered state")
	}
	return nil
}

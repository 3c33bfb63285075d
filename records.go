package kvsp

import (
	"bytes"
	"encoding/base64"
	"errors"
	"math"
	"slices"
	"strings"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// The JSON records of the spec (section "Records" and the procedures), with
// the shapes the spec leaves open fixed by the decisions of CONFORMANCE.md
// section 3. Decode them with [Decode]: strict JSON, then Validate. A
// required member that is absent, null, or zero where zero is meaningless is
// invalid; members whose zero is meaningful (counts, offsets, seeds) are
// checked for presence while decoding.

// LayerRange is an inclusive layer range [first, last] as carried in a
// residency entry (R-REC-9: "Layer ranges are inclusive").
type LayerRange [2]uint32

// Len returns the number of layers in r.
func (r LayerRange) Len() int { return int(r[1]) - int(r[0]) + 1 }

// Residency states which layers of a replica reside in which tier.
type Residency struct {
	Tier   Tier       `json:"tier"`
	Layers LayerRange `json:"layers"`
	// ReadMbitPerS is the rate at which the holder reads this tier; 0 when
	// absent (R-REC-10).
	ReadMbitPerS uint64 `json:"read_mbit_per_s,omitzero"`
}

// ReplicaRecord describes a copy of a block, or of some of its layers, at a
// holder (section "Records", R-REC-5..13, A-1, A-8, A-14).
type ReplicaRecord struct {
	BlockKey BlockKey `json:"block_key"`
	CompatID CompatID `json:"compat_id"`
	ScopeID  ScopeID  `json:"scope_id"`
	Holder   string   `json:"holder"`
	Codec    Codec    `json:"codec"`
	// Size is the octets of the K and V sections of the layers held.
	Size   uint64 `json:"size"`
	Digest Digest `json:"digest"`
	// LayerDigests has one entry per model layer, index = layer.
	LayerDigests []LayerDigest `json:"layer_digests,omitempty"`
	Residency    []Residency   `json:"residency"`
	TTLMs        uint64        `json:"ttl_ms"`
	// MOQTNamespace is set for a replica served through Media over QUIC
	// Transport; Holder is then a moqt URI (R-REC-12, A-37).
	MOQTNamespace string `json:"moqt_namespace,omitempty"`
}

// MOQTNamespaceFields is the number of Track Namespace Fields in a
// moqt_namespace.
const MOQTNamespaceFields = 5

// Validate implements Validator.
func (r *ReplicaRecord) Validate() error {
	switch {
	case r.BlockKey.IsZero():
		return invalidf("replica: block_key: required")
	case r.CompatID.IsZero():
		return invalidf("replica: compat_id: required")
	case r.ScopeID.IsZero():
		return invalidf("replica: scope_id: required")
	case r.Codec == CodecReserved:
		return invalidf("replica: codec: required, and 0 is reserved")
	case r.Size == 0:
		return invalidf("replica: size: required")
	case r.Digest.IsZero():
		return invalidf("replica: digest: required")
	case r.TTLMs == 0:
		return invalidf("replica: ttl_ms: required, at least 1")
	case len(r.Residency) == 0:
		return invalidf("replica: residency: required, at least one entry")
	}
	if err := checkInt("replica: size", r.Size); err != nil {
		return err
	}
	if err := checkInt("replica: ttl_ms", r.TTLMs); err != nil {
		return err
	}
	if r.MOQTNamespace != "" {
		if err := validateMOQTNamespace(r.MOQTNamespace); err != nil {
			return err
		}
		if err := validateNormalized("replica: holder", r.Holder); err != nil {
			return err
		}
		if !hasScheme(r.Holder, "moqt") {
			return invalidf("replica: holder: a record with moqt_namespace names a moqt URI")
		}
	} else {
		if err := ValidateBaseURI("replica: holder", r.Holder); err != nil {
			return err
		}
		if !hasScheme(r.Holder, "https") {
			return invalidf("replica: holder: must be an https base URI")
		}
	}
	ranges := make([]LayerRange, len(r.Residency))
	for i, e := range r.Residency {
		if !e.Tier.Valid() {
			return invalidf("replica: residency[%d].tier: not registered", i)
		}
		if e.Layers[0] > e.Layers[1] {
			return invalidf("replica: residency[%d].layers: first exceeds last", i)
		}
		if err := checkInt("replica: read_mbit_per_s", e.ReadMbitPerS); err != nil {
			return err
		}
		ranges[i] = e.Layers
	}
	slices.SortFunc(ranges, func(a, b LayerRange) int { return int(int64(a[0]) - int64(b[0])) })
	for i := 1; i < len(ranges); i++ {
		if ranges[i][0] <= ranges[i-1][1] {
			return invalidf("replica: residency: layer ranges overlap")
		}
	}
	if r.LayerDigests != nil {
		if len(r.LayerDigests) == 0 {
			return invalidf("replica: layer_digests: empty")
		}
		if int64(ranges[len(ranges)-1][1]) >= int64(len(r.LayerDigests)) {
			return invalidf("replica: layer_digests: fewer entries than the layers resident")
		}
	}
	return nil
}

// HeldLayers returns the number of layers in the residency entries.
func (r *ReplicaRecord) HeldLayers() int {
	n := 0
	for _, e := range r.Residency {
		n += e.Layers.Len()
	}
	return n
}

func hasScheme(uri, scheme string) bool {
	return len(uri) > len(scheme)+3 && uri[:len(scheme)] == scheme && uri[len(scheme):len(scheme)+3] == "://"
}

// validateMOQTNamespace checks base64url without padding of exactly five
// length-prefixed fields and nothing after them (R-REC-12, A-37).
func validateMOQTNamespace(s string) error {
	b, err := base64.RawURLEncoding.Strict().DecodeString(s)
	if err != nil {
		return invalidf("replica: moqt_namespace: not base64url without padding")
	}
	for i := 0; i < MOQTNamespaceFields; i++ {
		if len(b) == 0 {
			return invalidf("replica: moqt_namespace: fewer than %d fields", MOQTNamespaceFields)
		}
		n := int(b[0])
		if len(b) < 1+n {
			return invalidf("replica: moqt_namespace: field %d truncated", i)
		}
		b = b[1+n:]
	}
	if len(b) != 0 {
		return invalidf("replica: moqt_namespace: octets after the last field")
	}
	return nil
}

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
}

// UnmarshalJSONFrom checks that the members whose zero is meaningful are
// present.
func (s *InstanceStatus) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type plain InstanceStatus
	var w struct {
		plain
		Running       *uint64  `json:"running"`
		Queued        *uint64  `json:"queued"`
		BatchSize     *uint64  `json:"batch_size"`
		KVUtilization *float64 `json:"kv_utilization"`
		Prefill       *float64 `json:"prefill_tokens_per_s"`
		Decode        *float64 `json:"decode_tokens_per_s"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	if err := present("status", "running", w.Running != nil, "queued", w.Queued != nil,
		"batch_size", w.BatchSize != nil, "kv_utilization", w.KVUtilization != nil,
		"prefill_tokens_per_s", w.Prefill != nil, "decode_tokens_per_s", w.Decode != nil); err != nil {
		return err
	}
	*s = InstanceStatus(w.plain)
	s.Running, s.Queued, s.BatchSize = *w.Running, *w.Queued, *w.BatchSize
	s.KVUtilization, s.PrefillTokensPerS, s.DecodeTokensPerS = *w.KVUtilization, *w.Prefill, *w.Decode
	return nil
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
	}
	for _, v := range []struct {
		n string
		v uint64
	}{{"epoch", s.Epoch}, {"running", s.Running}, {"queued", s.Queued}, {"batch_size", s.BatchSize}, {"ttl_ms", s.TTLMs}} {
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
	type plain Sampler
	var w struct {
		plain
		Seed          *uint64 `json:"seed"`
		Step          *uint64 `json:"step"`
		Deterministic *bool   `json:"deterministic"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	if err := present("sampler", "seed", w.Seed != nil, "step", w.Step != nil, "deterministic", w.Deterministic != nil); err != nil {
		return err
	}
	*s = Sampler(w.plain)
	s.Seed, s.Step, s.Deterministic = *w.Seed, *w.Step, *w.Deterministic
	return nil
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
}

// UnmarshalJSONFrom checks that the members whose zero is meaningful are
// present.
func (c *Checkpoint) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type plain Checkpoint
	var w struct {
		plain
		OutputOffset *uint64  `json:"output_offset"`
		Sampler      *Sampler `json:"sampler"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	if err := present("checkpoint", "output_offset", w.OutputOffset != nil, "sampler", w.Sampler != nil); err != nil {
		return err
	}
	*c = Checkpoint(w.plain)
	c.OutputOffset, c.Sampler = *w.OutputOffset, *w.Sampler
	return nil
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

// TokenRange is a half-open token range [start, end), as in a Shard Map and
// a reshard plan (R-RSH-2, A-26).
type TokenRange [2]uint64

func (r TokenRange) valid() bool { return r[0] < r[1] && r[1] <= MaxJSONInt }

func (r TokenRange) overlaps(o TokenRange) bool { return r[0] < o[1] && o[0] < r[1] }

// Shard assigns a token range to an instance.
type Shard struct {
	Tokens   TokenRange `json:"tokens"`
	Instance string     `json:"instance"`
}

// ShardMap describes a context split by token range across a parallel group
// (section "Sequence-Sharded Caches and Resharding", R-RSH-1, R-RSH-2).
type ShardMap struct {
	Map     string  `json:"map"`
	Version uint64  `json:"version"`
	Shards  []Shard `json:"shards"`
}

// MaxMapIDLen bounds the opaque "map" identifier.
const MaxMapIDLen = 256

func validateMapID(rec, m string) error {
	if m == "" || len(m) > MaxMapIDLen {
		return invalidf("%s: map: required, at most %d octets", rec, MaxMapIDLen)
	}
	return nil
}

// UnmarshalJSONFrom checks that version is present (0 is a valid version).
func (m *ShardMap) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type plain ShardMap
	var w struct {
		plain
		Version *uint64 `json:"version"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	if err := present("shard map", "version", w.Version != nil); err != nil {
		return err
	}
	*m = ShardMap(w.plain)
	m.Version = *w.Version
	return nil
}

// Validate implements Validator: shards start at token 0 and are half-open,
// contiguous and non-overlapping, in ascending order.
func (m *ShardMap) Validate() error {
	if err := validateMapID("shard map", m.Map); err != nil {
		return err
	}
	if err := checkInt("shard map: version", m.Version); err != nil {
		return err
	}
	if len(m.Shards) == 0 {
		return invalidf("shard map: shards: required, at least one")
	}
	var next uint64
	for i, s := range m.Shards {
		if !s.Tokens.valid() {
			return invalidf("shard map: shards[%d].tokens: must be [start, end) with start < end", i)
		}
		if s.Tokens[0] != next {
			return invalidf("shard map: shards[%d].tokens: not contiguous with the previous shard", i)
		}
		next = s.Tokens[1]
		if err := ValidateBaseURI("shard map: shards[].instance", s.Instance); err != nil {
			return err
		}
	}
	return nil
}

// LookupRequest is the body of POST lookup (section "Lookup", R-IS-11,
// R-IS-12).
type LookupRequest struct {
	ScopeID   ScopeID    `json:"scope_id"`
	CompatID  CompatID   `json:"compat_id"`
	BlockKeys []BlockKey `json:"block_keys"`
	Targets   []string   `json:"targets,omitempty"`
}

// UnmarshalJSONFrom decodes a lookup request token by token, without
// reflection: it is the IS's hottest input (up to max_lookup_keys block
// keys per request). Semantics are those of the reflective decoder:
// unknown members skipped, null as the zero value, duplicates and invalid
// UTF-8 refused by the decoder's options.
func (l *LookupRequest) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	*l = LookupRequest{}
	tok, err := dec.ReadToken()
	if err != nil {
		return err
	}
	switch tok.Kind() {
	case 'n':
		return nil
	case '{':
	default:
		return invalidf("cannot decode JSON %s as a lookup request", kindName(tok.Kind()))
	}
	var scratch []byte // unescaped strings, rare
	for dec.PeekKind() != '}' {
		name, err := dec.ReadValue() // a member name: always a string
		if err != nil {
			return err
		}
		n := name[1 : len(name)-1]
		if bytes.IndexByte(n, '\\') >= 0 {
			if n, err = jsontext.AppendUnquote(nil, name); err != nil {
				return err
			}
		}
		switch string(n) {
		case "scope_id":
			err = readHexValue(dec, l.ScopeID[:], "scope_id", &scratch)
		case "compat_id":
			err = readHexValue(dec, l.CompatID[:], "compat_id", &scratch)
		case "block_keys":
			err = l.readBlockKeys(dec, &scratch)
		case "targets":
			err = json.UnmarshalDecode(dec, &l.Targets)
		default:
			err = dec.SkipValue()
		}
		if err != nil {
			return err
		}
	}
	_, err = dec.ReadToken() // '}'
	return err
}

func (l *LookupRequest) readBlockKeys(dec *jsontext.Decoder, scratch *[]byte) error {
	tok, err := dec.ReadToken()
	if err != nil {
		return err
	}
	switch tok.Kind() {
	case 'n':
		l.BlockKeys = nil
		return nil
	case '[':
	default:
		return invalidf("block_keys: cannot decode JSON %s as a list of block keys", kindName(tok.Kind()))
	}
	l.BlockKeys = make([]BlockKey, 0, 64)
	for i := 0; dec.PeekKind() != ']'; i++ {
		l.BlockKeys = append(l.BlockKeys, BlockKey{})
		if err := readHexValue(dec, l.BlockKeys[i][:], "block key", scratch); err != nil {
			if errors.Is(err, ErrInvalid) { // ours: name the element
				return invalidf("element %d: %s", i, strings.TrimPrefix(err.Error(), ErrInvalid.Error()+": "))
			}
			return err
		}
	}
	_, err = dec.ReadToken()
	return err
}

// readHexValue reads a JSON string of lowercase hex into dst (null: zero).
func readHexValue(dec *jsontext.Decoder, dst []byte, what string, scratch *[]byte) error {
	v, err := dec.ReadValue()
	if err != nil {
		return err
	}
	switch v.Kind() {
	case 'n':
		clear(dst)
		return nil
	case '"':
	default:
		return invalidf("%s: cannot decode JSON %s as hex", what, kindName(v.Kind()))
	}
	s := v[1 : len(v)-1]
	if bytes.IndexByte(s, '\\') >= 0 {
		if *scratch, err = jsontext.AppendUnquote((*scratch)[:0], v); err != nil {
			return invalidf("%s: malformed string", what)
		}
		s = *scratch
	}
	return parseHex(dst, s, what)
}

// Validate implements Validator. The per-deployment cap on len(BlockKeys)
// (413, A-27) is the server's to enforce.
func (l *LookupRequest) Validate() error {
	switch {
	case l.ScopeID.IsZero():
		return invalidf("lookup: scope_id: required")
	case l.CompatID.IsZero():
		return invalidf("lookup: compat_id: required")
	case l.BlockKeys == nil:
		return invalidf("lookup: block_keys: required")
	}
	for i, k := range l.BlockKeys {
		if k.IsZero() {
			return invalidf("lookup: block_keys[%d]: zero key", i)
		}
	}
	for _, t := range l.Targets {
		if err := ValidateBaseURI("lookup: targets[]", t); err != nil {
			return err
		}
	}
	return nil
}

// TargetEstimate is the IS's estimate for one lookup target (A-3, A-21,
// A-22), in microseconds rounded up.
type TargetEstimate struct {
	Instance    string `json:"instance"`
	FetchUs     uint64 `json:"fetch_us"`
	RecomputeUs uint64 `json:"recompute_us"`
}

// UnmarshalJSONFrom checks that both estimates are present: a fetch_us of
// 0 means "already resident", so an absent one must not read as 0.
func (t *TargetEstimate) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type plain TargetEstimate
	var w struct {
		plain
		FetchUs     *uint64 `json:"fetch_us"`
		RecomputeUs *uint64 `json:"recompute_us"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	if err := present("lookup response: targets[]", "fetch_us", w.FetchUs != nil, "recompute_us", w.RecomputeUs != nil); err != nil {
		return err
	}
	*t = TargetEstimate(w.plain)
	t.FetchUs, t.RecomputeUs = *w.FetchUs, *w.RecomputeUs
	return nil
}

// LookupResponse is the answer to POST lookup: Replicas has exactly
// Matched entries, each non-empty.
type LookupResponse struct {
	Matched  int               `json:"matched"`
	Replicas [][]ReplicaRecord `json:"replicas"`
	Targets  []TargetEstimate  `json:"targets,omitempty"`
}

// UnmarshalJSONFrom checks that matched is present (0 is a valid answer).
func (l *LookupResponse) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type plain LookupResponse
	var w struct {
		plain
		Matched *int `json:"matched"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	if err := present("lookup response", "matched", w.Matched != nil); err != nil {
		return err
	}
	*l = LookupResponse(w.plain)
	l.Matched = *w.Matched
	return nil
}

// Validate implements Validator.
func (l *LookupResponse) Validate() error {
	if l.Matched < 0 || l.Matched != len(l.Replicas) {
		return invalidf("lookup response: replicas: must have exactly matched entries")
	}
	for i := range l.Replicas {
		if len(l.Replicas[i]) == 0 {
			return invalidf("lookup response: replicas[%d]: empty", i)
		}
		for j := range l.Replicas[i] {
			if err := l.Replicas[i][j].Validate(); err != nil {
				return err
			}
		}
	}
	for _, t := range l.Targets {
		if err := ValidateBaseURI("lookup response: targets[].instance", t.Instance); err != nil {
			return err
		}
		if err := checkInt("lookup response: fetch_us", t.FetchUs); err != nil {
			return err
		}
		if err := checkInt("lookup response: recompute_us", t.RecomputeUs); err != nil {
			return err
		}
	}
	return nil
}

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

// LeaseRequest is the body of POST leases (section "Leases", A-2).
type LeaseRequest struct {
	ScopeID   ScopeID    `json:"scope_id"`
	CompatID  CompatID   `json:"compat_id"`
	BlockKeys []BlockKey `json:"block_keys"`
	TTLMs     uint64     `json:"ttl_ms"`
}

// Validate implements Validator.
func (l *LeaseRequest) Validate() error {
	switch {
	case l.ScopeID.IsZero():
		return invalidf("lease: scope_id: required")
	case l.CompatID.IsZero():
		return invalidf("lease: compat_id: required")
	case len(l.BlockKeys) == 0:
		return invalidf("lease: block_keys: required, at least one")
	case l.TTLMs == 0:
		return invalidf("lease: ttl_ms: required, at least 1")
	}
	for i, k := range l.BlockKeys {
		if k.IsZero() {
			return invalidf("lease: block_keys[%d]: zero key", i)
		}
	}
	return checkInt("lease: ttl_ms", l.TTLMs)
}

// LeaseRenewal is the body of PUT leases/{id}.
type LeaseRenewal struct {
	TTLMs uint64 `json:"ttl_ms"`
}

// Validate implements Validator.
func (l *LeaseRenewal) Validate() error {
	if l.TTLMs == 0 {
		return invalidf("lease: ttl_ms: required, at least 1")
	}
	return checkInt("lease: ttl_ms", l.TTLMs)
}

// MaxLeaseIDLen bounds lease identifiers, which are opaque and path-safe.
const MaxLeaseIDLen = 128

// LeaseResponse is the body of a granted or renewed lease.
type LeaseResponse struct {
	Lease     string     `json:"lease"`
	TTLMs     uint64     `json:"ttl_ms"`
	BlockKeys []BlockKey `json:"block_keys"`
}

// Validate implements Validator.
func (l *LeaseResponse) Validate() error {
	if l.Lease == "" || len(l.Lease) > MaxLeaseIDLen {
		return invalidf("lease response: lease: required, at most %d octets", MaxLeaseIDLen)
	}
	for i := 0; i < len(l.Lease); i++ {
		if c := l.Lease[i]; !isUnreserved(c) {
			return invalidf("lease response: lease: must be path-safe")
		}
	}
	if l.Lease == "." || l.Lease == ".." {
		return invalidf("lease response: lease: a dot segment is not path-safe")
	}
	if l.TTLMs == 0 {
		return invalidf("lease response: ttl_ms: required")
	}
	if len(l.BlockKeys) == 0 {
		return invalidf("lease response: block_keys: required")
	}
	return checkInt("lease response: ttl_ms", l.TTLMs)
}

// ReshardFetch is one range an instance loads from a peer for the new map
// version.
type ReshardFetch struct {
	Tokens TokenRange `json:"tokens"`
	From   string     `json:"from"`
	// Holder and BlockKeys are kvsp extension members: the holder
	// that keeps the source instance's blocks, and the Block Keys of the
	// range in order (the instance cannot compute them without the
	// tokens). Other implementations ignore them.
	Holder    string     `json:"holder,omitzero"`
	BlockKeys []BlockKey `json:"block_keys,omitzero"`
}

// ReshardKind says which of the three reshard messages a body is.
type ReshardKind int

// The reshard messages (section "Sequence-Sharded Caches and Resharding").
const (
	ReshardPlan ReshardKind = iota + 1
	ReshardCommit
	ReshardAbort
)

// Reshard is the body of POST reshard: a plan (from, to, deadline_ms, and
// retain/fetch/release), a commit, or an abort (R-RSH-3..14, A-26).
type Reshard struct {
	Kind       ReshardKind    `json:"-"`
	Map        string         `json:"map"`
	From       uint64         `json:"from,omitzero"`
	To         uint64         `json:"to,omitzero"`
	DeadlineMs uint64         `json:"deadline_ms,omitzero"`
	Retain     []TokenRange   `json:"retain,omitzero"`
	Fetch      []ReshardFetch `json:"fetch,omitzero"`
	Release    []TokenRange   `json:"release,omitzero"`
	Commit     uint64         `json:"commit,omitzero"`
	Abort      uint64         `json:"abort,omitzero"`
	// ScopeID and CompatID, kvsp extension members of a plan, name the
	// scope and model of the context's blocks (fetches are block GETs,
	// A-26); ScopeID is also sent with commits and aborts, since a map
	// identifier names a context within its scope only. Absent, the
	// instance takes the scope of the map it holds under that identifier.
	ScopeID  ScopeID  `json:"scope_id,omitzero"`
	CompatID CompatID `json:"compat_id,omitzero"`
	// Plan, a kvsp extension member of all three messages, identifies one
	// reshard: an instance applies a commit or abort that names a plan
	// only to that plan (a deposed PC's abort cannot discard its
	// successor's plan for the same version).
	Plan UUID `json:"plan,omitzero"`
	// Term, a kvsp extension member of a plan, orders plans of one version
	// from successive PCs (the etcd election revision of a group's leader,
	// the start time of a lone PC): an open plan is replaced only by one of
	// the same or a later term.
	Term uint64 `json:"term,omitzero"`
}

// ReshardAck is kvsp's body of a 200 to POST reshard (A-26 leaves it
// open): the map, the instance's version of it after the message, and
// the octets it transferred for a plan (zero for retained ranges,
// R-RSH-6).
type ReshardAck struct {
	Map          string `json:"map"`
	Version      uint64 `json:"version"`
	FetchedBytes uint64 `json:"fetched_bytes"`
}

// Validate implements Validator.
func (a *ReshardAck) Validate() error {
	if err := validateMapID("reshard ack", a.Map); err != nil {
		return err
	}
	if err := checkInt("reshard ack: version", a.Version); err != nil {
		return err
	}
	return checkInt("reshard ack: fetched_bytes", a.FetchedBytes)
}

// UnmarshalJSONFrom decides the kind by the members present.
func (r *Reshard) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type plain Reshard
	var w struct {
		plain
		From   *uint64 `json:"from"`
		To     *uint64 `json:"to"`
		Commit *uint64 `json:"commit"`
		Abort  *uint64 `json:"abort"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	*r = Reshard(w.plain)
	kinds := 0
	if w.From != nil || w.To != nil {
		if err := present("reshard plan", "from", w.From != nil, "to", w.To != nil); err != nil {
			return err
		}
		r.Kind, r.From, r.To = ReshardPlan, *w.From, *w.To
		// Absent retain/fetch/release mean "none": hold them as empty
		// slices, as they are sent.
		r.Retain, r.Fetch, r.Release = nonNil(r.Retain), nonNil(r.Fetch), nonNil(r.Release)
		kinds++
	}
	if w.Commit != nil {
		r.Kind, r.Commit = ReshardCommit, *w.Commit
		kinds++
	}
	if w.Abort != nil {
		r.Kind, r.Abort = ReshardAbort, *w.Abort
		kinds++
	}
	if kinds != 1 {
		return invalidf("reshard: must be exactly one of a plan (from, to), a commit or an abort")
	}
	return nil
}

// MarshalJSONTo writes the members of r's kind only.
func (r *Reshard) MarshalJSONTo(enc *jsontext.Encoder) error {
	switch r.Kind {
	case ReshardPlan:
		type plan struct {
			Map        string         `json:"map"`
			From       uint64         `json:"from"`
			To         uint64         `json:"to"`
			DeadlineMs uint64         `json:"deadline_ms"`
			Retain     []TokenRange   `json:"retain"`
			Fetch      []ReshardFetch `json:"fetch"`
			Release    []TokenRange   `json:"release"`
			ScopeID    ScopeID        `json:"scope_id,omitzero"`
			CompatID   CompatID       `json:"compat_id,omitzero"`
			Plan       UUID           `json:"plan,omitzero"`
			Term       uint64         `json:"term,omitzero"`
		}
		return json.MarshalEncode(enc, plan{r.Map, r.From, r.To, r.DeadlineMs,
			nonNil(r.Retain), nonNil(r.Fetch), nonNil(r.Release), r.ScopeID, r.CompatID, r.Plan, r.Term})
	case ReshardCommit:
		return json.MarshalEncode(enc, struct {
			Map     string  `json:"map"`
			Commit  uint64  `json:"commit"`
			ScopeID ScopeID `json:"scope_id,omitzero"`
			Plan    UUID    `json:"plan,omitzero"`
		}{r.Map, r.Commit, r.ScopeID, r.Plan})
	case ReshardAbort:
		return json.MarshalEncode(enc, struct {
			Map     string  `json:"map"`
			Abort   uint64  `json:"abort"`
			ScopeID ScopeID `json:"scope_id,omitzero"`
			Plan    UUID    `json:"plan,omitzero"`
		}{r.Map, r.Abort, r.ScopeID, r.Plan})
	}
	return invalidf("reshard: no kind set")
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// Validate implements Validator. Whether from/to match the current map
// version is the instance's decision (409 kvsp-plan-conflict), not a
// syntax error.
func (r *Reshard) Validate() error {
	if err := validateMapID("reshard", r.Map); err != nil {
		return err
	}
	for _, v := range []uint64{r.From, r.To, r.Commit, r.Abort, r.DeadlineMs} {
		if err := checkInt("reshard: version or deadline", v); err != nil {
			return err
		}
	}
	if r.Kind != ReshardPlan {
		if r.Kind != ReshardCommit && r.Kind != ReshardAbort {
			return invalidf("reshard: unknown kind")
		}
		return nil
	}
	if r.DeadlineMs == 0 {
		return invalidf("reshard plan: deadline_ms: required, at least 1")
	}
	var all []TokenRange
	check := func(name string, rs []TokenRange) error {
		for _, x := range rs {
			if !x.valid() {
				return invalidf("reshard plan: %s: ranges must be [start, end) with start < end", name)
			}
			for _, y := range all {
				if x.overlaps(y) {
					return invalidf("reshard plan: %s: ranges overlap (a retained range is never transferred)", name)
				}
			}
			all = append(all, x)
		}
		return nil
	}
	if err := check("retain", r.Retain); err != nil {
		return err
	}
	fetch := make([]TokenRange, len(r.Fetch))
	for i, f := range r.Fetch {
		if err := ValidateBaseURI("reshard plan: fetch[].from", f.From); err != nil {
			return err
		}
		if f.Holder != "" {
			if err := ValidateBaseURI("reshard plan: fetch[].holder", f.Holder); err != nil {
				return err
			}
		}
		fetch[i] = f.Tokens
	}
	if err := check("fetch", fetch); err != nil {
		return err
	}
	return check("release", r.Release)
}

// ValidateFor checks that every range is a multiple of the block size
//
func (r *Reshard) ValidateFor(blockTokens int) error {
	if blockTokens < 1 {
		return invalidf("reshard plan: block_tokens must be at least 1")
	}
	b := uint64(blockTokens)
	aligned := func(x TokenRange) bool { return x[0]%b == 0 && x[1]%b == 0 }
	for _, x := range r.Retain {
		if !aligned(x) {
			return invalidf("reshard plan: retain: ranges must be multiples of block_tokens")
		}
	}
	for _, f := range r.Fetch {
		if !aligned(f.Tokens) {
			return invalidf("reshard plan: fetch: ranges must be multiples of block_tokens")
		}
		if f.BlockKeys != nil && uint64(len(f.BlockKeys)) != (f.Tokens[1]-f.Tokens[0])/b {
			return invalidf("reshard plan: fetch[].block_keys: one key per block of the range")
		}
	}
	for _, x := range r.Release {
		if !aligned(x) {
			return invalidf("reshard plan: release: ranges must be multiples of block_tokens")
		}
	}
	return nil
}

package kvsp

import (
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// The shard map of a sequence-sharded context and the two-phase reshard
// that changes it (Data Model, Procedures).

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
	type Fields ShardMap
	return unmarshalRequired(dec, "shard map", (*Fields)(m), "version")
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

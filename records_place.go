package kvsp

import "fmt"

// The placement API of kvsp's PC (not part of the KVSP spec, which leaves
// the inference API out of scope): front ends ask POST {pc}place where a
// request should run, and get a session and the instance.

// PlaceRequest is the body of POST {pc}place.
type PlaceRequest struct {
	ScopeID  ScopeID  `json:"scope_id"`
	CompatID CompatID `json:"compat_id"`
	Tokens   []uint32 `json:"tokens,omitempty"`
	// TokensLE32 carries the prompt instead of Tokens (one of the two):
	// each token id in 4 octets, little-endian, the whole base64 in JSON
	// (see TokensLE32). Decoding folds it into Tokens.
	TokensLE32 []byte        `json:"tokens_le32,omitempty"`
	Session    *UUID         `json:"session,omitempty"`
	Sampler    *PlaceSampler `json:"sampler,omitempty"`
	MaxTokens  uint64        `json:"max_tokens"`
}

// PlaceSampler is the sampler a request asks for.
type PlaceSampler struct {
	Method string         `json:"method"`
	Params map[string]any `json:"params,omitempty"`
	Seed   uint64         `json:"seed"`
}

// MaxPlaceTokens bounds a request's prompt.
const MaxPlaceTokens = 1 << 20

// Validate implements Validator.
func (q *PlaceRequest) Validate() error {
	if err := foldTokensLE32("place", &q.Tokens, &q.TokensLE32); err != nil {
		return err
	}
	return q.validate("place")
}

func (q *PlaceRequest) validate(where string) error {
	switch {
	case q.ScopeID.IsZero():
		return invalidf("%s: scope_id: required", where)
	case q.CompatID.IsZero():
		return invalidf("%s: compat_id: required", where)
	case len(q.Tokens) == 0:
		return invalidf("%s: tokens: required, at least one", where)
	case len(q.Tokens) > MaxPlaceTokens:
		return fmt.Errorf("%w: %s: tokens: more than %d", ErrTooLarge, where, MaxPlaceTokens) // 413
	case q.MaxTokens == 0 || q.MaxTokens > MaxGenerateTokens:
		// B14: no instance generates more (generate refuses it, 413, and
		// checks that first): refused here before anything is placed.
		return invalidf("%s: max_tokens: required, 1..%d", where, MaxGenerateTokens)
	case q.Session != nil && q.Session.IsZero():
		return invalidf("%s: session: the nil UUID", where)
	}
	if s := q.Sampler; s != nil {
		// B10: a sampler out of range is refused here, before anything is
		// placed or started (a top-p with p <= 0 made the engine panic);
		// the seed travels on in checkpoints, which refuse one above
		// 2^53-1 (found by L2).
		return ValidateSampler(where+": sampler", s.Method, s.Params, s.Seed)
	}
	return nil
}

// PlaceResponse answers POST place.
type PlaceResponse struct {
	Session   UUID   `json:"session"`
	Epoch     uint64 `json:"epoch"`
	Instance  string `json:"instance"`
	Matched   int    `json:"matched"`
	Directive *UUID  `json:"directive"`
	// Grant, a new session's or a continued one's, is the PC's
	// permission to run it at Instance (kvsp.Grant's wire form), which
	// the front end passes on in its generate: an instance runs nothing
	// without one (RELIABILITY S14). Opaque to front ends; it expires
	// after the PC's placement_ttl_ms.
	Grant string `json:"grant,omitempty"`
}

// Validate implements Validator.
func (r *PlaceResponse) Validate() error {
	switch {
	case r.Session.IsZero():
		return invalidf("place: session: required")
	case r.Epoch == 0:
		return invalidf("place: epoch: required, at least 1")
	case len(r.Grant) > MaxGrantLen:
		return invalidf("place: grant: longer than %d characters", MaxGrantLen)
	}
	return ValidateBaseURI("place: instance", r.Instance)
}

// GenerateRequest is the body of POST {ii}generate: a request placed by
// the PC, run on the chosen instance. The answer streams its output tokens
// as JSON lines (MediaTypeTokens), each labelled with its index and the
// session's epoch, so a front end can drop what a superseded epoch sent.
type GenerateRequest struct {
	Session  UUID     `json:"session"`
	Epoch    uint64   `json:"epoch"`
	ScopeID  ScopeID  `json:"scope_id"`
	CompatID CompatID `json:"compat_id"`
	Tokens   []uint32 `json:"tokens,omitempty"`
	// TokensLE32 carries the prompt instead of Tokens, as in PlaceRequest.
	TokensLE32 []byte        `json:"tokens_le32,omitempty"`
	MaxTokens  uint64        `json:"max_tokens"`
	Sampler    *PlaceSampler `json:"sampler,omitempty"`
	// From, for a resumed session, is the first output index the front
	// end lacks: tokens the checkpoint holds from there are sent again
	// before generation continues (a stream cut in flight leaves no gap).
	From *uint64 `json:"from,omitempty"`
	// Grant is the place answer's grant for this session and epoch:
	// without a valid one the instance refuses the request (403) before
	// any engine work (RELIABILITY S14).
	Grant string `json:"grant,omitempty"`
}

// MaxGenerateTokens bounds one generation's output.
const MaxGenerateTokens = 1 << 20

// MediaTypeTokens is the media type of a generation's token stream: one
// GeneratedToken per line.
const MediaTypeTokens = "application/x-ndjson"

// Validate implements Validator.
func (q *GenerateRequest) Validate() error {
	if err := foldTokensLE32("generate", &q.Tokens, &q.TokensLE32); err != nil {
		return err
	}
	switch {
	case q.Session.IsZero():
		return invalidf("generate: session: required")
	case q.Epoch == 0:
		return invalidf("generate: epoch: required, at least 1")
	case q.MaxTokens > MaxGenerateTokens:
		return fmt.Errorf("%w: generate: max_tokens: at most %d", ErrTooLarge, MaxGenerateTokens)
	case len(q.Grant) > MaxGrantLen:
		return invalidf("generate: grant: longer than %d characters", MaxGrantLen)
	}
	p := PlaceRequest{ScopeID: q.ScopeID, CompatID: q.CompatID, Tokens: q.Tokens, MaxTokens: q.MaxTokens, Sampler: q.Sampler}
	return p.validate("generate")
}

// GeneratedToken is one line of a token stream; the last line has Done
// set (and no token), so a cut stream is told from a finished one.
type GeneratedToken struct {
	Index uint64 `json:"index"`
	Epoch uint64 `json:"epoch"`
	Token uint32 `json:"token"`
	Done  bool   `json:"done,omitempty"`
	// Finish, on the done line, says why the output ended there:
	// Index is then the number of output tokens.
	Finish FinishReason `json:"finish,omitempty"`
	// Prefill, on the first line a stream sends, says how the prompt was
	// served: prompt tokens reused from KV (resident or loaded) and
	// tokens computed.
	Prefill *PrefillInfo `json:"prefill,omitempty"`
}

// PrefillInfo is how an instance served a request's prompt.
type PrefillInfo struct {
	CachedTokens   uint64 `json:"cached_tokens"`
	ComputedTokens uint64 `json:"computed_tokens"`
}

// Validate implements Validator.
func (t *GeneratedToken) Validate() error {
	switch {
	case t.Epoch == 0:
		return invalidf("token: epoch: required, at least 1")
	case t.Finish != "" && !t.Finish.Valid():
		return invalidf("token: finish: one of stop, length, cancelled")
	case t.Finish != "" && !t.Done:
		return invalidf("token: finish: only on the done line")
	}
	return nil
}

// MapUpdate is the body of PUT maps/{map} at a PC (kvsp's API for
// resharding; the spec leaves how a PC decides to reshard out of scope):
// move a sequence-sharded context to Map, its next version. Tokens are
// the context's tokens, required for its first map (the PC computes the
// Block Keys); DeadlineMs is each plan's deadline_ms.
type MapUpdate struct {
	Map        ShardMap `json:"map"`
	ScopeID    ScopeID  `json:"scope_id"`
	CompatID   CompatID `json:"compat_id"`
	Tokens     []uint32 `json:"tokens,omitempty"`
	DeadlineMs uint64   `json:"deadline_ms,omitzero"`
}

// Validate implements Validator.
func (u *MapUpdate) Validate() error {
	if u.ScopeID.IsZero() || u.CompatID.IsZero() {
		return invalidf("map update: scope_id and compat_id: required")
	}
	if err := checkInt("map update: deadline_ms", u.DeadlineMs); err != nil {
		return err
	}
	return u.Map.Validate()
}

// MapUpdateResult answers a committed map update: the map now
// authoritative and the octets each member transferred.
type MapUpdateResult struct {
	Map          ShardMap          `json:"map"`
	FetchedBytes map[string]uint64 `json:"fetched_bytes"`
}

// Validate implements Validator.
func (r *MapUpdateResult) Validate() error { return r.Map.Validate() }

package kvsp

import (
	"bytes"
	"errors"
	"strings"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// The Index Service's lookup request and response (Procedures), with
// the fetch and recompute estimates.

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
	type Fields TargetEstimate
	return unmarshalRequired(dec, "lookup response: targets[]", (*Fields)(t), "fetch_us", "recompute_us")
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
	type Fields LookupResponse
	return unmarshalRequired(dec, "lookup response", (*Fields)(l), "matched")
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

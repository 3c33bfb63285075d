package kvsp

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// MediaType is the media type of KVSP JSON bodies (R-HTTP-7, R-REG-1).
const MediaType = "application/kvsp+json"

// MediaTypeBlock is the media type of block data, a KVB1 container
// (R-REG-2).
const MediaTypeBlock = "application/kvsp-block"

// MaxJSONInt is the largest integer KVSP accepts in JSON: 2^53-1, the I-JSON
// range of RFC 7493 (decision A-33).
const MaxJSONInt = 1<<53 - 1

// decodeOptions are the strict semantics of decision A-29 (these are the
// defaults of go-json-experiment/json; spelled out so a change of default
// cannot loosen them): member names match case-sensitively, a duplicate
// member name is an error, invalid UTF-8 is an error, unknown members are
// ignored (R-REC-1).
var decodeOptions = json.JoinOptions(
	json.MatchCaseInsensitiveNames(false),
	jsontext.AllowDuplicateNames(false),
	jsontext.AllowInvalidUTF8(false),
	json.RejectUnknownMembers(false),
	tokenJSON,
)

// Validator is a record that checks its own invariants after decoding.
type Validator interface {
	Validate() error
}

// Decode parses a KVSP JSON body into v strictly and validates
// it. Every failure wraps ErrInvalid (400); the error text names the member
// and never echoes the body.
func Decode(data []byte, v Validator) error {
	if err := json.Unmarshal(data, v, decodeOptions); err != nil {
		return fmt.Errorf("%w: %s", ErrInvalid, describeJSONError(err))
	}
	if err := v.Validate(); err != nil {
		return err
	}
	return nil
}

// Marshal encodes a record as KVSP JSON (compact UTF-8, members in field
// order).
func Marshal(v any) ([]byte, error) {
	return json.Marshal(v, json.Deterministic(true))
}

// describeJSONError reduces a decoding error to where and what, without the
// offending value: bodies hold tokens, and errors reach logs and peers.
func describeJSONError(err error) string {
	var se *json.SemanticError
	if errors.As(err, &se) {
		where := string(se.JSONPointer)
		if where == "" {
			where = "/"
		}
		switch {
		case se.Err != nil && errors.Is(se.Err, ErrInvalid):
			// Our own validation (UnmarshalText and friends): no values in it.
			return where + ": " + strings.TrimPrefix(se.Err.Error(), ErrInvalid.Error()+": ")
		case se.GoType != nil:
			return fmt.Sprintf("%s: cannot decode JSON %s as %s", where, kindName(se.JSONKind), se.GoType)
		}
		return where + ": cannot decode"
	}
	var xe *jsontext.SyntacticError
	if errors.As(err, &xe) {
		msg := "invalid"
		if xe.Err != nil {
			msg = xe.Err.Error()
			if len(msg) > 80 {
				msg = msg[:80]
			}
		}
		return fmt.Sprintf("malformed JSON at offset %d: %s", xe.ByteOffset, msg)
	}
	return "malformed JSON"
}

func kindName(k jsontext.Kind) string {
	switch k {
	case 'n':
		return "null"
	case 'f', 't':
		return "boolean"
	case '"':
		return "string"
	case '0':
		return "number"
	case '{':
		return "object"
	case '[':
		return "array"
	}
	return "value"
}

// checkInt reports an integer member outside 0..2^53-1.
func checkInt(name string, v uint64) error {
	if v > MaxJSONInt {
		return fmt.Errorf("%w: %s: integer outside 0..2^53-1", ErrInvalid, name)
	}
	return nil
}

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
}

// Millis is a count of milliseconds from the wire (ttl_ms, deadline_ms,
// lease_ms: up to 2^53-1) as a Duration, saturated at the largest one
// (292 years) rather than wrapped to a negative one: time.Duration(ms) *
// time.Millisecond overflows past 2^63 ns, about 106 days, and a TTL of
// 2^53 ms became an already expired record.
func Millis(ms uint64) time.Duration {
	if ms > uint64(math.MaxInt64/int64(time.Millisecond)) {
		return math.MaxInt64
	}
	return time.Duration(ms) * time.Millisecond
}

package kvsp

import (
	"errors"
	"fmt"
	"strings"

	"github.com/go-json-experiment/json"
)

// ProblemTypeBase is the prefix of every KVSP problem type URI
// (section "Error Handling", R-ERR-10, decision A-7: no "www.").
const ProblemTypeBase = "https://iana.org/assignments/kvsp#"

// MediaTypeProblem is the media type of problem details (RFC 9457, A-7).
const MediaTypeProblem = "application/problem+json"

// kindError is a sentinel error of this package. Sentinels carry the
// package prefix in their text, like "etcdserver: no leader".
type kindError struct{ msg string }

func (e *kindError) Error() string { return e.msg }

// The KVSP problem types (section "Error Handling", table "KVSP Problem
// Types"). Handlers return errors that wrap these; [ProblemFor] maps them to
// the wire, and a client decodes a problem back to the same sentinel.
var (
	ErrNotFound          error = &kindError{"kvsp: not found"}            // kvsp-not-found, 404
	ErrScopeDenied       error = &kindError{"kvsp: scope denied"}         // kvsp-scope-denied, 403
	ErrIncompatible      error = &kindError{"kvsp: incompatible"}         // kvsp-incompatible, 409
	ErrLeaseQuota        error = &kindError{"kvsp: lease quota exceeded"} // kvsp-lease-quota, 429
	ErrStaleEpoch        error = &kindError{"kvsp: stale epoch"}          // kvsp-stale-epoch, 409
	ErrInvalidState      error = &kindError{"kvsp: invalid state"}        // kvsp-invalid-state, 409
	ErrDigestMismatch    error = &kindError{"kvsp: digest mismatch"}      // kvsp-digest-mismatch, 422
	ErrPlanConflict      error = &kindError{"kvsp: plan conflict"}        // kvsp-plan-conflict, 409
	ErrLayersUnavailable error = &kindError{"kvsp: layers unavailable"}   // kvsp-layers-unavailable, 404
)

// Errors without a KVSP problem type. They travel as "about:blank" problems
// whose status carries the meaning (RFC 9457 section 4.2.1).
var (
	ErrInvalid              error = &kindError{"kvsp: invalid request"}        // 400
	ErrForbidden            error = &kindError{"kvsp: forbidden"}              // 403, a role failure
	ErrMethodNotAllowed     error = &kindError{"kvsp: method not allowed"}     // 405
	ErrConflict             error = &kindError{"kvsp: conflict"}               // 409 without a KVSP type
	ErrRequestTimeout       error = &kindError{"kvsp: request timeout"}        // 408 (a body below the minimum rate, B8)
	ErrPreconditionFailed   error = &kindError{"kvsp: precondition failed"}    // 412 (R-BLK-14)
	ErrTooLarge             error = &kindError{"kvsp: content too large"}      // 413
	ErrUnsupportedMediaType error = &kindError{"kvsp: unsupported media type"} // 415
	ErrPreconditionRequired error = &kindError{"kvsp: precondition required"}  // 428
	ErrTooManyRequests      error = &kindError{"kvsp: too many requests"}      // 429
	ErrInternal             error = &kindError{"kvsp: internal error"}         // 500 (a handler's bug, logged)
	ErrUnavailable          error = &kindError{"kvsp: service unavailable"}    // 503
	ErrSecret               error = &kindError{"kvsp: refusing to encode a secret"}
)

// ProblemType is one row of the mapping between an error and the wire.
type ProblemType struct {
	Err    error  // the sentinel
	Suffix string // the KVSP type suffix; empty for "about:blank"
	Status int    // the HTTP status
	Title  string // the RFC 9457 title
}

// URI returns the problem type URI: ProblemTypeBase+Suffix, or
// "about:blank" for the generic rows.
func (t ProblemType) URI() string {
	if t.Suffix == "" {
		return "about:blank"
	}
	return ProblemTypeBase + t.Suffix
}

// ProblemTypes is the one table that maps errors to problem types and
// statuses (R-ERR-1..11). Order matters only for errors that wrap several
// sentinels: the first match wins.
var ProblemTypes = []ProblemType{
	{ErrNotFound, "kvsp-not-found", 404, "Block, lease, session, or directive unknown"},
	{ErrScopeDenied, "kvsp-scope-denied", 403, "Client not authorized for the scope"},
	{ErrIncompatible, "kvsp-incompatible", 409, "Compatibility ID mismatch"},
	{ErrLeaseQuota, "kvsp-lease-quota", 429, "Lease quota exceeded"},
	{ErrStaleEpoch, "kvsp-stale-epoch", 409, "Epoch older than current"},
	{ErrInvalidState, "kvsp-invalid-state", 409, "Operation not allowed in the instance state"},
	{ErrDigestMismatch, "kvsp-digest-mismatch", 422, "Stored data does not match its digest"},
	{ErrPlanConflict, "kvsp-plan-conflict", 409, "Reshard plan does not match the current map version"},
	{ErrLayersUnavailable, "kvsp-layers-unavailable", 404, "Requested layers not held"},

	{ErrInvalid, "", 400, "Bad Request"},
	{ErrForbidden, "", 403, "Forbidden"},
	{ErrMethodNotAllowed, "", 405, "Method Not Allowed"},
	{ErrConflict, "", 409, "Conflict"},
	{ErrRequestTimeout, "", 408, "Request Timeout"},
	{ErrPreconditionFailed, "", 412, "Precondition Failed"},
	{ErrTooLarge, "", 413, "Content Too Large"},
	{ErrUnsupportedMediaType, "", 415, "Unsupported Media Type"},
	{ErrPreconditionRequired, "", 428, "Precondition Required"},
	{ErrTooManyRequests, "", 429, "Too Many Requests"},
	{ErrInternal, "", 500, "Internal Server Error"},
	{ErrUnavailable, "", 503, "Service Unavailable"},
}

// Problem is an RFC 9457 problem details object. It is also an error: a
// client that decodes one returns it, and errors.Is(p, ErrStaleEpoch) holds
// for a problem of type kvsp-stale-epoch. A handler that needs extension
// members (A-12 "epoch", A-27 "max_block_keys") returns a *Problem built with
// [NewProblem].
type Problem struct {
	Type     string `json:"type"`
	Title    string `json:"title,omitempty"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"`
	// Extensions holds the extension members, inlined on the wire.
	Extensions map[string]any `json:",embed"`

	kind error // the sentinel, set by NewProblem or resolved from Type/Status
}

// NewProblem returns the problem for kind (a sentinel of this package) with
// the given detail. The detail is sent to the peer: it must never contain
// KV bytes, tokens or keys.
func NewProblem(kind error, detail string) *Problem {
	t := problemTypeOf(kind)
	return &Problem{Type: t.URI(), Title: t.Title, Status: t.Status, Detail: detail, kind: t.Err}
}

// With sets an extension member and returns p.
func (p *Problem) With(name string, value any) *Problem {
	if p.Extensions == nil {
		p.Extensions = make(map[string]any)
	}
	p.Extensions[name] = value
	return p
}

func (p *Problem) Error() string {
	var b strings.Builder
	b.WriteString("kvsp: problem ")
	if p.Type != "about:blank" && p.Type != "" {
		b.WriteString(strings.TrimPrefix(p.Type, ProblemTypeBase))
		b.WriteString(" ")
	}
	fmt.Fprintf(&b, "(status %d)", p.Status)
	if p.Detail != "" {
		b.WriteString(": ")
		b.WriteString(p.Detail)
	}
	return b.String()
}

// Unwrap returns the sentinel this problem stands for, so that errors.Is
// works on decoded problems. Unknown KVSP types and "about:blank" resolve by
// status, and statuses this package does not list by class (R-HTTP-9).
func (p *Problem) Unwrap() error {
	if p.kind != nil {
		return p.kind
	}
	if strings.HasPrefix(p.Type, ProblemTypeBase) {
		suffix := p.Type[len(ProblemTypeBase):]
		for _, t := range ProblemTypes {
			if t.Suffix != "" && t.Suffix == suffix {
				return t.Err
			}
		}
	}
	for _, t := range ProblemTypes {
		if t.Suffix == "" && t.Status == p.Status {
			return t.Err
		}
	}
	switch {
	case p.Status == 404:
		return ErrNotFound // a miss, whatever the type (R-IS-10, A-28)
	case p.Status >= 400 && p.Status < 500:
		return ErrInvalid
	case p.Status >= 500:
		return ErrUnavailable
	}
	return nil
}

// problemTypeOf resolves err through the table with errors.Is; errors that
// match no row are internal errors (500, no detail on the wire).
func problemTypeOf(err error) ProblemType {
	for _, t := range ProblemTypes {
		if errors.Is(err, t.Err) {
			return t
		}
	}
	return ProblemType{Status: 500, Title: "Internal Server Error"}
}

// ProblemFor maps an error returned by a handler to the problem to send.
// A *Problem in the chain is sent as it is. Otherwise the first sentinel of
// [ProblemTypes] that err wraps decides type and status, and err's text is
// the detail: errors of this project never carry secrets or KV bytes.
// Errors that wrap no sentinel become a 500 whose detail is withheld.
func ProblemFor(err error) *Problem {
	var p *Problem
	if errors.As(err, &p) {
		q := *p
		if q.Status == 0 {
			q.Status = 500
		}
		if q.Type == "" {
			q.Type = "about:blank"
		}
		return &q
	}
	t := problemTypeOf(err)
	q := &Problem{Type: t.URI(), Title: t.Title, Status: t.Status, kind: t.Err}
	if t.Err != nil {
		q.Detail = err.Error()
	}
	return q
}

// MarshalProblem encodes p as RFC 9457 JSON.
func MarshalProblem(p *Problem) ([]byte, error) {
	return json.Marshal(p, json.Deterministic(true))
}

// ParseProblem decodes an application/problem+json body. Clients accept it
// with either problem+json or kvsp+json. A body that is not a problem
// object, or whose status disagrees with the HTTP status, is an error.
func ParseProblem(body []byte, httpStatus int) (*Problem, error) {
	var p Problem
	if err := json.Unmarshal(body, &p, decodeOptions); err != nil {
		return nil, fmt.Errorf("%w: problem details: %v", ErrInvalid, err)
	}
	if p.Type == "" {
		p.Type = "about:blank" // RFC 9457 section 3.1.1
	}
	if p.Status == 0 {
		p.Status = httpStatus
	}
	if httpStatus != 0 && p.Status != httpStatus {
		return nil, fmt.Errorf("%w: problem status %d differs from HTTP status %d", ErrInvalid, p.Status, httpStatus)
	}
	return &p, nil
}

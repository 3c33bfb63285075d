package kvsp_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
)

// TestProblemTable: every KVSP problem type of the spec, its status, and
// the round trip error -> problem+json -> error (R-ERR-1..11, A-7).
func TestProblemTable(t *testing.T) {
	spec := []struct {
		err    error
		suffix string
		status int
	}{ // the table of section "Error Handling", transcribed
		{kvsp.ErrNotFound, "kvsp-not-found", 404},
		{kvsp.ErrScopeDenied, "kvsp-scope-denied", 403},
		{kvsp.ErrIncompatible, "kvsp-incompatible", 409},
		{kvsp.ErrLeaseQuota, "kvsp-lease-quota", 429},
		{kvsp.ErrStaleEpoch, "kvsp-stale-epoch", 409},
		{kvsp.ErrInvalidState, "kvsp-invalid-state", 409},
		{kvsp.ErrDigestMismatch, "kvsp-digest-mismatch", 422},
		{kvsp.ErrPlanConflict, "kvsp-plan-conflict", 409},
		{kvsp.ErrLayersUnavailable, "kvsp-layers-unavailable", 404},
	}
	for _, s := range spec {
		wrapped := fmt.Errorf("holder: lease for block 3: %w", s.err)
		p := kvsp.ProblemFor(wrapped)
		if p.Type != "https://iana.org/assignments/kvsp#"+s.suffix || p.Status != s.status || p.Title == "" {
			t.Errorf("%v -> %+v", s.err, p)
		}
		body, err := kvsp.MarshalProblem(p)
		if err != nil {
			t.Fatal(err)
		}
		back, err := kvsp.ParseProblem(body, s.status)
		if err != nil {
			t.Fatal(err)
		}
		if !errors.Is(back, s.err) {
			t.Errorf("decoded %s is not %v", body, s.err)
		}
		for _, other := range spec {
			if other.err != s.err && errors.Is(back, other.err) {
				t.Errorf("decoded %s also matches %v", s.suffix, other.err)
			}
		}
	}
	for err, status := range map[error]int{
		kvsp.ErrInvalid: 400, kvsp.ErrForbidden: 403, kvsp.ErrTooLarge: 413, kvsp.ErrUnsupportedMediaType: 415,
		kvsp.ErrPreconditionRequired: 428, kvsp.ErrPreconditionFailed: 412, kvsp.ErrTooManyRequests: 429,
	} {
		p := kvsp.ProblemFor(err)
		if p.Type != "about:blank" || p.Status != status {
			t.Errorf("%v -> %s %d", err, p.Type, p.Status)
		}
		body, _ := kvsp.MarshalProblem(p)
		if back, _ := kvsp.ParseProblem(body, status); !errors.Is(back, err) {
			t.Errorf("about:blank %d does not decode to %v", status, err)
		}
	}
}

// TestProblemDetails: internal errors are 500 without detail; extension
// members travel; unlisted statuses map by class (R-HTTP-9).
func TestProblemDetails(t *testing.T) {
	p := kvsp.ProblemFor(errors.New("open /var/lib/kvsp/secret: permission denied"))
	if p.Status != 500 || p.Detail != "" {
		t.Errorf("internal error leaked: %+v", p)
	}
	stale := kvsp.NewProblem(kvsp.ErrStaleEpoch, "epoch 11 is below 12").With("epoch", 12)
	body, _ := kvsp.MarshalProblem(kvsp.ProblemFor(fmt.Errorf("status: %w", stale)))
	if !strings.Contains(string(body), `"epoch":12`) || !strings.Contains(string(body), `"status":409`) || strings.Contains(string(body), "Extensions") {
		t.Errorf("extension lost: %s", body)
	}
	back, err := kvsp.ParseProblem(body, 409)
	if err != nil || !errors.Is(back, kvsp.ErrStaleEpoch) || back.Extensions["epoch"] != float64(12) {
		t.Errorf("decoded %+v, %v", back, err)
	}
	for status, want := range map[int]error{418: kvsp.ErrInvalid, 599: kvsp.ErrUnavailable, 404: kvsp.ErrNotFound} {
		b := fmt.Sprintf(`{"type":"about:blank","status":%d}`, status)
		if p, err := kvsp.ParseProblem([]byte(b), status); err != nil || !errors.Is(p, want) {
			t.Errorf("status %d -> %v, %v", status, p, err)
		}
	}
	if p, err := kvsp.ParseProblem([]byte(`{"type":"https://iana.org/assignments/kvsp#kvsp-future","status":409}`), 409); err != nil || !errors.Is(p, kvsp.ErrConflict) {
		t.Errorf("unknown KVSP type -> %v, %v", p, err)
	}
	if _, err := kvsp.ParseProblem([]byte(`{"status":404}`), 500); err == nil {
		t.Error("status mismatch accepted")
	}
	if _, err := kvsp.ParseProblem([]byte(`<html>`), 502); err == nil {
		t.Error("non-JSON problem accepted")
	}
}

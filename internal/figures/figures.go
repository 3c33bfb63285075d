// Package figures is how a reliability row's test tells the nightly
// report (make nightly, internal/nightly) what its run did: the faults it
// injected, the bad inputs it tried, the requests it made under load and
// what held, as one log line the report reads back from the test's -v
// output. A row logs its figures after its checks, so a failed row's
// figures never read as held.
package figures

import (
	"encoding/json"
	"strings"
)

// Prefix starts the log line that carries a row's figures.
const Prefix = "kvsp-figures "

// Row is one run of a row's test.
type Row struct {
	// Row is the plan's id (B6, F2, DS1...), or "chaos" for the process
	// chaos test.
	Row string `json:"row"`
	// Faults counts the faults the run injected: kills, crashes,
	// evictions forced, rotations, partitions, lossy periods.
	Faults int64 `json:"faults,omitempty"`
	// Inputs counts the bad or hostile inputs it tried: malformed
	// octets, hostile connections, reset streams, samples searched.
	Inputs int64 `json:"inputs,omitempty"`
	// Requests counts the requests (or operations) it made under load.
	Requests int64 `json:"requests,omitempty"`
	// Held says, in one sentence with its figures, what held.
	Held string `json:"held"`
	// Detail holds the run's other named figures.
	Detail map[string]float64 `json:"detail,omitempty"`
}

// Logger is what Report needs of a *testing.T (kept an interface so the
// package imports no testing and any test may use it).
type Logger interface {
	Helper()
	Failed() bool
	Logf(format string, args ...any)
}

// Report logs r as the line the nightly report reads, unless the test has
// failed already (the report also drops the figures of a test that fails
// after them).
func Report(t Logger, r Row) {
	t.Helper()
	if t.Failed() {
		return
	}
	b, err := json.Marshal(r)
	if err != nil { // a Detail of NaN or Inf
		t.Logf("figures: %v", err)
		return
	}
	t.Logf("%s%s", Prefix, b)
}

// Parse reads back the figures of a log line; ok is false for any other
// line.
func Parse(line string) (r Row, ok bool) {
	i := strings.Index(line, Prefix)
	if i < 0 {
		return Row{}, false
	}
	if err := json.Unmarshal([]byte(line[i+len(Prefix):]), &r); err != nil || r.Row == "" {
		return Row{}, false
	}
	return r, true
}

package main

import (
	"bufio"
	"cmp"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvsp/kvsp/internal/figures"
)

// Stage is one target's run (chaos, soak or sim) read from its go test -v
// log.
type Stage struct {
	Name    string `json:"name"`
	Command string `json:"command,omitempty"`
	// Status is the exit status of the stage's go test commands; a stage
	// with a non-zero status failed even where its log names no test.
	Status  int     `json:"status"`
	OK      bool    `json:"ok"`
	Seconds float64 `json:"seconds"`
	Took    string  `json:"took"`
	// Tests counts the tests and subtests that passed.
	Tests int `json:"tests"`
	// Rows are the plan's rows the stage ran, in the plan's order.
	Rows []*Row `json:"rows"`
	// Failed names what failed: rows with their tests, and packages that
	// failed without a failing test (a build failure, a panic, a timeout).
	Failed   []string `json:"failed,omitempty"`
	Faults   int64    `json:"faults"`
	Inputs   int64    `json:"inputs"`
	Requests int64    `json:"requests"`

	failedPkgs []string
}

// Row is a row's tests in one stage.
type Row struct {
	Row     string   `json:"row"`
	Tests   []string `json:"tests"`
	Runs    int      `json:"runs"`
	Passed  bool     `json:"passed"`
	Seconds float64  `json:"seconds"`
	// Figures are what the row's runs logged (internal/figures); they
	// count only where the row passed.
	Figures []figures.Row `json:"figures,omitempty"`

	failed []string
}

var (
	// A top-level test of a row: TestB6_..., TestDS1_...; the process
	// chaos test is the row "chaos".
	rowTest = regexp.MustCompile(`^Test(B|S|F|L|DS)([0-9]+)_`)
	result  = regexp.MustCompile(`^(\s*)--- (PASS|FAIL|SKIP): (\S+) \(([0-9.]+)s\)`)
	pkgLine = regexp.MustCompile(`^(ok|FAIL)\s+(\S+)(\s+\[[^\]]+\])?`)
)

func rowOf(test string) string {
	if m := rowTest.FindStringSubmatch(test); m != nil {
		return m[1] + m[2]
	}
	switch test {
	case "TestChaosSessionsSurviveRandomKills":
		return "chaos"
	case "TestLongWorkloadHoldsSharing": // make long: sharing over a longer workload (issue 47)
		return "long"
	case "TestAPIFuzz": // make api-fuzz: schemathesis against api/openapi.yaml (issue 52), its pytest run as one test
		return "api-fuzz"
	}
	return ""
}

// parse reads a go test -v log (several go test commands may append to
// one).
func (s *Stage) parse(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	var figs []figures.Row
	failing := 0 // failing tests since the last package line
	for sc.Scan() {
		line := sc.Text()
		if f, ok := figures.Parse(line); ok {
			figs = append(figs, f)
			continue
		}
		if m := result.FindStringSubmatch(line); m != nil {
			top := m[1] == ""
			name, verdict := m[3], m[2]
			secs, _ := strconv.ParseFloat(m[4], 64)
			switch verdict {
			case "PASS":
				s.Tests++
			case "FAIL":
				failing++
			}
			if !top {
				continue
			}
			id := rowOf(name)
			if id == "" {
				if verdict == "FAIL" {
					s.Failed = append(s.Failed, name)
				}
				continue
			}
			row := s.row(id)
			if !slices.Contains(row.Tests, name) {
				row.Tests = append(row.Tests, name)
			}
			row.Runs++
			row.Seconds += secs
			if verdict == "FAIL" {
				row.failed = append(row.failed, name)
			}
			continue
		}
		if m := pkgLine.FindStringSubmatch(line); m != nil {
			// A package that failed with no failing test: a build
			// failure, a panic outside a test, a timeout.
			if m[1] == "FAIL" && failing == 0 {
				s.failedPkgs = append(s.failedPkgs, strings.TrimSpace(m[2]+m[3]))
			}
			failing = 0
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	for _, f := range figs {
		row := s.row(f.Row)
		row.Figures = append(row.Figures, f)
	}
	return nil
}

func (s *Stage) row(id string) *Row {
	for _, r := range s.Rows {
		if r.Row == id {
			return r
		}
	}
	r := &Row{Row: id}
	s.Rows = append(s.Rows, r)
	return r
}

func (s *Stage) setTime(d time.Duration) {
	s.Seconds = d.Round(time.Second).Seconds()
	s.Took = d.Round(time.Second).String()
}

// finish decides the stage: every row that ran passed (a figures line
// without a test run is not a row run), no package failed, status 0.
func (s *Stage) finish() {
	slices.SortFunc(s.Rows, func(a, b *Row) int { return cmp.Compare(rowOrder(a.Row), rowOrder(b.Row)) })
	s.Rows = slices.DeleteFunc(s.Rows, func(r *Row) bool { return r.Runs == 0 })
	var failedRows []string
	for _, r := range s.Rows {
		r.Passed = len(r.failed) == 0
		if !r.Passed {
			r.Figures = nil
			failedRows = append(failedRows, fmt.Sprintf("%s (%s)", r.Row, strings.Join(r.failed, ", ")))
			continue
		}
		for _, f := range r.Figures {
			s.Faults += f.Faults
			s.Inputs += f.Inputs
			s.Requests += f.Requests
		}
	}
	// Packages whose failure no failing test explains.
	var pkgs []string
	for _, p := range s.failedPkgs {
		pkgs = append(pkgs, "package "+p)
	}
	s.Failed = append(append(failedRows, s.Failed...), pkgs...)
	if s.Status != 0 && len(s.Failed) == 0 {
		s.Failed = []string{fmt.Sprintf("go test exited %d with no failing test or package in the log", s.Status)}
	}
	if len(s.Rows) == 0 && len(s.Failed) == 0 {
		s.Failed = []string{"no row ran"}
	}
	s.OK = len(s.Failed) == 0
}

// rowOrder is the plan's order: B, S, F, L, DS, then the process chaos
// test and the longer workload.
func rowOrder(id string) int {
	switch id {
	case "chaos":
		return 1 << 20
	case "long":
		return 1<<20 + 1
	case "api-fuzz":
		return 1<<20 + 2
	}
	i := strings.IndexAny(id, "0123456789")
	if i < 0 {
		return 1 << 21
	}
	n, _ := strconv.Atoi(id[i:])
	return strings.Index("B S F L DS", id[:i])*1000 + n
}

// Verdict is the stage's last line.
func (s *Stage) Verdict() string {
	if !s.OK {
		return fmt.Sprintf("%s: FAILED: %s", s.Name, strings.Join(s.Failed, "; "))
	}
	return fmt.Sprintf("%s: ok: %d rows (%s), %d tests passed%s", s.Name, len(s.Rows), s.rowList(), s.Tests, s.tookSuffix())
}

func (s *Stage) rowList() string {
	ids := make([]string, len(s.Rows))
	for i, r := range s.Rows {
		ids[i] = r.Row
	}
	return strings.Join(ids, " ")
}

func (s *Stage) tookSuffix() string {
	if s.Took == "" {
		return ""
	}
	return " in " + s.Took
}

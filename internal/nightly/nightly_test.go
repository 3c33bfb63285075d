package main

import (
	"strings"
	"testing"
)

// A chaos log as make chaos writes it: two packages' -v output, one with
// a failing row whose figures were logged before it failed, one package
// that panicked outside a test, and the process chaos test's runs.
const chaosLog = `=== RUN   TestB6_SlowlorisAndSlowReaders
    server_test.go:707: kvsp-figures {"row":"B6","inputs":240,"held":"240 hostile connections closed"}
--- PASS: TestB6_SlowlorisAndSlowReaders (6.22s)
=== RUN   TestB7_HTTP2RapidResetAndContinuationFlood
=== RUN   TestB7_HTTP2RapidResetAndContinuationFlood/rapid_reset
        h2flood_test.go:240: kvsp-figures {"row":"B7","inputs":10000,"held":"10000 streams reset"}
    --- PASS: TestB7_HTTP2RapidResetAndContinuationFlood/rapid_reset (1.00s)
--- PASS: TestB7_HTTP2RapidResetAndContinuationFlood (1.20s)
PASS
ok  	github.com/kvsp/kvsp/server	9.799s
=== RUN   TestF2_EvictionRacingLeases
    reliability_test.go:547: kvsp-figures {"row":"F2","faults":150,"requests":311,"held":"no leased block evicted"}
    reliability_test.go:560: the IS lists a withdrawn block
--- FAIL: TestF2_EvictionRacingLeases (300.10s)
=== RUN   TestS5_CrossScopeIsolationPaired
--- PASS: TestS5_CrossScopeIsolationPaired (0.50s)
FAIL
FAIL	github.com/kvsp/kvsp/holder	301.2s
panic: runtime error: index out of range
FAIL	github.com/kvsp/kvsp/tier	0.2s
FAIL	github.com/kvsp/kvsp/rdma [build failed]
=== RUN   TestChaosSessionsSurviveRandomKills
    session_test.go:617: kvsp-figures {"row":"chaos","faults":4,"requests":6,"held":"4 kills"}
--- PASS: TestChaosSessionsSurviveRandomKills (12.00s)
=== RUN   TestChaosSessionsSurviveRandomKills
    session_test.go:617: kvsp-figures {"row":"chaos","faults":3,"requests":6,"held":"3 kills"}
--- PASS: TestChaosSessionsSurviveRandomKills (11.00s)
ok  	github.com/kvsp/kvsp/cmd/kvsp	23.1s
`

func parseLog(t *testing.T, name, log string, status int) *Stage {
	t.Helper()
	s := &Stage{Name: name, Status: status}
	if err := s.parse(strings.NewReader(log)); err != nil {
		t.Fatal(err)
	}
	s.finish()
	return s
}

// TestStageVerdict: a failed row is named with its test in the last line,
// its figures are not counted; packages that failed without a failing
// test are named; passed rows' figures are summed, the process chaos
// test's runs counted.
func TestStageVerdict(t *testing.T) {
	s := parseLog(t, "chaos", chaosLog, 1)
	if s.OK {
		t.Fatal("a stage with a failed row passed")
	}
	want := "chaos: FAILED: F2 (TestF2_EvictionRacingLeases); package github.com/kvsp/kvsp/tier; package github.com/kvsp/kvsp/rdma [build failed]"
	if got := s.Verdict(); got != want {
		t.Errorf("verdict\n got %s\nwant %s", got, want)
	}
	if s.Faults != 7 || s.Inputs != 10240 || s.Requests != 12 {
		t.Errorf("faults %d inputs %d requests %d: want 7 (the chaos runs' kills, not F2's), 10240, 12", s.Faults, s.Inputs, s.Requests)
	}
	var ids []string
	for _, r := range s.Rows {
		ids = append(ids, r.Row)
	}
	if got := strings.Join(ids, " "); got != "B6 B7 S5 F2 chaos" {
		t.Errorf("rows %q, want in the plan's order", got)
	}
	if s.Tests != 6 {
		t.Errorf("%d tests passed, want 6", s.Tests)
	}
	if r := s.Rows[4]; r.Runs != 2 || !r.Passed {
		t.Errorf("the process chaos test: %+v", r)
	}

	// The same log with the failures taken out passes, and says so.
	var ok []string
	for _, line := range strings.Split(chaosLog, "\n") {
		if strings.HasPrefix(line, "FAIL") || strings.HasPrefix(line, "panic") || strings.Contains(line, "withdrawn") {
			continue
		}
		ok = append(ok, strings.Replace(line, "--- FAIL", "--- PASS", 1))
	}
	s = parseLog(t, "chaos", strings.Join(ok, "\n"), 0)
	if !s.OK || !strings.HasPrefix(s.Verdict(), "chaos: ok: 5 rows (B6 B7 S5 F2 chaos), 7 tests passed") || s.Faults != 157 {
		t.Errorf("a passing stage: %s", s.Verdict())
	}
	// A non-zero status with nothing in the log still fails.
	if s = parseLog(t, "sim", strings.Join(ok, "\n"), 2); s.OK || !strings.Contains(s.Verdict(), "exited 2") {
		t.Errorf("status 2: %s", s.Verdict())
	}
	if s = parseLog(t, "soak", "", 0); s.OK || !strings.Contains(s.Verdict(), "no row ran") {
		t.Errorf("an empty log: %s", s.Verdict())
	}
}

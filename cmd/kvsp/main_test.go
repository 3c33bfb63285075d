package main

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

// TestMain doubles as the kvsp binary: with KVSP_TEST_ARGS set, the test
// executable runs that command line, so tests can start real kvsp
// subprocesses and kill them. With KVSP_TEST_PEAK set too, it then prints
// its peak RSS (see peakLine).
func TestMain(m *testing.M) {
	if args := os.Getenv("KVSP_TEST_ARGS"); args != "" {
		code := run(strings.Split(args, "\x1f"), os.Stdout, os.Stderr)
		if os.Getenv("KVSP_TEST_PEAK") != "" {
			fmt.Fprintln(os.Stderr, peakLine())
		}
		os.Exit(code)
	}
	goleak.VerifyTestMain(m)
}

// peakLine is the VmHWM line of /proc/self/status: the peak RSS of this
// process's own image. The parent's rusage of it (Maxrss) cannot say it:
// os/exec starts a child with vfork, so the child's peak counts the
// parent's RSS at the start, the test's files included.
func peakLine() string {
	b, _ := os.ReadFile("/proc/self/status")
	for l := range bytes.Lines(b) {
		if bytes.HasPrefix(l, []byte("VmHWM:")) {
			return string(bytes.TrimSpace(l))
		}
	}
	return "VmHWM: unknown"
}

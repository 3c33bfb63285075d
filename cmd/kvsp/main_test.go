package main

import (
	"os"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

// TestMain doubles as the kvsp binary: with KVSP_TEST_ARGS set, the test
// executable runs that command line, so tests can start real kvsp
// subprocesses and kill them.
func TestMain(m *testing.M) {
	if args := os.Getenv("KVSP_TEST_ARGS"); args != "" {
		os.Exit(run(strings.Split(args, "\x1f"), os.Stdout, os.Stderr))
	}
	goleak.VerifyTestMain(m)
}

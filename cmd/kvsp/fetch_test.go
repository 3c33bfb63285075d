package main

import (
	"strings"
	"testing"
)

// TestFetchRefusesBadArguments: kvsp fetch names what is wrong with its
// arguments before any connection (usage errors, status 2). A fetch that
// works is tested from Python (python/tests/test_attach.py), where its
// octets equal the Python client's and the engine's pages'.
func TestFetchRefusesBadArguments(t *testing.T) {
	cred := []string{"fetch", "--cert", "c.pem", "--key", "c.key", "--ca", "ca.pem", "--descriptor", "d.json"}
	const ok = "https://127.0.0.1:1/h1/blocks/5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f/" +
		"c013e351f520ddf8ddc32e5fdddba4f4/ab00000000000000000000000000000000000000000000000000000000000001"
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"fetch", ok}, "fetch takes --cert"},
		{append(cred, "x"), "want https://HOST/BASE/blocks/COMPAT/SCOPE/KEY"},
		{append(cred, "http://x/h1/blocks/a/b/c"), "want https://HOST/BASE/blocks/COMPAT/SCOPE/KEY"},
		{append(cred, "https://x/h1/blocks/a/b"), "want https://HOST/BASE/blocks/COMPAT/SCOPE/KEY"},
		{append(cred, strings.Replace(ok, "5ed5", "5ED5", 1)), "compat"},
		{append(cred, "--layers", "5-3", ok), "--layers \"5-3\""},
		{append(cred, "--layers", "x", ok), "--layers \"x\""},
	} {
		code, _, errs := runCLI(t, tc.args...)
		if code != 2 || !strings.Contains(errs, tc.want) {
			t.Errorf("%v: %d %q, want 2 and %q", tc.args[len(tc.args)-1], code, errs, tc.want)
		}
	}
}

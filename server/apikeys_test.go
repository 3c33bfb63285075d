package server

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"
)

// TestPolicyAPIKeys: a gateway's API keys are held as SHA-256 hashes; a
// presented key finds its entry (principal, scope, limits), an unknown one
// none; malformed entries are refused naming the field.
func TestPolicyAPIKeys(t *testing.T) {
	h := func(k string) string { s := sha256.Sum256([]byte(k)); return hex.EncodeToString(s[:]) }
	const scope = "00112233445566778899aabbccddeeff"
	p, err := ParsePolicy([]byte("principals: []\napi_keys:\n" +
		"  - {sha256: " + h("kvsp-alice") + ", principal: alice, scope: " + scope + ", max_concurrent: 2}\n" +
		"  - {sha256: " + h("kvsp-bob") + ", principal: bob, scope: " + scope + "}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if k := p.APIKey("kvsp-alice"); k == nil || k.Principal != "alice" || k.MaxConcurrent != 2 || k.ScopeID().String() != scope {
		t.Fatalf("alice's key: %+v", k)
	}
	for _, bad := range []string{"", "kvsp-eve", "kvsp-alice ", h("kvsp-alice")} {
		if p.APIKey(bad) != nil {
			t.Errorf("%q authenticated", bad)
		}
	}
	for _, tc := range []struct{ entry, field string }{
		{"{sha256: " + strings.ToUpper(h("a")) + ", principal: a, scope: " + scope + "}", "sha256"},
		{"{sha256: abcd, principal: a, scope: " + scope + "}", "sha256"},
		{"{sha256: " + h("a") + ", scope: " + scope + "}", "principal"},
		{"{sha256: " + h("a") + ", principal: a, scope: nope}", "scope"},
		{"{sha256: " + h("a") + ", principal: a, scope: " + scope + ", max_concurrent: -1}", "limits"},
		{"{sha256: " + h("a") + ", principal: a, scope: " + scope + ", key: secret}", "key"},
	} {
		if _, err := ParsePolicy([]byte("api_keys:\n  - " + tc.entry + "\n")); err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: %v, want an error naming %s", tc.entry, err, tc.field)
		}
	}
	dup := "  - {sha256: " + h("a") + ", principal: a, scope: " + scope + "}\n"
	if _, err := ParsePolicy([]byte("api_keys:\n" + dup + dup)); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("a key listed twice: %v", err)
	}
}

package kvsp_test

import (
	"bytes"
	"encoding/base64"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
)

// TestGrantSealOpen: a grant opens under its scope's key with every
// member as sealed; any octet changed, another scope's key, a truncation,
// a version or length off, or text that is not base64url is ErrGrant (403)
// and never a panic.
func TestGrantSealOpen(t *testing.T) {
	key := appendixScopeKey(t)
	g := kvsp.Grant{ID: kvsp.NewGrantID(), Session: kvsp.NewUUID(), Epoch: 3, ScopeID: key.ID(), CompatID: kvsp.CompatID{9},
		Prompt: [32]byte{1, 2, 3}, MaxTokens: 77, Instance: "https://ii1.example/kvsp/", InstanceEpoch: 1765000000000,
		Expires: time.UnixMilli(1765000012345)}
	s, err := g.Seal(key)
	if err != nil {
		t.Fatal(err)
	}
	if len(s) > kvsp.MaxGrantLen || strings.ContainsAny(s, "+/=") {
		t.Fatalf("wire form %q: not base64url, or past MaxGrantLen", s)
	}
	got, err := kvsp.OpenGrant(key, s)
	if err != nil || *got != g {
		t.Fatalf("round trip: %+v %v, want %+v", got, err, g)
	}
	raw, _ := base64.RawURLEncoding.DecodeString(s)
	for i := range raw {
		mut := bytes.Clone(raw)
		mut[i] ^= 0x10
		if _, err := kvsp.OpenGrant(key, base64.RawURLEncoding.EncodeToString(mut)); !errors.Is(err, kvsp.ErrGrant) {
			t.Fatalf("octet %d changed: %v, want ErrGrant", i, err)
		}
	}
	for i := range raw {
		if _, err := kvsp.OpenGrant(key, base64.RawURLEncoding.EncodeToString(raw[:i])); !errors.Is(err, kvsp.ErrGrant) {
			t.Fatalf("truncated to %d octets: %v", i, err)
		}
	}
	other, _ := kvsp.NewScopeKey(bytes.Repeat([]byte{0xee}, 32))
	if _, err := kvsp.OpenGrant(other, s); !errors.Is(err, kvsp.ErrGrant) {
		t.Fatalf("another scope's key: %v", err)
	}
	for _, bad := range []string{"", "!!!!", s + "A", strings.Repeat("A", kvsp.MaxGrantLen+1)} {
		if _, err := kvsp.OpenGrant(key, bad); !errors.Is(err, kvsp.ErrGrant) {
			t.Fatalf("%.20q: %v", bad, err)
		}
	}
	if !errors.Is(kvsp.ErrGrant, kvsp.ErrForbidden) {
		t.Fatal("ErrGrant is not a 403")
	}
	// Only the key of the grant's scope seals it.
	if _, err := g.Seal(other); !errors.Is(err, kvsp.ErrInvalid) {
		t.Fatalf("sealed with another scope's key: %v", err)
	}
}

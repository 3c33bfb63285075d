package kvsp_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	jsonv2 "github.com/go-json-experiment/json"

	"github.com/kvsp/kvsp"
)

// TestHexIdentifiers: only lowercase hex of the exact length (R-REC-3,
// R-CMP-15, R-KEY-9).
func TestHexIdentifiers(t *testing.T) {
	parse := map[string]func(string) error{
		"BlockKey": func(s string) error { _, err := kvsp.ParseBlockKey(s); return err },
		"CompatID": func(s string) error { _, err := kvsp.ParseCompatID(s); return err },
		"ScopeID":  func(s string) error { _, err := kvsp.ParseScopeID(s); return err },
		"Digest":   func(s string) error { _, err := kvsp.ParseDigest(s); return err },
		"UUID":     func(s string) error { _, err := kvsp.ParseUUID(s); return err },
	}
	good := map[string]string{
		"BlockKey": vecK0.value, "CompatID": vecCompatID.value, "ScopeID": vecScopeID.value,
		"Digest": "sha-256:" + vecK1.value, "UUID": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
	}
	for name, p := range parse {
		g := good[name]
		if err := p(g); err != nil {
			t.Errorf("%s(%q): %v", name, g, err)
		}
		for _, bad := range []string{"", strings.ToUpper(g), g[:len(g)-1], g + "0", "0x" + g[2:], strings.Replace(g, "a", "g", 1), " " + g[1:]} {
			if bad == g {
				continue
			}
			if err := p(bad); !errors.Is(err, kvsp.ErrInvalid) {
				t.Errorf("%s(%q) accepted", name, bad)
			}
		}
	}
	k, _ := kvsp.ParseBlockKey(vecK0.value)
	b, _ := kvsp.Marshal(struct {
		K kvsp.BlockKey `json:"k"`
		D kvsp.Digest   `json:"d"`
	}{k, kvsp.Digest(k)})
	if want := `{"k":"` + vecK0.value + `","d":"sha-256:` + vecK0.value + `"}`; string(b) != want {
		t.Errorf("marshal = %s, want %s", b, want)
	}
	if got := (kvsp.UUID{0x6f}).String(); got != "6f000000-0000-0000-0000-000000000000" {
		t.Errorf("UUID.String = %s", got)
	}
}

// TestScopeKeyNeverShown: a ScopeKey prints REDACTED under every verb and in
// slog, refuses JSON and text encoding, and is at least 32 octets (R-KEY-1,
// R-PRV-*).
func TestScopeKeyNeverShown(t *testing.T) {
	k := appendixScopeKey(t)
	secretHex := vecScopeKey.value
	type holder struct{ Key kvsp.ScopeKey }
	type hidden struct{ key kvsp.ScopeKey } // fmt cannot call Format through an unexported field
	var outs []string
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%x", "%X", "%q", "%d"} {
		outs = append(outs, fmt.Sprintf(verb, k), fmt.Sprintf(verb, holder{k}), fmt.Sprintf(verb, &k),
			fmt.Sprintf(verb, hidden{k}), fmt.Sprintf(verb, &hidden{k}), fmt.Sprintf(verb, []hidden{{k}}))
	}
	var logBuf bytes.Buffer
	slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("m", "key", k, "holder", holder{k})
	slog.New(slog.NewTextHandler(&logBuf, nil)).Info("m", "key", k, "hidden", hidden{k})
	slog.New(slog.NewJSONHandler(&logBuf, nil)).Info("m", "hidden", hidden{k})
	outs = append(outs, logBuf.String())
	for _, o := range outs {
		if strings.Contains(o, secretHex) || strings.Contains(o, "0102030405") || strings.Contains(o, "[0 1 2 3") ||
			strings.Contains(o, "1 2 3 4 5") || strings.Contains(o, "\x00\x01\x02") {
			t.Fatalf("scope key leaked: %s", o)
		}
	}
	if !strings.Contains(fmt.Sprint(k), "REDACTED") {
		t.Error("ScopeKey does not say REDACTED")
	}
	if _, err := json.Marshal(holder{k}); err == nil {
		t.Error("encoding/json marshalled a ScopeKey")
	}
	if _, err := jsonv2.Marshal(holder{k}); err == nil {
		t.Error("json v2 marshalled a ScopeKey")
	}
	if _, err := kvsp.Marshal(holder{k}); err == nil {
		t.Error("kvsp.Marshal marshalled a ScopeKey")
	}
	if _, err := kvsp.NewScopeKey(make([]byte, 31)); !errors.Is(err, kvsp.ErrInvalid) {
		t.Error("31-octet scope key accepted")
	}
	if _, err := kvsp.ParseScopeKey([]byte(secretHex[:62])); err == nil {
		t.Error("31-octet key file accepted")
	}
	if _, err := kvsp.ParseScopeKey([]byte(strings.ToUpper(secretHex))); err == nil {
		t.Error("uppercase key file accepted")
	}
	k2, _ := kvsp.ParseScopeKey(k.Export())
	if !k.Equal(k2) || k2.ID() != k.ID() {
		t.Error("Export/ParseScopeKey round trip failed")
	}
	g, err := kvsp.GenerateScopeKey()
	if err != nil || g.Equal(k) || !g.Valid() {
		t.Errorf("GenerateScopeKey: %v", err)
	}
}

// TestBaseURINormalisation covers decision A-6 and RFC 3986 6.2.2-6.2.3.
func TestBaseURINormalisation(t *testing.T) {
	for in, want := range map[string]string{
		"https://h1.example/kvsp/":          "https://h1.example/kvsp/",
		"HTTPS://H1.Example:443/kvsp/":      "https://h1.example/kvsp/",
		"https://h1.example:8443/kvsp/":     "https://h1.example:8443/kvsp/",
		"https://h1.example:/kvsp/":         "https://h1.example/kvsp/",
		"https://h1.example/a/./b/../kvsp/": "https://h1.example/a/kvsp/",
		"https://h1.example/%7ekvsp/%2f/":   "https://h1.example/~kvsp/%2F/",
		"https://h1.example":                "https://h1.example/",
		"https://[::1]:9443/kvsp/":          "https://[::1]:9443/kvsp/",
		"https://127.0.0.1:443/":            "https://127.0.0.1/",
		"moqt://relay.example/ns/":          "moqt://relay.example/ns/",
		"https://h1.example:0443/kvsp/":     "https://h1.example/kvsp/",
	} {
		got, err := kvsp.NormalizeBaseURI(in)
		if err != nil || got != want {
			t.Errorf("NormalizeBaseURI(%q) = %q, %v; want %q", in, got, err, want)
			continue
		}
		if again, _ := kvsp.NormalizeBaseURI(got); again != got {
			t.Errorf("not idempotent: %q -> %q", got, again)
		}
	}
	for _, bad := range []string{
		"http://h1.example/kvsp/", "https://h1.example/kvsp", "https://h1.example/kvsp/?a=b",
		"https://h1.example/kvsp/#x", "https://u:p@h1.example/kvsp/", "/kvsp/", "https:///kvsp/",
		"https://h1.example/%zz/", "https://hé.example/", "", "https://[fe80::1%25en0]/", "https://h:99999/",
	} {
		if _, err := kvsp.NormalizeBaseURI(bad); !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("NormalizeBaseURI(%q) accepted", bad)
		}
	}
	if err := kvsp.ValidateBaseURI("targets[]", "moqt://relay.example/ns/"); err == nil {
		t.Error("a moqt URI accepted where a role's https base URI is required")
	}
	if id := kvsp.ResourceID("https://h1.example/kvsp/"); len(id) != 43 || strings.ContainsAny(id, "+/=") {
		t.Errorf("ResourceID %q is not 43 base64url characters (R-HTTP-22)", id)
	}
}

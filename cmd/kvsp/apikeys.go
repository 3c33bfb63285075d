package main

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kvsp/kvsp"
)

// newAPIKey mints a gateway API key (192 random bits) and its SHA-256,
// the form the policy holds.
func newAPIKey() (key, hash string, err error) {
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", "", err
	}
	key = "kvsp-" + base64.RawURLEncoding.EncodeToString(b[:])
	h := sha256.Sum256([]byte(key))
	return key, hex.EncodeToString(h[:]), nil
}

// cmdAPIKey is `kvsp keys api`: mint a key, write it to a file of mode
// 0600 (never to the terminal's scrollback unless asked), and print the
// policy entry that admits it.
func cmdAPIKey(args []string, stdout io.Writer) error {
	fl := flag.NewFlagSet("keys api", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	principal := fl.String("principal", "", "who the key authenticates (metrics and logs name the principal, never the key)")
	scope := fl.String("scope", "", "the scope_id its requests run in")
	out := fl.String("out", "", "the file to write the key to (mode 0600; it must not exist)")
	if err := fl.Parse(args); err != nil || *principal == "" || *scope == "" || *out == "" || fl.NArg() != 0 {
		return usageError("keys api takes --principal NAME --scope SCOPE_ID --out FILE")
	}
	if _, err := kvsp.ParseScopeID(*scope); err != nil {
		return usageError("--scope: %v", err)
	}
	key, hash, err := newAPIKey()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(*out, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintln(f, key); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "# the key is in %s; add this entry to the policy's api_keys (kvsp reloads the policy on SIGHUP):\n"+
		"  - {sha256: %s, principal: %q, scope: %s}\n", *out, hash, *principal, *scope)
	return err
}

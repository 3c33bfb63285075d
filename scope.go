package kvsp

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"io"
	"log/slog"
)

// MinScopeKeyLen is the shortest Scope Key the spec allows: "at least 32
// random octets" (section "Scopes and Block Keys", R-KEY-1).
const MinScopeKeyLen = 32

const redacted = "kvsp.ScopeKey(REDACTED)"

// ScopeKey is the secret of a scope. It keys the Block Key chain and never
// leaves the principals of the scope: the IS never sees it (section "Privacy
// Considerations").
//
// A ScopeKey cannot be compared with == (use [ScopeKey.Equal], which is
// constant-time), prints as REDACTED under every fmt verb and in slog, and
// refuses to be marshalled as text or JSON. [ScopeKey.Export] is the one way
// to get its octets, for writing a key file.
type ScopeKey struct {
	_ [0]func() // not comparable: == on keys would not be constant-time
	// k returns the octets. A function, because fmt cannot call Format on
	// a ScopeKey reached through an unexported field and would print a
	// slice's or a pointer's contents there; of a func it prints only an
	// address.
	k func() []byte
}

func newKey(b []byte) ScopeKey { return ScopeKey{k: func() []byte { return b }} }

// NewScopeKey returns a ScopeKey holding a copy of b, which must be at least
// MinScopeKeyLen octets.
func NewScopeKey(b []byte) (ScopeKey, error) {
	if len(b) < MinScopeKeyLen {
		return ScopeKey{}, fmt.Errorf("%w: scope key: %d octets, at least %d required", ErrInvalid, len(b), MinScopeKeyLen)
	}
	return newKey(append([]byte(nil), b...)), nil
}

// GenerateScopeKey returns a new random 32-octet ScopeKey.
func GenerateScopeKey() (ScopeKey, error) {
	b := make([]byte, MinScopeKeyLen)
	if _, err := io.ReadFull(rand.Reader, b); err != nil {
		return ScopeKey{}, fmt.Errorf("kvsp: generating scope key: %w", err)
	}
	return newKey(b), nil
}

// ParseScopeKey parses the lowercase hex text of a key file, as written by
// Export, ignoring one trailing newline.
func ParseScopeKey(text []byte) (ScopeKey, error) {
	if n := len(text); n > 0 && text[n-1] == '\n' {
		text = text[:n-1]
	}
	if len(text)%2 != 0 || len(text) < 2*MinScopeKeyLen {
		return ScopeKey{}, fmt.Errorf("%w: scope key: want at least %d lowercase hex digits", ErrInvalid, 2*MinScopeKeyLen)
	}
	b := make([]byte, len(text)/2)
	if err := parseHex(b, text, "scope key"); err != nil {
		return ScopeKey{}, err
	}
	return newKey(b), nil
}

// Valid reports whether k holds a key (the zero ScopeKey does not).
func (k ScopeKey) Valid() bool { return len(k.octets()) >= MinScopeKeyLen }

func (k ScopeKey) octets() []byte {
	if k.k == nil {
		return nil
	}
	return k.k()
}

// ID returns the Scope ID: the first 16 octets of
// SHA-256("KVSP-SCOPE-1" || 0x00 || scope_key) (R-KEY-2).
func (k ScopeKey) ID() ScopeID {
	h := sha256.New()
	h.Write([]byte("KVSP-SCOPE-1\x00"))
	h.Write(k.octets())
	var sum [32]byte
	var id ScopeID
	copy(id[:], h.Sum(sum[:0]))
	return id
}

// Equal reports whether k and o are the same key, in constant time.
func (k ScopeKey) Equal(o ScopeKey) bool { return hmac.Equal(k.octets(), o.octets()) }

// Export returns the key as lowercase hex followed by a newline: the content
// of a key file. It is the only way to get the key's octets out; never log
// or send its result.
func (k ScopeKey) Export() []byte {
	return append(appendHex(nil, k.octets()), '\n')
}

// Format implements fmt.Formatter: every verb prints REDACTED.
func (k ScopeKey) Format(f fmt.State, verb rune) { io.WriteString(f, redacted) }

// String returns REDACTED, so that no formatting path reveals the key.
func (k ScopeKey) String() string { return redacted }

// GoString returns REDACTED.
func (k ScopeKey) GoString() string { return redacted }

// LogValue implements slog.LogValuer: the key is logged as REDACTED.
func (k ScopeKey) LogValue() slog.Value { return slog.StringValue(redacted) }

// MarshalText refuses: scope keys are never encoded on the wire.
func (k ScopeKey) MarshalText() ([]byte, error) { return nil, ErrSecret }

// MarshalJSON refuses: scope keys are never encoded on the wire.
func (k ScopeKey) MarshalJSON() ([]byte, error) { return nil, ErrSecret }

// ScopeKeyFromFile reads the content of a scope key file: the raw key
// octets (at least 32), unless the whole file is lowercase hex (optionally
// with one trailing newline), in which case it is hex-decoded.
func ScopeKeyFromFile(data []byte) (ScopeKey, error) {
	text := data
	if n := len(text); n > 0 && text[n-1] == '\n' {
		text = text[:n-1]
	}
	hexText := len(text) > 0 && len(text)%2 == 0
	for _, c := range text {
		if unhex[c] == 0xff {
			hexText = false
			break
		}
	}
	if hexText {
		return ParseScopeKey(text)
	}
	return NewScopeKey(data)
}

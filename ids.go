package kvsp

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
)

// Identifiers are distinct value types that marshal as lowercase hex of an
// exact length ("hex32", "hex16": section "Conventions and Definitions",
// R-REC-3). Uppercase, a "0x" prefix, or a wrong length fail at decode.

// BlockKey is a Block Key (section "Scopes and Block Keys"), carried as hex32.
type BlockKey [32]byte

// CompatID is a Compatibility ID (section "Compatibility Descriptor and
// Compatibility ID"), carried as hex32.
type CompatID [32]byte

// ScopeID identifies a scope without revealing its key (section "Scopes and
// Block Keys"), carried as hex16.
type ScopeID [16]byte

// LayerDigest is the SHA-256 of one layer's K section followed by its V
// section (section "KV Block Container"), carried as bare hex32 in a Replica
// Record's "layer_digests".
type LayerDigest [32]byte

// Digest is a SHA-256 value carried as "sha-256:" followed by hex32: the
// replica digest, model_digest, tokenizer_digest and adapter digests.
type Digest [32]byte

// DigestPrefix is the algorithm prefix of a [Digest] in text form.
const DigestPrefix = "sha-256:"

const hexdigits = "0123456789abcdef"

// unhex is the value of a lowercase hex digit, or 0xff.
var unhex = func() (t [256]byte) {
	for i := range t {
		t[i] = 0xff
	}
	for i := 0; i < 16; i++ {
		t[hexdigits[i]] = byte(i)
	}
	return t
}()

// parseHex decodes exactly 2*len(dst) lowercase hex digits into dst.
func parseHex(dst, src []byte, what string) error {
	if len(src) != 2*len(dst) {
		return fmt.Errorf("%w: %s: want %d lowercase hex digits, got %d characters", ErrInvalid, what, 2*len(dst), len(src))
	}
	for i := range dst {
		hi, lo := unhex[src[2*i]], unhex[src[2*i+1]]
		if hi|lo == 0xff {
			return fmt.Errorf("%w: %s: not lowercase hex", ErrInvalid, what)
		}
		dst[i] = hi<<4 | lo
	}
	return nil
}

// String returns the hex32 form.
func (k BlockKey) String() string { return hex.EncodeToString(k[:]) }

// IsZero reports whether k is all zero octets, which no HMAC output is in
// practice; records treat it as an absent member.
func (k BlockKey) IsZero() bool { return k == BlockKey{} }

// AppendText implements encoding.TextAppender.
func (k BlockKey) AppendText(b []byte) ([]byte, error) { return appendHex(b, k[:]), nil }

// MarshalText implements encoding.TextMarshaler.
func (k BlockKey) MarshalText() ([]byte, error) { return k.AppendText(make([]byte, 0, 64)) }

// UnmarshalText accepts only hex32.
func (k *BlockKey) UnmarshalText(b []byte) error { return parseHex(k[:], b, "block key") }

// ParseBlockKey parses hex32.
func ParseBlockKey(s string) (k BlockKey, err error) { err = k.UnmarshalText([]byte(s)); return }

// String returns the hex32 form.
func (c CompatID) String() string { return hex.EncodeToString(c[:]) }

// IsZero reports whether c is all zero octets (an absent member).
func (c CompatID) IsZero() bool { return c == CompatID{} }

// AppendText implements encoding.TextAppender.
func (c CompatID) AppendText(b []byte) ([]byte, error) { return appendHex(b, c[:]), nil }

// MarshalText implements encoding.TextMarshaler.
func (c CompatID) MarshalText() ([]byte, error) { return c.AppendText(make([]byte, 0, 64)) }

// UnmarshalText accepts only hex32.
func (c *CompatID) UnmarshalText(b []byte) error { return parseHex(c[:], b, "compat_id") }

// ParseCompatID parses hex32.
func ParseCompatID(s string) (c CompatID, err error) { err = c.UnmarshalText([]byte(s)); return }

// String returns the hex16 form.
func (s ScopeID) String() string { return hex.EncodeToString(s[:]) }

// IsZero reports whether s is all zero octets (an absent member).
func (s ScopeID) IsZero() bool { return s == ScopeID{} }

// AppendText implements encoding.TextAppender.
func (s ScopeID) AppendText(b []byte) ([]byte, error) { return appendHex(b, s[:]), nil }

// MarshalText implements encoding.TextMarshaler.
func (s ScopeID) MarshalText() ([]byte, error) { return s.AppendText(make([]byte, 0, 32)) }

// UnmarshalText accepts only hex16.
func (s *ScopeID) UnmarshalText(b []byte) error { return parseHex(s[:], b, "scope_id") }

// ParseScopeID parses hex16.
func ParseScopeID(str string) (s ScopeID, err error) { err = s.UnmarshalText([]byte(str)); return }

// String returns the bare hex32 form.
func (d LayerDigest) String() string { return hex.EncodeToString(d[:]) }

// IsZero reports whether d is all zero octets (an absent member).
func (d LayerDigest) IsZero() bool { return d == LayerDigest{} }

// AppendText implements encoding.TextAppender.
func (d LayerDigest) AppendText(b []byte) ([]byte, error) { return appendHex(b, d[:]), nil }

// MarshalText implements encoding.TextMarshaler.
func (d LayerDigest) MarshalText() ([]byte, error) { return d.AppendText(make([]byte, 0, 64)) }

// UnmarshalText accepts only bare hex32.
func (d *LayerDigest) UnmarshalText(b []byte) error { return parseHex(d[:], b, "layer digest") }

// String returns "sha-256:" followed by hex32.
func (d Digest) String() string { b, _ := d.AppendText(nil); return string(b) }

// IsZero reports whether d is all zero octets (an absent member).
func (d Digest) IsZero() bool { return d == Digest{} }

// AppendText implements encoding.TextAppender.
func (d Digest) AppendText(b []byte) ([]byte, error) {
	return appendHex(append(b, DigestPrefix...), d[:]), nil
}

// MarshalText implements encoding.TextMarshaler.
func (d Digest) MarshalText() ([]byte, error) { return d.AppendText(make([]byte, 0, 72)) }

// UnmarshalText accepts only "sha-256:" followed by lowercase hex32
// (R-REC-6, R-CMP-4).
func (d *Digest) UnmarshalText(b []byte) error {
	if len(b) < len(DigestPrefix) || string(b[:len(DigestPrefix)]) != DigestPrefix {
		return fmt.Errorf("%w: digest: want %q followed by hex32", ErrInvalid, DigestPrefix)
	}
	return parseHex(d[:], b[len(DigestPrefix):], "digest")
}

// ParseDigest parses "sha-256:<hex32>".
func ParseDigest(s string) (d Digest, err error) { err = d.UnmarshalText([]byte(s)); return }

// UUID is a session or directive identifier (R-REC-17, R-PF-1) in the
// canonical lowercase 8-4-4-4-12 form of RFC 9562.
type UUID [16]byte

// String returns the canonical lowercase form.
func (u UUID) String() string { b, _ := u.AppendText(nil); return string(b) }

// IsZero reports whether u is the nil UUID (an absent member).
func (u UUID) IsZero() bool { return u == UUID{} }

// AppendText implements encoding.TextAppender.
func (u UUID) AppendText(b []byte) ([]byte, error) {
	b = appendHex(b, u[0:4])
	b = appendHex(append(b, '-'), u[4:6])
	b = appendHex(append(b, '-'), u[6:8])
	b = appendHex(append(b, '-'), u[8:10])
	return appendHex(append(b, '-'), u[10:16]), nil
}

// MarshalText implements encoding.TextMarshaler.
func (u UUID) MarshalText() ([]byte, error) { return u.AppendText(make([]byte, 0, 36)) }

// UnmarshalText accepts only the canonical lowercase 36-character form.
func (u *UUID) UnmarshalText(b []byte) error {
	if len(b) != 36 || b[8] != '-' || b[13] != '-' || b[18] != '-' || b[23] != '-' {
		return fmt.Errorf("%w: uuid: want the lowercase 8-4-4-4-12 form", ErrInvalid)
	}
	var h [32]byte
	copy(h[0:8], b[0:8])
	copy(h[8:12], b[9:13])
	copy(h[12:16], b[14:18])
	copy(h[16:20], b[19:23])
	copy(h[20:32], b[24:36])
	return parseHex(u[:], h[:], "uuid")
}

// NewUUID returns a random (version 4) UUID.
func NewUUID() UUID {
	var u UUID
	rand.Read(u[:])
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // variant 10
	return u
}

// ParseUUID parses the canonical lowercase form.
func ParseUUID(s string) (u UUID, err error) { err = u.UnmarshalText([]byte(s)); return }

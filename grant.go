package kvsp

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"time"
)

// A placement grant is the PC's permission for one generation at one
// instance (kvsp's placement API; the spec leaves the inference API out of
// scope). The PC answers a place with one, the front end passes it on in
// its generate, and the instance runs nothing without a valid one: a
// request the PC did not place costs the instance no engine work
// (RELIABILITY S14; the red team's D4 sent prompts straight to instances,
// which evaluated 57,213 tokens for them).
//
// A grant is sealed with HMAC-SHA-256 under the scope key, over the label
// "KVSP-GRANT-1" || 0x00 and the grant's fields: the PC and the instances
// of a scope hold its key already (the PC to compute Block Keys, the
// instances to run the scope's requests), so nothing new is distributed,
// and a front end, which holds no scope key, cannot make one. The label
// keeps grant MACs apart from Block Keys ("KVSP-BLOCK-1"), which the IS
// and holders see: no Block Key is a grant's MAC, or the reverse.
//
// Wire form (base64url without padding, at most MaxGrantLen characters):
//
//	version 1 | id 16 | session 16 | epoch 8 | scope_id 16 | compat_id 32 |
//	prompt 32 | max_tokens 8 | expires (unix ms) 8 | instance epoch 8 |
//	len(instance) 2 | instance | mac 32
type Grant struct {
	// ID names this placement: an instance takes a grant once, and
	// reports the IDs it started in its status (the PC's count of the
	// room placements hold, RELIABILITY L5).
	ID       GrantID
	Session  UUID
	Epoch    uint64
	ScopeID  ScopeID
	CompatID CompatID
	// Prompt is the prompt's PromptDigest: the generate must carry it.
	Prompt [32]byte
	// MaxTokens bounds the generate's max_tokens.
	MaxTokens uint64
	// Instance is the base URI of the instance placed on, and
	// InstanceEpoch its epoch then: a restarted instance (a new epoch,
	// which no longer knows which grants it took) refuses its former
	// self's grants.
	Instance      string
	InstanceEpoch uint64
	// Expires is when the grant stops being taken (ms precision).
	Expires time.Time
}

// GrantID names a placement (hex16 on the wire).
type GrantID [16]byte

// NewGrantID returns a random GrantID.
func NewGrantID() GrantID {
	var id GrantID
	rand.Read(id[:])
	return id
}

func (id GrantID) String() string { return string(appendHex(nil, id[:])) }

// MarshalText implements encoding.TextMarshaler (hex16).
func (id GrantID) MarshalText() ([]byte, error) { return appendHex(nil, id[:]), nil }

// UnmarshalText accepts only hex16.
func (id *GrantID) UnmarshalText(b []byte) error { return parseHex(id[:], b, "grant id") }

const (
	grantLabel   = "KVSP-GRANT-1\x00"
	grantVersion = 1
	grantFixed   = 1 + 16 + 16 + 8 + 16 + 32 + 32 + 8 + 8 + 8 + 2
	grantMAC     = 32
	// MaxGrantLen bounds a grant's wire form: a base URI of at most
	// MaxBaseURILen octets.
	MaxGrantLen = (grantFixed + MaxBaseURILen + grantMAC + 2) / 3 * 4
)

// ErrGrant refuses a generate whose grant is missing, not the PC's, or not
// for this request (403).
var ErrGrant = fmt.Errorf("%w: no valid placement grant", ErrForbidden)

// Seal returns g's wire form, sealed with key (the scope key of g.ScopeID).
func (g *Grant) Seal(key ScopeKey) (string, error) {
	if !key.Valid() || key.ID() != g.ScopeID {
		return "", fmt.Errorf("%w: grant: the key is not the grant's scope's", ErrInvalid)
	}
	if err := ValidateBaseURI("grant: instance", g.Instance); err != nil {
		return "", err
	}
	b := make([]byte, 0, grantFixed+len(g.Instance)+grantMAC)
	b = append(b, grantVersion)
	b = append(b, g.ID[:]...)
	b = append(b, g.Session[:]...)
	b = binary.BigEndian.AppendUint64(b, g.Epoch)
	b = append(b, g.ScopeID[:]...)
	b = append(b, g.CompatID[:]...)
	b = append(b, g.Prompt[:]...)
	b = binary.BigEndian.AppendUint64(b, g.MaxTokens)
	b = binary.BigEndian.AppendUint64(b, uint64(g.Expires.UnixMilli()))
	b = binary.BigEndian.AppendUint64(b, g.InstanceEpoch)
	b = binary.BigEndian.AppendUint16(b, uint16(len(g.Instance)))
	b = append(b, g.Instance...)
	b = append(b, grantSum(key, b)...)
	return base64.RawURLEncoding.EncodeToString(b), nil
}

// OpenGrant checks s's MAC under key and returns its grant. Any defect (not
// base64url, a length or version off, a MAC that is not key's) is
// ErrGrant, with no detail that would help forge one.
func OpenGrant(key ScopeKey, s string) (*Grant, error) {
	if len(s) == 0 || len(s) > MaxGrantLen || !key.Valid() {
		return nil, ErrGrant
	}
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil || len(b) < grantFixed+grantMAC || b[0] != grantVersion {
		return nil, ErrGrant
	}
	body, mac := b[:len(b)-grantMAC], b[len(b)-grantMAC:]
	if !hmac.Equal(mac, grantSum(key, body)) {
		return nil, ErrGrant
	}
	g := &Grant{}
	p := body[1:]
	p = p[copy(g.ID[:], p):]
	p = p[copy(g.Session[:], p):]
	g.Epoch, p = binary.BigEndian.Uint64(p), p[8:]
	p = p[copy(g.ScopeID[:], p):]
	p = p[copy(g.CompatID[:], p):]
	p = p[copy(g.Prompt[:], p):]
	g.MaxTokens, p = binary.BigEndian.Uint64(p), p[8:]
	g.Expires, p = time.UnixMilli(int64(binary.BigEndian.Uint64(p))), p[8:]
	g.InstanceEpoch, p = binary.BigEndian.Uint64(p), p[8:]
	n := int(binary.BigEndian.Uint16(p))
	if p = p[2:]; len(p) != n || g.ScopeID != key.ID() {
		return nil, ErrGrant
	}
	g.Instance = string(p)
	return g, nil
}

func grantSum(key ScopeKey, body []byte) []byte {
	m := hmac.New(sha256.New, key.octets())
	m.Write([]byte(grantLabel))
	m.Write(body)
	return m.Sum(nil)
}

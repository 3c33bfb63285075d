package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync/atomic"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kvsp/kvsp"
)

// Role is what a principal may do (decision A-5).
type Role string

// The roles of a policy file.
const (
	RoleController Role = "controller" // prefetch, resume, reshard, state; records checkpoints
	RoleIndex      Role = "index"
	RoleHolder     Role = "holder"   // publishes and withdraws replicas for the bases it speaks for
	RoleInstance   Role = "instance" // sends status and checkpoints for the bases it speaks for; stores the blocks it computes
	RoleClient     Role = "client"   // reads blocks, leases and lookups in its scopes; places and generates
	// RoleProducer stores blocks in its scopes (and states their
	// digests for the bases it speaks for) without being an instance: a
	// tool that fills holders with KV it computed. A client does not
	// store blocks (RELIABILITY S13: a client's self-consistent block
	// for a prompt nobody had run was served to the scope as its KV).
	RoleProducer Role = "producer"
)

func (r Role) valid() bool {
	switch r {
	case RoleController, RoleIndex, RoleHolder, RoleInstance, RoleClient, RoleProducer:
		return true
	}
	return false
}

// Principal is one entry of the policy: an identity and what it may do.
type Principal struct {
	ID     string   `yaml:"id"`
	Roles  []Role   `yaml:"roles"`
	Bases  []string `yaml:"speaks_for"`
	Scopes []string `yaml:"scopes"`

	scopes []kvsp.ScopeID
}

// Has reports whether p holds role r.
func (p *Principal) Has(r Role) bool { return p != nil && slices.Contains(p.Roles, r) }

// HasAny reports whether p holds one of roles.
func (p *Principal) HasAny(roles ...Role) bool {
	for _, r := range roles {
		if p.Has(r) {
			return true
		}
	}
	return false
}

// MayUseScope reports whether p is authorized for the scope (R-SEC-2,
// R-SEC-6): block GET/PUT, leases and lookups in it.
func (p *Principal) MayUseScope(s kvsp.ScopeID) bool {
	return p != nil && slices.Contains(p.scopes, s)
}

// SpeaksFor reports whether p may publish or report for the base URI
// (exact string after normalisation, A-6, A-34).
func (p *Principal) SpeaksFor(base string) bool {
	return p != nil && slices.Contains(p.Bases, base)
}

// Policy maps identities to principals, and API keys (a gateway's bearer
// keys, stored hashed) to principals and scopes. It is immutable once
// loaded.
type Policy struct {
	byID map[string]*Principal
	keys []*APIKey
}

// APIKey is a gateway's bearer key, by its SHA-256 (the key itself is
// never stored): the principal it authenticates, the one scope its
// requests run in, and its limits (0: none).
type APIKey struct {
	SHA256        string `yaml:"sha256"`
	Principal     string `yaml:"principal"`
	Scope         string `yaml:"scope"`
	MaxConcurrent int    `yaml:"max_concurrent"`
	// MaxTokensPerMinute bounds the prompt and output tokens of its
	// requests in any minute.
	MaxTokensPerMinute int `yaml:"max_tokens_per_minute"`

	hash  [sha256.Size]byte
	scope kvsp.ScopeID
}

// ScopeID is the key's scope.
func (k *APIKey) ScopeID() kvsp.ScopeID { return k.scope }

// APIKey returns the entry of a presented bearer key, or nil. Every
// entry's hash is compared in constant time, so the time taken says
// nothing of which entry, if any, is near the key presented.
func (p *Policy) APIKey(key string) *APIKey {
	if p == nil || key == "" {
		return nil
	}
	h := sha256.Sum256([]byte(key))
	var found *APIKey
	for _, k := range p.keys {
		if subtle.ConstantTimeCompare(h[:], k.hash[:]) == 1 {
			found = k
		}
	}
	return found
}

// Lookup returns the principal of an identity, or nil: unknown identities
// are denied (fail closed).
func (p *Policy) Lookup(id string) *Principal {
	if p == nil {
		return nil
	}
	return p.byID[id]
}

type policyFile struct {
	Principals []*Principal `yaml:"principals"`
	APIKeys    []*APIKey    `yaml:"api_keys"`
}

// ParsePolicy parses and validates a policy file. Every error names the
// entry and field; unknown fields, unknown roles, bad scope IDs, base URIs
// not in normalised form and duplicate identities are refused.
func ParsePolicy(data []byte) (*Policy, error) {
	var f policyFile
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("policy: %w", err)
	}
	// A second YAML document would be silently ignored: refuse the file
	// rather than guess which one the operator meant (fail closed).
	if err := dec.Decode(new(yaml.Node)); !errors.Is(err, io.EOF) {
		return nil, errors.New("policy: more than one YAML document")
	}
	p := &Policy{byID: make(map[string]*Principal, len(f.Principals))}
	for i, pr := range f.Principals {
		where := fmt.Sprintf("policy: principals[%d]", i)
		if pr == nil || pr.ID == "" {
			return nil, fmt.Errorf("%s.id: required", where)
		}
		if _, dup := p.byID[pr.ID]; dup {
			return nil, fmt.Errorf("%s.id: %q listed twice", where, pr.ID)
		}
		if len(pr.Roles) == 0 {
			return nil, fmt.Errorf("%s.roles: at least one role required", where)
		}
		for _, r := range pr.Roles {
			if !r.valid() {
				return nil, fmt.Errorf("%s.roles: unknown role %q", where, r)
			}
		}
		for _, b := range pr.Bases {
			if err := kvsp.ValidateBaseURI("speaks_for", b); err != nil {
				return nil, fmt.Errorf("%s.speaks_for: %q: %w", where, b, err)
			}
		}
		for _, s := range pr.Scopes {
			id, err := kvsp.ParseScopeID(s)
			if err != nil {
				return nil, fmt.Errorf("%s.scopes: %q: %w", where, s, err)
			}
			pr.scopes = append(pr.scopes, id)
		}
		p.byID[pr.ID] = pr
	}
	seen := map[[sha256.Size]byte]bool{}
	for i, k := range f.APIKeys {
		where := fmt.Sprintf("policy: api_keys[%d]", i)
		if k == nil {
			return nil, fmt.Errorf("%s: empty", where)
		}
		b, err := hex.DecodeString(k.SHA256)
		if err != nil || len(b) != sha256.Size || k.SHA256 != hex.EncodeToString(b) {
			return nil, fmt.Errorf("%s.sha256: want the key's SHA-256, 64 lowercase hex digits", where)
		}
		copy(k.hash[:], b)
		if seen[k.hash] {
			return nil, fmt.Errorf("%s.sha256: listed twice", where)
		}
		seen[k.hash] = true
		if k.Principal == "" || len(k.Principal) > 128 {
			return nil, fmt.Errorf("%s.principal: required, at most 128 characters", where)
		}
		if k.scope, err = kvsp.ParseScopeID(k.Scope); err != nil {
			return nil, fmt.Errorf("%s.scope: %w", where, err)
		}
		if k.MaxConcurrent < 0 || k.MaxTokensPerMinute < 0 {
			return nil, fmt.Errorf("%s: limits are at least 0 (0: none)", where)
		}
		p.keys = append(p.keys, k)
	}
	return p, nil
}

// PolicyStore holds the current policy of a process and reloads it from its
// file without a restart. Readers never block.
type PolicyStore struct {
	path string
	log  *slog.Logger
	cur  atomic.Pointer[Policy]
	stat atomic.Pointer[fileStamp]
}

type fileStamp struct {
	mod  time.Time
	size int64
}

// LoadPolicyStore reads the policy file; an error here is a configuration
// error and the process must not start.
func LoadPolicyStore(path string, log *slog.Logger) (*PolicyStore, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &PolicyStore{path: path, log: log}
	if err := s.Reload(); err != nil {
		return nil, err
	}
	return s, nil
}

// NewStaticPolicyStore holds a fixed policy (tests, embedded use).
func NewStaticPolicyStore(p *Policy) *PolicyStore {
	s := &PolicyStore{log: slog.New(slog.DiscardHandler)}
	s.cur.Store(p)
	return s
}

// Policy returns the current policy.
func (s *PolicyStore) Policy() *Policy { return s.cur.Load() }

// Set replaces the policy (tests, embedded use).
func (s *PolicyStore) Set(p *Policy) { s.cur.Store(p) }

// Reload re-reads the file. On error the previous policy stays in force and
// the error is returned (and logged by Watch).
func (s *PolicyStore) Reload() error {
	if s.path == "" {
		return nil
	}
	fi, err := os.Stat(s.path)
	if err != nil {
		return fmt.Errorf("policy: %w", err)
	}
	data, err := os.ReadFile(s.path)
	if err != nil {
		return fmt.Errorf("policy: %w", err)
	}
	p, err := ParsePolicy(data)
	if err != nil {
		return err
	}
	s.cur.Store(p)
	s.stat.Store(&fileStamp{fi.ModTime(), fi.Size()})
	return nil
}

// Watch reloads the policy whenever its file changes (checked every
// interval) until ctx ends. A SIGHUP handler calls Reload directly.
func (s *PolicyStore) Watch(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		fi, err := os.Stat(s.path)
		if err != nil {
			continue
		}
		if st := s.stat.Load(); st != nil && st.mod.Equal(fi.ModTime()) && st.size == fi.Size() {
			continue
		}
		if err := s.Reload(); err != nil {
			s.log.Error("policy reload failed; the previous policy stays in force", "err", err)
			s.stat.Store(&fileStamp{fi.ModTime(), fi.Size()}) // do not retry until it changes again
			continue
		}
		s.log.Info("policy reloaded", "principals", len(s.Policy().byID))
	}
}

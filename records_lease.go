package kvsp

// A holder's lease request, renewal and response (Procedures).

// LeaseRequest is the body of POST leases (section "Leases", A-2).
type LeaseRequest struct {
	ScopeID   ScopeID    `json:"scope_id"`
	CompatID  CompatID   `json:"compat_id"`
	BlockKeys []BlockKey `json:"block_keys"`
	TTLMs     uint64     `json:"ttl_ms"`
}

// Validate implements Validator.
func (l *LeaseRequest) Validate() error {
	switch {
	case l.ScopeID.IsZero():
		return invalidf("lease: scope_id: required")
	case l.CompatID.IsZero():
		return invalidf("lease: compat_id: required")
	case len(l.BlockKeys) == 0:
		return invalidf("lease: block_keys: required, at least one")
	case l.TTLMs == 0:
		return invalidf("lease: ttl_ms: required, at least 1")
	}
	for i, k := range l.BlockKeys {
		if k.IsZero() {
			return invalidf("lease: block_keys[%d]: zero key", i)
		}
	}
	return checkInt("lease: ttl_ms", l.TTLMs)
}

// LeaseRenewal is the body of PUT leases/{id}.
type LeaseRenewal struct {
	TTLMs uint64 `json:"ttl_ms"`
}

// Validate implements Validator.
func (l *LeaseRenewal) Validate() error {
	if l.TTLMs == 0 {
		return invalidf("lease: ttl_ms: required, at least 1")
	}
	return checkInt("lease: ttl_ms", l.TTLMs)
}

// MaxLeaseIDLen bounds lease identifiers, which are opaque and path-safe.
const MaxLeaseIDLen = 128

// LeaseResponse is the body of a granted or renewed lease.
type LeaseResponse struct {
	Lease     string     `json:"lease"`
	TTLMs     uint64     `json:"ttl_ms"`
	BlockKeys []BlockKey `json:"block_keys"`
}

// Validate implements Validator.
func (l *LeaseResponse) Validate() error {
	if l.Lease == "" || len(l.Lease) > MaxLeaseIDLen {
		return invalidf("lease response: lease: required, at most %d octets", MaxLeaseIDLen)
	}
	for i := 0; i < len(l.Lease); i++ {
		if c := l.Lease[i]; !isUnreserved(c) {
			return invalidf("lease response: lease: must be path-safe")
		}
	}
	if l.Lease == "." || l.Lease == ".." {
		return invalidf("lease response: lease: a dot segment is not path-safe")
	}
	if l.TTLMs == 0 {
		return invalidf("lease response: ttl_ms: required")
	}
	if len(l.BlockKeys) == 0 {
		return invalidf("lease response: block_keys: required")
	}
	return checkInt("lease response: ttl_ms", l.TTLMs)
}

package index

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/kvsp/kvsp"
)

// Backend stores replica records. Implementations are safe for concurrent
// use and share one conformance suite (backend_test.go).
type Backend interface {
	// Put stores rec, or refreshes the record of the same holder and block
	// key, to expire ttl from now. It reports whether the record is new.
	// With o.PinDigest, a record whose digest differs from that of the
	// live replicas of its key is refused with ErrDigestConflict (the
	// producer's digest wins: spec "Security Considerations", cache
	// poisoning); with o.MaxHolderRecords, a new record of a holder that
	// has as many live ones is refused with ErrRecordQuota (a refresh is
	// not a new record).
	Put(ctx context.Context, rec *kvsp.ReplicaRecord, ttl time.Duration, o PutOptions) (created bool, err error)
	// Delete removes the record of holder for key after authorize accepts
	// the stored record; kvsp.ErrNotFound when there is none.
	Delete(ctx context.Context, holder string, key kvsp.BlockKey, authorize func(*kvsp.ReplicaRecord) error) error
	// Lookup fills res (after Reset) with, for each key in order, the
	// unexpired records of that key in the scope and compat (ttl_ms set to
	// their remaining time, rounded up), stopping at the first key that has
	// none (R-IS-13, R-IS-15, R-IS-20). The records' slices may alias the
	// backend's immutable copies: callers do not modify them.
	Lookup(ctx context.Context, scope kvsp.ScopeID, compat kvsp.CompatID, keys []kvsp.BlockKey, res *Result) error
	// Len returns the number of stored records, expired or not yet swept.
	Len() int
	// Close stops background work.
	Close() error
}

// Result is a lookup's answer. Reusing one across lookups (Reset) keeps
// lookups from allocating, which keeps the garbage collector, and the tail
// latency it brings over a heap of a million records, away.
type Result struct {
	// Replicas has one non-empty entry per matched key.
	Replicas [][]kvsp.ReplicaRecord
	flat     []kvsp.ReplicaRecord
	arena    arena                 // decoded records' memory (shared-store backends)
	names    []byte                // key names of the lookup, back to back
	args     []any                 // the command's arguments
	reply    bytes.Buffer          // a raw reply, parsed in place
	seen     map[kvsp.BlockKey]int // the service's check for repeated keys
}

// Reset empties r, keeping its memory.
func (r *Result) Reset() {
	clear(r.Replicas) // drop references for the collector
	r.Replicas = r.Replicas[:0]
	clear(r.flat)
	r.flat = r.flat[:0]
	r.arena.reset()
}

// add appends one key's records (already in r.flat from start).
func (r *Result) add(start int) {
	r.Replicas = append(r.Replicas, r.flat[start:len(r.flat):len(r.flat)])
}

// PutOptions are the checks a Put makes.
type PutOptions struct {
	PinDigest        bool
	MaxHolderRecords int // 0: no quota
}

// ErrRecordQuota refuses a holder's record beyond its quota (429,
// RELIABILITY B9: one holder's publishes do not fill the index).
var ErrRecordQuota = fmt.Errorf("%w: this holder has as many records as the index's per-holder quota", kvsp.ErrTooManyRequests)

// ErrDigestConflict refuses a publish whose digest differs from the
// producer's (409).
var ErrDigestConflict = fmt.Errorf("%w: the digest differs from the first published replica of this key", kvsp.ErrConflict)

// remainingMs is the remaining lifetime in ms, rounded up.
func remainingMs(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64((d + time.Millisecond - 1) / time.Millisecond)
}

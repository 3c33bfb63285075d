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
	// With o.PinDigest, a record is accepted only with the digest its
	// producer stated (Pin; spec "Security Considerations", cache
	// poisoning): without a live statement it is refused with
	// ErrNoProducerDigest, with another digest with ErrDigestConflict,
	// and the statement lives at least as long as the record; with
	// o.MaxHolderRecords, a new record of a holder that has as many live
	// ones is refused with ErrRecordQuota (a refresh is not a new
	// record).
	Put(ctx context.Context, rec *kvsp.ReplicaRecord, ttl time.Duration, o PutOptions) (created bool, err error)
	// Pin stores a producer's statement of its key's digest for ttl (a
	// longer one stands): ErrProducerConflict when a live statement of the
	// key names another digest, scope or model. A statement outlives the
	// withdrawal of its key's records: it is the producer's.
	Pin(ctx context.Context, rec *kvsp.ProducerRecord, ttl time.Duration) error
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

// ErrDigestConflict refuses a publish whose digest differs from the one
// its producer stated (409).
var ErrDigestConflict = fmt.Errorf("%w: the digest differs from the one the block's producer stated", kvsp.ErrConflict)

// ErrNoProducerDigest refuses a publish, with producer digests, of a key
// whose producer has stated no digest (409): the first holder to publish
// a key is not trusted because it was first (RELIABILITY S13).
var ErrNoProducerDigest = fmt.Errorf("%w: no producer has stated this block's digest", kvsp.ErrConflict)

// ErrProducerConflict refuses a producer's statement of a key another
// producer stated another digest for (409: the first statement stands
// until it expires).
var ErrProducerConflict = fmt.Errorf("%w: another producer stated another digest for this block", kvsp.ErrConflict)

// remainingMs is the remaining lifetime in ms, rounded up.
func remainingMs(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64((d + time.Millisecond - 1) / time.Millisecond)
}

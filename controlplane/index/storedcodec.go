package index

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"unsafe"

	"github.com/kvsp/kvsp"
)

// The compact binary form of a record in a shared store: decoding it costs
// a fraction of JSON, which matters when a lookup returns 64 of them.
//
//	version u8 = 1
//	scope_id [16] compat_id [32]          (first, so scripts filter on them)
//	block_key [32] digest [32] codec u16 size u64
//	holder: u16 length, octets            moqt_namespace: u16 length, octets
//	layer_digests: u16 count, count x [32]
//	residency: u8 count, each: u8 tier length, tier, u32 first, u32 last, u64 read_mbit_per_s
const storedVersion = 1

var errStored = errors.New("index: malformed stored record")

func appendStored(b []byte, r *kvsp.ReplicaRecord) ([]byte, error) {
	if len(r.Holder) > 0xffff || len(r.MOQTNamespace) > 0xffff || len(r.LayerDigests) > 0xffff || len(r.Residency) > 0xff {
		return nil, fmt.Errorf("%w: record too large to store", kvsp.ErrInvalid)
	}
	b = append(b, storedVersion)
	b = append(b, r.ScopeID[:]...)
	b = append(b, r.CompatID[:]...)
	b = append(b, r.BlockKey[:]...)
	b = append(b, r.Digest[:]...)
	b = binary.BigEndian.AppendUint16(b, uint16(r.Codec))
	b = binary.BigEndian.AppendUint64(b, r.Size)
	b = binary.BigEndian.AppendUint16(b, uint16(len(r.Holder)))
	b = append(b, r.Holder...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(r.MOQTNamespace)))
	b = append(b, r.MOQTNamespace...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(r.LayerDigests)))
	for i := range r.LayerDigests {
		b = append(b, r.LayerDigests[i][:]...)
	}
	b = append(b, byte(len(r.Residency)))
	for _, e := range r.Residency {
		b = append(b, byte(len(e.Tier)))
		b = append(b, e.Tier...)
		b = binary.BigEndian.AppendUint32(b, e.Layers[0])
		b = binary.BigEndian.AppendUint32(b, e.Layers[1])
		b = binary.BigEndian.AppendUint64(b, e.ReadMbitPerS)
	}
	return b, nil
}

// storedFilterLen is the prefix a script compares: version, scope, compat.
const storedFilterLen = 1 + 16 + 32

type reader struct {
	b   []byte
	err bool
}

func (r *reader) take(n int) []byte {
	if r.err || len(r.b) < n {
		r.err = true
		return make([]byte, n)
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u8() int     { return int(r.take(1)[0]) }
func (r *reader) u16() int    { return int(binary.BigEndian.Uint16(r.take(2))) }
func (r *reader) u32() uint32 { return binary.BigEndian.Uint32(r.take(4)) }
func (r *reader) u64() uint64 { return binary.BigEndian.Uint64(r.take(8)) }

// arena is a lookup's scratch memory for decoded records: residency is
// carved out of a slice reused from lookup to lookup, holder URIs are
// interned, and layer digests alias the stored octets, so decoding 64
// records costs no allocation once a Result is warm.
type arena struct {
	residency []kvsp.Residency
	holders   map[string]string
}

// maxInterned bounds the interned holder URIs (a deployment has tens).
const maxInterned = 1024

func (a *arena) reset() {
	a.residency = a.residency[:0]
}

func (a *arena) holder(b []byte) string {
	if h, ok := a.holders[string(b)]; ok {
		return h
	}
	if a.holders == nil || len(a.holders) >= maxInterned {
		a.holders = make(map[string]string)
	}
	h := string(b)
	a.holders[h] = h
	return h
}

// take returns n fresh elements of s (grown as needed), full-capacity
// sliced so the caller cannot append into its neighbours.
func take[T any](s *[]T, n int) []T {
	*s = slices.Grow(*s, n)
	l := len(*s)
	*s = (*s)[:l+n]
	return (*s)[l : l+n : l+n]
}

// decodeStoredInto fills rec from the compact form (ttl_ms is the
// caller's). With an arena, rec's residency lives in it (valid until the
// arena's reset) and its layer digests alias b, which must then stay
// unchanged as long as rec is used (the Result's reply buffer, reused only
// after its Reset); without, they are allocated.
func decodeStoredInto(rec *kvsp.ReplicaRecord, b []byte, a *arena) error {
	r := reader{b: b}
	if r.u8() != storedVersion {
		return errStored
	}
	copy(rec.ScopeID[:], r.take(16))
	copy(rec.CompatID[:], r.take(32))
	copy(rec.BlockKey[:], r.take(32))
	copy(rec.Digest[:], r.take(32))
	rec.Codec = kvsp.Codec(r.u16())
	rec.Size = r.u64()
	if a != nil {
		rec.Holder = a.holder(r.take(r.u16()))
	} else {
		rec.Holder = string(r.take(r.u16()))
	}
	rec.MOQTNamespace = string(r.take(r.u16()))
	rec.LayerDigests = nil
	if n := r.u16(); n > 0 {
		raw := r.take(32 * n)
		if a != nil && !r.err {
			rec.LayerDigests = unsafe.Slice((*kvsp.LayerDigest)(unsafe.Pointer(unsafe.SliceData(raw))), n)[:n:n]
		} else {
			rec.LayerDigests = make([]kvsp.LayerDigest, n)
			for i := range rec.LayerDigests {
				copy(rec.LayerDigests[i][:], raw[32*i:])
			}
		}
	}
	if n := r.u8(); a != nil {
		rec.Residency = take(&a.residency, n)
	} else {
		rec.Residency = make([]kvsp.Residency, n)
	}
	for i := range rec.Residency {
		var t kvsp.Tier
		if err := t.UnmarshalText(r.take(r.u8())); err != nil {
			return errStored
		}
		rec.Residency[i] = kvsp.Residency{Tier: t, Layers: kvsp.LayerRange{r.u32(), r.u32()}, ReadMbitPerS: r.u64()}
	}
	if r.err || len(r.b) != 0 {
		return errStored
	}
	return nil
}

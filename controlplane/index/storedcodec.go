package index

import (
	"encoding/binary"
	"errors"
	"fmt"

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

// decodeStoredInto fills rec from the compact form (ttl_ms is the
// caller's).
func decodeStoredInto(rec *kvsp.ReplicaRecord, b []byte) error {
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
	rec.Holder = string(r.take(r.u16()))
	rec.MOQTNamespace = string(r.take(r.u16()))
	if n := r.u16(); n > 0 {
		rec.LayerDigests = make([]kvsp.LayerDigest, n)
		for i := range rec.LayerDigests {
			copy(rec.LayerDigests[i][:], r.take(32))
		}
	}
	n := r.u8()
	rec.Residency = make([]kvsp.Residency, n)
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

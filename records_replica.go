package kvsp

import (
	"encoding/base64"
	"slices"
)

// The replica record (the spec's Data Model): what a holder publishes to
// the Index Service, with the layer residency it carries.

// LayerRange is an inclusive layer range [first, last] as carried in a
// residency entry (R-REC-9: "Layer ranges are inclusive").
type LayerRange [2]uint32

// Len returns the number of layers in r.
func (r LayerRange) Len() int { return int(r[1]) - int(r[0]) + 1 }

// Residency states which layers of a replica reside in which tier.
type Residency struct {
	Tier   Tier       `json:"tier"`
	Layers LayerRange `json:"layers"`
	// ReadMbitPerS is the rate at which the holder reads this tier; 0 when
	// absent (R-REC-10).
	ReadMbitPerS uint64 `json:"read_mbit_per_s,omitzero"`
}

// ReplicaRecord describes a copy of a block, or of some of its layers, at a
// holder (section "Records", R-REC-5..13, A-1, A-8, A-14).
type ReplicaRecord struct {
	BlockKey BlockKey `json:"block_key"`
	CompatID CompatID `json:"compat_id"`
	ScopeID  ScopeID  `json:"scope_id"`
	Holder   string   `json:"holder"`
	Codec    Codec    `json:"codec"`
	// Size is the octets of the K and V sections of the layers held.
	Size   uint64 `json:"size"`
	Digest Digest `json:"digest"`
	// LayerDigests has one entry per model layer, index = layer.
	LayerDigests []LayerDigest `json:"layer_digests,omitempty"`
	Residency    []Residency   `json:"residency"`
	TTLMs        uint64        `json:"ttl_ms"`
	// MOQTNamespace is set for a replica served through Media over QUIC
	// Transport; Holder is then a moqt URI (R-REC-12, A-37).
	MOQTNamespace string `json:"moqt_namespace,omitempty"`
}

// MOQTNamespaceFields is the number of Track Namespace Fields in a
// moqt_namespace.
const MOQTNamespaceFields = 5

// Validate implements Validator.
func (r *ReplicaRecord) Validate() error {
	switch {
	case r.BlockKey.IsZero():
		return invalidf("replica: block_key: required")
	case r.CompatID.IsZero():
		return invalidf("replica: compat_id: required")
	case r.ScopeID.IsZero():
		return invalidf("replica: scope_id: required")
	case r.Codec == CodecReserved:
		return invalidf("replica: codec: required, and 0 is reserved")
	case r.Size == 0:
		return invalidf("replica: size: required")
	case r.Digest.IsZero():
		return invalidf("replica: digest: required")
	case r.TTLMs == 0:
		return invalidf("replica: ttl_ms: required, at least 1")
	case len(r.Residency) == 0:
		return invalidf("replica: residency: required, at least one entry")
	}
	if err := checkInt("replica: size", r.Size); err != nil {
		return err
	}
	if err := checkInt("replica: ttl_ms", r.TTLMs); err != nil {
		return err
	}
	if r.MOQTNamespace != "" {
		if err := validateMOQTNamespace(r.MOQTNamespace); err != nil {
			return err
		}
		if err := validateNormalized("replica: holder", r.Holder); err != nil {
			return err
		}
		if !hasScheme(r.Holder, "moqt") {
			return invalidf("replica: holder: a record with moqt_namespace names a moqt URI")
		}
	} else {
		if err := ValidateBaseURI("replica: holder", r.Holder); err != nil {
			return err
		}
		if !hasScheme(r.Holder, "https") {
			return invalidf("replica: holder: must be an https base URI")
		}
	}
	ranges := make([]LayerRange, len(r.Residency))
	for i, e := range r.Residency {
		if !e.Tier.Valid() {
			return invalidf("replica: residency[%d].tier: not registered", i)
		}
		if e.Layers[0] > e.Layers[1] {
			return invalidf("replica: residency[%d].layers: first exceeds last", i)
		}
		if err := checkInt("replica: read_mbit_per_s", e.ReadMbitPerS); err != nil {
			return err
		}
		ranges[i] = e.Layers
	}
	slices.SortFunc(ranges, func(a, b LayerRange) int { return int(int64(a[0]) - int64(b[0])) })
	for i := 1; i < len(ranges); i++ {
		if ranges[i][0] <= ranges[i-1][1] {
			return invalidf("replica: residency: layer ranges overlap")
		}
	}
	if r.LayerDigests != nil {
		if len(r.LayerDigests) == 0 {
			return invalidf("replica: layer_digests: empty")
		}
		if int64(ranges[len(ranges)-1][1]) >= int64(len(r.LayerDigests)) {
			return invalidf("replica: layer_digests: fewer entries than the layers resident")
		}
	}
	return nil
}

// HeldLayers returns the number of layers in the residency entries.
func (r *ReplicaRecord) HeldLayers() int {
	n := 0
	for _, e := range r.Residency {
		n += e.Layers.Len()
	}
	return n
}

func hasScheme(uri, scheme string) bool {
	return len(uri) > len(scheme)+3 && uri[:len(scheme)] == scheme && uri[len(scheme):len(scheme)+3] == "://"
}

// validateMOQTNamespace checks base64url without padding of exactly five
// length-prefixed fields and nothing after them (R-REC-12, A-37).
func validateMOQTNamespace(s string) error {
	b, err := base64.RawURLEncoding.Strict().DecodeString(s)
	if err != nil {
		return invalidf("replica: moqt_namespace: not base64url without padding")
	}
	for i := 0; i < MOQTNamespaceFields; i++ {
		if len(b) == 0 {
			return invalidf("replica: moqt_namespace: fewer than %d fields", MOQTNamespaceFields)
		}
		n := int(b[0])
		if len(b) < 1+n {
			return invalidf("replica: moqt_namespace: field %d truncated", i)
		}
		b = b[1+n:]
	}
	if len(b) != 0 {
		return invalidf("replica: moqt_namespace: octets after the last field")
	}
	return nil
}

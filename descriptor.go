package kvsp

import (
	"crypto/sha256"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/gowebpki/jcs"
)

// compatLabel is the domain-separation prefix of the Compatibility ID.
const compatLabel = "KVSP-COMPAT-1\x00"

// MaxModelNameLen bounds the "model" member.
const MaxModelNameLen = 1024

// Descriptor is the Compatibility Descriptor (section "Compatibility
// Descriptor and Compatibility ID", R-CMP-1..17): everything that decides
// whether two KV caches can substitute for each other.
type Descriptor struct {
	Model           string `json:"model"`
	ModelDigest     Digest `json:"model_digest"`
	TokenizerDigest Digest `json:"tokenizer_digest"`
	// Adapters lists adapter digests in the order of application. Nil means
	// the member is absent; an empty, non-nil slice is invalid (R-CMP-6).
	Adapters    []Digest    `json:"adapters,omitempty"`
	Layers      int         `json:"layers"`
	KVHeads     int         `json:"kv_heads"`
	HeadDim     int         `json:"head_dim"`
	KVDType     ElementType `json:"kv_dtype"`
	Positional  string      `json:"positional"`
	BlockTokens int         `json:"block_tokens"`
	Layout      string      `json:"layout"`
}

// ParseDescriptor decodes and validates a descriptor. Unlike records, a
// descriptor with an unknown member is rejected: a member this version does
// not understand may change the stored tensors, and dropping it would give
// incompatible caches one Compatibility ID.
func ParseDescriptor(data []byte) (Descriptor, error) {
	var d Descriptor
	if err := json.Unmarshal(data, &d, decodeOptions, json.RejectUnknownMembers(true)); err != nil {
		return Descriptor{}, fmt.Errorf("%w: descriptor: %s", ErrInvalid, describeJSONError(err))
	}
	return d, d.Validate()
}

// UnmarshalJSONFrom decodes a descriptor, telling an absent "adapters" from
// null or an empty array, both of which are invalid (R-CMP-6).
func (d *Descriptor) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	type plain Descriptor
	var w struct {
		plain
		Adapters jsontext.Value `json:"adapters"`
	}
	if err := json.UnmarshalDecode(dec, &w); err != nil {
		return err
	}
	*d = Descriptor(w.plain)
	d.Adapters = nil
	if w.Adapters != nil {
		if w.Adapters.Kind() != '[' {
			return invalidf("adapters: must be an array when present")
		}
		d.Adapters = []Digest{}
		if err := json.Unmarshal(w.Adapters, &d.Adapters, decodeOptions); err != nil {
			return invalidf("adapters: each must be \"sha-256:\" followed by hex32")
		}
	}
	return nil
}

// Validate checks every member (R-CMP-1, R-CMP-5..12).
func (d *Descriptor) Validate() error {
	switch {
	case d.Model == "":
		return invalidf("descriptor: model: required")
	case len(d.Model) > MaxModelNameLen:
		return invalidf("descriptor: model: longer than %d octets", MaxModelNameLen)
	case d.ModelDigest.IsZero():
		return invalidf("descriptor: model_digest: required")
	case d.TokenizerDigest.IsZero():
		return invalidf("descriptor: tokenizer_digest: required")
	case d.Adapters != nil && len(d.Adapters) == 0:
		return invalidf("descriptor: adapters: must be absent, not empty, when no adapter is applied")
	}
	for i, a := range d.Adapters {
		if a.IsZero() {
			return invalidf("descriptor: adapters[%d]: required", i)
		}
	}
	for _, g := range []struct {
		name string
		v    int
		max  int
	}{
		{"layers", d.Layers, math.MaxUint32},
		{"kv_heads", d.KVHeads, math.MaxUint32},
		{"head_dim", d.HeadDim, math.MaxUint32},
		{"block_tokens", d.BlockTokens, MaxBlockTokens},
	} {
		if g.v < 1 || g.v > g.max {
			return invalidf("descriptor: %s: must be an integer in 1..%d", g.name, g.max)
		}
	}
	if !d.KVDType.Valid() {
		return invalidf("descriptor: kv_dtype: not in the KVSP Element Types registry")
	}
	if _, err := ParsePositional(d.Positional); err != nil {
		return fmt.Errorf("descriptor: %w", err)
	}
	if d.Layout != LayoutRaw {
		return invalidf("descriptor: layout: only %q is defined", LayoutRaw)
	}
	// A raw K or V section must be addressable: Token Count x kv_heads x
	// head_dim x element size octets fit in the container's 64-bit length.
	if sz := uint64(d.BlockTokens) * uint64(d.KVHeads) * uint64(d.HeadDim) * uint64(d.KVDType.Size()); sz > MaxJSONInt {
		return invalidf("descriptor: geometry: section size overflows")
	}
	return nil
}

// SectionSize returns the octets of one raw K (or V) section of a full
// block: block_tokens x kv_heads x head_dim x sizeof(kv_dtype) (R-CNT-10).
func (d *Descriptor) SectionSize() uint64 {
	return uint64(d.BlockTokens) * uint64(d.KVHeads) * uint64(d.HeadDim) * uint64(d.KVDType.Size())
}

// Canonical returns the validated descriptor in canonical form: positional
// parameters in the order of decision A-30.
func (d Descriptor) Canonical() (Descriptor, error) {
	if err := d.Validate(); err != nil {
		return Descriptor{}, err
	}
	p, _ := ParsePositional(d.Positional)
	d.Positional = p.String()
	return d, nil
}

// JCS returns the RFC 8785 canonical JSON of the canonical descriptor
// (R-CMP-14).
func (d Descriptor) JCS() ([]byte, error) {
	c, err := d.Canonical()
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(&c, json.Deterministic(true))
	if err != nil {
		return nil, fmt.Errorf("kvsp: encoding descriptor: %w", err)
	}
	out, err := jcs.Transform(b)
	if err != nil {
		return nil, fmt.Errorf("kvsp: canonicalizing descriptor: %w", err)
	}
	return out, nil
}

// CompatID returns SHA-256("KVSP-COMPAT-1" || 0x00 || JCS(descriptor))
// (R-CMP-13).
func (d Descriptor) CompatID() (CompatID, error) {
	j, err := d.JCS()
	if err != nil {
		return CompatID{}, err
	}
	h := sha256.New()
	h.Write([]byte(compatLabel))
	h.Write(j)
	var c CompatID
	h.Sum(c[:0])
	return c, nil
}

// Positional is a parsed "positional" member: a "KVSP Positional Encodings"
// name and its parameters (R-CMP-9, R-REG-8, A-30).
type Positional struct {
	Name    string // "rope" or "none"
	Theta   uint64 // RoPE base; 0 when absent (the model's default)
	Scaling string // RoPE scaling method; "" when absent
}

// MaxScalingNameLen bounds a RoPE scaling method name.
const MaxScalingNameLen = 32

// ParsePositional parses
//
//	none | rope [ ";" param *( "," param ) ]
//	param = "theta=" decimal-integer | "scaling=" name
//
// accepting the parameters in either order, each at most once. theta is a
// decimal integer without sign, exponent or leading zeros; a scaling name is
// lowercase ASCII letters, digits, "-" and "_".
func ParsePositional(s string) (Positional, error) {
	name, params, hasParams := strings.Cut(s, ";")
	switch name {
	case "none":
		if hasParams {
			return Positional{}, invalidf("positional: \"none\" takes no parameters")
		}
		return Positional{Name: name}, nil
	case "rope":
	default:
		return Positional{}, invalidf("positional: not in the KVSP Positional Encodings registry")
	}
	p := Positional{Name: name}
	if !hasParams {
		return p, nil
	}
	if params == "" {
		return Positional{}, invalidf("positional: empty parameter list")
	}
	for _, kv := range strings.Split(params, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || v == "" {
			return Positional{}, invalidf("positional: parameter must be name=value")
		}
		switch k {
		case "theta":
			if p.Theta != 0 {
				return Positional{}, invalidf("positional: theta given twice")
			}
			if v[0] == '0' || strings.IndexFunc(v, func(r rune) bool { return r < '0' || r > '9' }) >= 0 {
				return Positional{}, invalidf("positional: theta must be a positive decimal integer without leading zeros")
			}
			t, err := strconv.ParseUint(v, 10, 64)
			if err != nil || t > MaxJSONInt {
				return Positional{}, invalidf("positional: theta out of range")
			}
			p.Theta = t
		case "scaling":
			if p.Scaling != "" {
				return Positional{}, invalidf("positional: scaling given twice")
			}
			if len(v) > MaxScalingNameLen || strings.IndexFunc(v, func(r rune) bool {
				return !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '_')
			}) >= 0 {
				return Positional{}, invalidf("positional: scaling must be a lowercase name of at most %d characters", MaxScalingNameLen)
			}
			p.Scaling = v
		default:
			return Positional{}, invalidf("positional: unknown rope parameter")
		}
	}
	return p, nil
}

// WithoutDefaults drops parameters equal to the model's defaults, as the
// canonical form requires (A-30: "omit parameters equal to model defaults").
// Pass 0 or "" for a default the model does not have.
func (p Positional) WithoutDefaults(defaultTheta uint64, defaultScaling string) Positional {
	if p.Theta == defaultTheta {
		p.Theta = 0
	}
	if p.Scaling == defaultScaling {
		p.Scaling = ""
	}
	return p
}

// String returns the canonical form: "rope", "rope;theta=N",
// "rope;theta=N,scaling=S", "rope;scaling=S" or "none".
func (p Positional) String() string {
	if p.Name != "rope" || (p.Theta == 0 && p.Scaling == "") {
		return p.Name
	}
	var b strings.Builder
	b.WriteString("rope;")
	if p.Theta != 0 {
		b.WriteString("theta=")
		b.WriteString(strconv.FormatUint(p.Theta, 10))
		if p.Scaling != "" {
			b.WriteByte(',')
		}
	}
	if p.Scaling != "" {
		b.WriteString("scaling=")
		b.WriteString(p.Scaling)
	}
	return b.String()
}

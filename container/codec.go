package container

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync"
)

// Codec is an entry of the "KVSP Codecs" registry: how one K or V section
// of a block is encoded. Holders may transcode on "codec=n" (R-BLK-5);
// transcoded representations are protected only by Repr-Digest (R-BLK-11).
type Codec interface {
	// ID is the 16-bit registry value.
	ID() uint16
	// Name is the registry name: lowercase letters, digits and "-".
	Name() string
	// SectionLen returns the octets of one section of a full block.
	SectionLen(g Geometry) uint64
	// FromRaw encodes one raw section (kvsp-layout-1, g.Elem) into dst,
	// which has SectionLen(g) octets.
	FromRaw(dst, raw []byte, g Geometry) error
	// ToRaw decodes one section into dst, a raw section of g.Elem.
	ToRaw(dst, section []byte, g Geometry) error
}

// Registered codec values.
const (
	CodecRaw uint16 = 0x0001
	// CodecFP8Head is this project's private-use codec (R-REG-5): FP8
	// E4M3 with one float32 scale per head, see [FP8Head].
	CodecFP8Head uint16 = 0xFF01
)

var (
	codecsMu sync.RWMutex
	codecs   = map[uint16]Codec{CodecRaw: Raw{}, CodecFP8Head: FP8Head{}}
)

// LookupCodec returns the registered codec for v, or nil.
func LookupCodec(v uint16) Codec {
	codecsMu.RLock()
	defer codecsMu.RUnlock()
	return codecs[v]
}

// RegisterCodec adds a codec, for private-use values agreed between
// parties. Values 0 and 1 cannot be replaced.
func RegisterCodec(c Codec) error {
	if c.ID() <= CodecRaw {
		return fmt.Errorf("container: codec 0x%04x cannot be registered", c.ID())
	}
	codecsMu.Lock()
	defer codecsMu.Unlock()
	codecs[c.ID()] = c
	return nil
}

// Raw is codec 0x0001, "raw": uncompressed elements in layout
// "kvsp-layout-1" (R-CNT-10).
type Raw struct{}

// ID implements Codec.
func (Raw) ID() uint16 { return CodecRaw }

// Name implements Codec.
func (Raw) Name() string { return "raw" }

// SectionLen implements Codec.
func (Raw) SectionLen(g Geometry) uint64 { return g.RawSectionLen() }

// FromRaw implements Codec.
func (Raw) FromRaw(dst, raw []byte, g Geometry) error {
	if uint64(len(raw)) != g.RawSectionLen() || len(dst) != len(raw) {
		return fmt.Errorf("%w: raw section of %d octets, want %d", ErrMalformed, len(raw), g.RawSectionLen())
	}
	copy(dst, raw)
	return nil
}

// ToRaw implements Codec.
func (r Raw) ToRaw(dst, section []byte, g Geometry) error { return r.FromRaw(dst, section, g) }

// FP8Head is codec 0xFF01, "kvsp-fp8-e4m3-head" (private use): each section
// holds kv_heads float32 scales (little-endian), then the block's elements
// in kvsp-layout-1 order as FP8 E4M3 codes. The scale of head h is
// max|x|/448 over that head's elements of the section, so every element
// is in range.
//
// Error bound: for an element x of a head with scale s, the decoded value
// x' (before rounding to the raw element type) satisfies
//
//	|x' - x| <= 2^-4 |x| + 2^-10 s
//
// (half an E4M3 unit in the last place for normal codes, half the subnormal
// step 2^-9 s otherwise); decoding to bf16 adds at most 2^-9 |x'|, to fp16
// 2^-11 |x'| (or its subnormal step). Sections shrink to about 1/2 (from
// 16-bit types) or 1/4 (from fp32). Non-finite inputs are refused; such a
// block is served in its own codec.
type FP8Head struct{}

// ID implements Codec.
func (FP8Head) ID() uint16 { return CodecFP8Head }

// Name implements Codec.
func (FP8Head) Name() string { return "kvsp-fp8-e4m3-head" }

// SectionLen implements Codec.
func (FP8Head) SectionLen(g Geometry) uint64 { return 4*uint64(g.KVHeads) + g.Elements() }

func (FP8Head) check(dst, raw []byte, g Geometry) error {
	switch g.Elem {
	case BF16, FP16, FP32:
	default:
		return fmt.Errorf("%w: %s elements cannot be transcoded to fp8 scales", ErrUnsupportedCodec, g.Elem)
	}
	if uint64(len(raw)) != g.RawSectionLen() || uint64(len(dst)) != (FP8Head{}).SectionLen(g) {
		return fmt.Errorf("%w: section lengths do not match the geometry", ErrMalformed)
	}
	return nil
}

func loadElem(t ElemType, b []byte, i int) float32 {
	switch t {
	case BF16:
		return bf16ToF32(binary.LittleEndian.Uint16(b[2*i:]))
	case FP16:
		return fp16ToF32(binary.LittleEndian.Uint16(b[2*i:]))
	}
	return math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
}

func storeElem(t ElemType, b []byte, i int, f float32) {
	switch t {
	case BF16:
		binary.LittleEndian.PutUint16(b[2*i:], f32ToBF16(f))
	case FP16:
		binary.LittleEndian.PutUint16(b[2*i:], f32ToFP16(f))
	default:
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(f))
	}
}

// FromRaw implements Codec.
func (c FP8Head) FromRaw(dst, raw []byte, g Geometry) error {
	if err := c.check(dst, raw, g); err != nil {
		return err
	}
	heads, dim := int(g.KVHeads), int(g.HeadDim)
	tokens := int(g.BlockTokens)
	codes := dst[4*heads:]
	for h := 0; h < heads; h++ {
		var m float32
		for t := 0; t < tokens; t++ {
			base := (t*heads + h) * dim
			for d := 0; d < dim; d++ {
				x := loadElem(g.Elem, raw, base+d)
				if x != x || math.IsInf(float64(x), 0) {
					return fmt.Errorf("%w: non-finite element", ErrMalformed)
				}
				if x < 0 {
					x = -x
				}
				m = max(m, x)
			}
		}
		s := m / fp8e4m3Max
		binary.LittleEndian.PutUint32(dst[4*h:], math.Float32bits(s))
		inv := float32(0)
		if s > 0 {
			inv = 1 / s
		}
		for t := 0; t < tokens; t++ {
			base := (t*heads + h) * dim
			for d := 0; d < dim; d++ {
				codes[base+d] = f32ToFP8E4M3(loadElem(g.Elem, raw, base+d) * inv)
			}
		}
	}
	return nil
}

// ToRaw implements Codec.
func (c FP8Head) ToRaw(dst, section []byte, g Geometry) error {
	if err := c.check(section, dst, g); err != nil {
		return err
	}
	heads, dim := int(g.KVHeads), int(g.HeadDim)
	codes := section[4*heads:]
	for i := range codes {
		h := (i / dim) % heads
		s := math.Float32frombits(binary.LittleEndian.Uint32(section[4*h:]))
		storeElem(g.Elem, dst, i, fp8e4m3ToF32(codes[i])*s)
	}
	return nil
}

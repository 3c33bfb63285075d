package container

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Wire constants of the header (R-CNT-1..6, A-9).
const (
	Magic          = 0x4B564231 // "KVB1"
	Version        = 1
	FixedHeaderLen = 20 // Magic, Version, Flags, Codec, First Layer, Layer Count, Token Count
	LayerEntryLen  = 16 // K Length and V Length, 64 bits each
)

// Errors. Every parse or verification failure wraps one of them.
var (
	// ErrMalformed: the octets are not a valid container for the geometry
	// . A holder answers 400 on PUT.
	ErrMalformed = errors.New("container: malformed")
	// ErrDigestMismatch: a layer or container digest differs from the one
	// expected (R-BLK-8..10). Maps to kvsp-digest-mismatch.
	ErrDigestMismatch = errors.New("container: digest mismatch")
	// ErrTruncated: the stream ended inside the header or a layer.
	ErrTruncated = fmt.Errorf("%w: truncated", ErrMalformed)
	// ErrUnsupportedCodec: no codec is registered for the header's value.
	ErrUnsupportedCodec = errors.New("container: unsupported codec")
)

// LayerLen is the pair of section lengths of one layer, in octets.
type LayerLen struct {
	K, V uint64
}

// Header is a parsed KVB1 header.
type Header struct {
	Codec      uint16
	FirstLayer uint32
	TokenCount uint32
	// Layers has one entry per layer, in ascending order; its length is
	// the Layer Count.
	Layers []LayerLen
}

// LayerCount returns the number of layers in the container.
func (h *Header) LayerCount() int { return len(h.Layers) }

// LastLayer returns the index of the last layer.
func (h *Header) LastLayer() uint32 { return h.FirstLayer + uint32(len(h.Layers)) - 1 }

// Len returns the octets of the encoded header: 20 + 16 x Layer Count.
func (h *Header) Len() int { return HeaderLen(len(h.Layers)) }

// HeaderLen returns the header octets for n layers.
func HeaderLen(n int) int { return FixedHeaderLen + LayerEntryLen*n }

// DataLen returns the octets after the header: the sum of all sections.
func (h *Header) DataLen() uint64 {
	var n uint64
	for _, l := range h.Layers {
		n += l.K + l.V
	}
	return n
}

// Size returns the whole container's octets.
func (h *Header) Size() uint64 { return uint64(h.Len()) + h.DataLen() }

// Append appends the encoded header to b (Version 1, Flags 0).
func (h *Header) Append(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, Magic)
	b = append(b, Version, 0)
	b = binary.BigEndian.AppendUint16(b, h.Codec)
	b = binary.BigEndian.AppendUint32(b, h.FirstLayer)
	b = binary.BigEndian.AppendUint32(b, uint32(len(h.Layers)))
	b = binary.BigEndian.AppendUint32(b, h.TokenCount)
	for _, l := range h.Layers {
		b = binary.BigEndian.AppendUint64(b, l.K)
		b = binary.BigEndian.AppendUint64(b, l.V)
	}
	return b
}

// Geometry is what a receiver knows of the model before it reads a
// container: the descriptor's cache geometry (R-CMP-7, R-CMP-11). Every
// length in a header is checked against it before anything is allocated.
type Geometry struct {
	Layers      uint32 // the model's layers
	BlockTokens uint32 // B
	KVHeads     uint32
	HeadDim     uint32
	Elem        ElemType // kv_dtype
}

// Elements returns the elements of one full-block section:
// B x kv_heads x head_dim.
func (g Geometry) Elements() uint64 {
	return uint64(g.BlockTokens) * uint64(g.KVHeads) * uint64(g.HeadDim)
}

// RawSectionLen returns the octets of one raw section of a full block.
func (g Geometry) RawSectionLen() uint64 { return g.Elements() * uint64(g.Elem.Size()) }

// Unknown reports the zero Geometry: a receiver without the model's
// descriptor (a holder serving as a cache server for any compat_id). A
// header is then checked for what needs no descriptor: Magic,
// Version 1, Flags 0, a non-zero Codec, Layer Count >= 1, layer indices
// that do not overflow, and section lengths whose sum the caller compares
// with the container's size; Token Count, the codec's section lengths and
// the model's layer count are left to the consumer, who has the
// descriptor.
func (g Geometry) Unknown() bool { return g == Geometry{} }

// maxUnknownData bounds the section lengths of a header parsed without a
// geometry, so that their sum cannot wrap around.
const maxUnknownData = 1 << 62

// Validate reports a geometry that cannot describe a cache.
func (g Geometry) Validate() error {
	if g.Layers == 0 || g.BlockTokens == 0 || g.KVHeads == 0 || g.HeadDim == 0 {
		return fmt.Errorf("%w: geometry has a zero dimension", ErrMalformed)
	}
	if g.Elem.Size() == 0 {
		return fmt.Errorf("%w: unknown element type", ErrMalformed)
	}
	if g.RawSectionLen() > 1<<40 {
		return fmt.Errorf("%w: section over 1 TiB", ErrMalformed)
	}
	return nil
}

// ParseHeader parses and validates the header at the start of b against g
// Magic, Version 1, Flags 0, a registered non-zero Codec, Layer
// Count >= 1, First Layer + Layer Count <= g.Layers, Token Count = B, and
// every section length equal to what the codec makes of the geometry. It
// returns the header and its length. A b too short for the header gives an
// error wrapping ErrTruncated (and io.ErrUnexpectedEOF); nothing is
// allocated before Layer Count has been checked.
func ParseHeader(b []byte, g Geometry) (Header, int, error) {
	var h Header
	if len(b) < FixedHeaderLen {
		return h, 0, truncated("header")
	}
	if binary.BigEndian.Uint32(b) != Magic {
		return h, 0, fmt.Errorf("%w: magic is not KVB1", ErrMalformed)
	}
	n, err := parseFixed(b[:FixedHeaderLen], g, &h)
	if err != nil {
		return Header{}, 0, err
	}
	hl := HeaderLen(n)
	if len(b) < hl {
		return Header{}, 0, truncated("header")
	}
	h.Layers = make([]LayerLen, n)
	if err := parseLengths(b[FixedHeaderLen:hl], g, &h); err != nil {
		return Header{}, 0, err
	}
	return h, hl, nil
}

// parseFixed checks the 20 fixed octets and returns the Layer Count.
func parseFixed(b []byte, g Geometry, h *Header) (int, error) {
	if !g.Unknown() {
		if err := g.Validate(); err != nil {
			return 0, err
		}
	}
	if binary.BigEndian.Uint32(b) != Magic {
		return 0, fmt.Errorf("%w: magic is not KVB1", ErrMalformed)
	}
	if b[4] != Version {
		return 0, fmt.Errorf("%w: version %d, only 1 is defined", ErrMalformed, b[4])
	}
	if b[5] != 0 {
		return 0, fmt.Errorf("%w: reserved flags set", ErrMalformed)
	}
	h.Codec = binary.BigEndian.Uint16(b[6:])
	h.FirstLayer = binary.BigEndian.Uint32(b[8:])
	count := binary.BigEndian.Uint32(b[12:])
	h.TokenCount = binary.BigEndian.Uint32(b[16:])
	switch {
	case h.Codec == 0:
		return 0, fmt.Errorf("%w: codec 0 is reserved", ErrMalformed)
	case count == 0:
		return 0, fmt.Errorf("%w: layer count 0", ErrMalformed)
	case g.Unknown():
		if uint64(h.FirstLayer)+uint64(count) > 1<<32 {
			return 0, fmt.Errorf("%w: layers past 2^32", ErrMalformed)
		}
		return int(count), nil // the codec and Token Count are the consumer's to check
	case uint64(h.FirstLayer)+uint64(count) > uint64(g.Layers):
		return 0, fmt.Errorf("%w: layers %d..%d beyond the model's %d", ErrMalformed, h.FirstLayer, uint64(h.FirstLayer)+uint64(count)-1, g.Layers)
	case h.TokenCount != g.BlockTokens:
		return 0, fmt.Errorf("%w: token count %d, block_tokens is %d", ErrMalformed, h.TokenCount, g.BlockTokens)
	}
	if LookupCodec(h.Codec) == nil {
		return 0, fmt.Errorf("%w: 0x%04x", ErrUnsupportedCodec, h.Codec)
	}
	return int(count), nil
}

// parseLengths reads the length pairs into h.Layers and checks each
// against the codec's section length for the geometry.
func parseLengths(b []byte, g Geometry, h *Header) error {
	if g.Unknown() {
		var sum uint64
		for i := range h.Layers {
			k := binary.BigEndian.Uint64(b[LayerEntryLen*i:])
			v := binary.BigEndian.Uint64(b[LayerEntryLen*i+8:])
			if k > maxUnknownData || v > maxUnknownData || sum+k+v > maxUnknownData {
				return fmt.Errorf("%w: section lengths past 2^62 octets", ErrMalformed)
			}
			sum += k + v
			h.Layers[i] = LayerLen{k, v}
		}
		return nil
	}
	want := LookupCodec(h.Codec).SectionLen(g)
	for i := range h.Layers {
		k := binary.BigEndian.Uint64(b[LayerEntryLen*i:])
		v := binary.BigEndian.Uint64(b[LayerEntryLen*i+8:])
		if k != want || v != want {
			return fmt.Errorf("%w: layer %d sections are %d+%d octets, codec 0x%04x makes %d", ErrMalformed, h.FirstLayer+uint32(i), k, v, h.Codec, want)
		}
		h.Layers[i] = LayerLen{k, v}
	}
	return nil
}

func truncated(where string) error {
	return fmt.Errorf("%w in %s: %w", ErrTruncated, where, io.ErrUnexpectedEOF)
}

// NewHeader returns the header of a container of layers
// [first, first+count) for codec c and geometry g.
func NewHeader(c uint16, first, count uint32, g Geometry) (Header, error) {
	codec := LookupCodec(c)
	if codec == nil {
		return Header{}, fmt.Errorf("%w: 0x%04x", ErrUnsupportedCodec, c)
	}
	if err := g.Validate(); err != nil {
		return Header{}, err
	}
	if count == 0 || uint64(first)+uint64(count) > uint64(g.Layers) {
		return Header{}, fmt.Errorf("%w: layers %d+%d outside 0..%d", ErrMalformed, first, count, g.Layers-1)
	}
	n := codec.SectionLen(g)
	h := Header{Codec: c, FirstLayer: first, TokenCount: g.BlockTokens, Layers: make([]LayerLen, count)}
	for i := range h.Layers {
		h.Layers[i] = LayerLen{n, n}
	}
	return h, nil
}

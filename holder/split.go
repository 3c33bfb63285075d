package holder

import (
	"crypto/sha256"
	"io"

	"github.com/kvsp/kvsp/container"
)

// layerSpan is layers [i, j) (indexes in the block) of a stored block: the
// header and size of its container, shared by the ranges whose octets are
// not one host buffer.
type layerSpan struct {
	e    *entry
	i, j int
}

// header appends the range's container header to dst.
func (r layerSpan) header(dst []byte) []byte {
	h := r.e.hdr
	h.FirstLayer += uint32(r.i)
	h.Layers = h.Layers[r.i:r.j]
	return h.Append(dst)
}

// first and last are the range's layers (inclusive), as the block
// numbers them.
func (r layerSpan) first() uint32 { return r.e.hdr.FirstLayer + uint32(r.i) }
func (r layerSpan) last() uint32  { return r.e.hdr.FirstLayer + uint32(r.j) - 1 }

// spanOf is layers first..last of e.
func spanOf(e *entry, first, last uint32) layerSpan {
	return layerSpan{e: e, i: int(first - e.hdr.FirstLayer), j: int(last-e.hdr.FirstLayer) + 1}
}

// headerBytes is the range's container header.
func (r layerSpan) headerBytes() []byte {
	return r.header(make([]byte, 0, container.HeaderLen(r.j-r.i)))
}

// Len returns the octets of the range's container.
func (r layerSpan) Len() int64 {
	return int64(container.HeaderLen(r.j-r.i)) + r.e.layerOffset(r.j) - r.e.layerOffset(r.i)
}

// digestOf is the container digest of what r writes (one pass over its
// octets); an error is a device read's (a hash.Hash never fails).
func digestOf(r io.WriterTo) (container.Digest, error) {
	h := sha256.New()
	if _, err := r.WriteTo(h); err != nil {
		return container.Digest{}, err
	}
	var d container.Digest
	h.Sum(d[:0])
	return d, nil
}

// splitRange is a range of a block split between device memory (its first
// devLayers layers) and a host tail: a GET sends its header, then the
// device layers through the device's double-buffered pinned staging
// (tier.Device.WriteRange), then the host layers straight from the tail.
type splitRange struct {
	layerSpan
	b splitBlock
}

// WriteTo writes the range's container to w.
func (r splitRange) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(r.headerBytes())
	total := int64(n)
	if err != nil {
		return total, err
	}
	a, b := r.e.layerOffset(r.i), r.e.layerOffset(r.j)
	devEnd := r.e.layerOffset(r.b.devLayers)
	if a < devEnd {
		n, err := r.b.d.WriteRange(w, r.b.dev, a, min(b, devEnd)-a)
		total += n
		if err != nil {
			return total, err
		}
	}
	if b > devEnd {
		n, err := w.Write(r.b.tail[max(a, devEnd)-devEnd : b-devEnd])
		total += int64(n)
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// Digest returns the range's container digest.
func (r splitRange) Digest() (container.Digest, error) { return digestOf(r) }

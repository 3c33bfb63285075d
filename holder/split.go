package holder

import (
	"crypto/sha256"
	"io"

	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder/tier"
)

// splitRange is layers [i, j) (indexes in the block) of a block split
// between device memory (its first devLayers layers) and a host tail: a
// GET sends its header, then the device layers through the device's
// double-buffered pinned staging (tier.Device.WriteRange), then the host
// layers straight from the tail.
type splitRange struct {
	d    *tier.Device
	e    *entry
	p    parts
	i, j int
}

func (r splitRange) header(dst []byte) []byte {
	h := r.e.hdr
	h.FirstLayer += uint32(r.i)
	h.Layers = h.Layers[r.i:r.j]
	return h.Append(dst)
}

// Len returns the octets of the range's container.
func (r splitRange) Len() int64 {
	return int64(container.HeaderLen(r.j-r.i)) + r.e.layerOffset(r.j) - r.e.layerOffset(r.i)
}

// WriteTo writes the range's container to w.
func (r splitRange) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(r.header(make([]byte, 0, container.HeaderLen(r.j-r.i))))
	total := int64(n)
	if err != nil {
		return total, err
	}
	a, b := r.e.layerOffset(r.i), r.e.layerOffset(r.j)
	devEnd := r.e.layerOffset(r.p.devLayers)
	if a < devEnd {
		n, err := r.d.WriteRange(w, r.p.dev, a, min(b, devEnd)-a)
		total += n
		if err != nil {
			return total, err
		}
	}
	if b > devEnd {
		n, err := w.Write(r.p.tail[max(a, devEnd)-devEnd : b-devEnd])
		total += int64(n)
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// Digest returns the range's container digest (one pass over its octets).
func (r splitRange) Digest() (container.Digest, error) {
	h := sha256.New()
	if _, err := r.WriteTo(h); err != nil { // a hash.Hash never fails: a device read did
		return container.Digest{}, err
	}
	var d container.Digest
	h.Sum(d[:0])
	return d, nil
}

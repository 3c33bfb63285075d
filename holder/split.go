package holder

import (
	"crypto/sha256"
	"io"
	"sync"

	"github.com/kvsp/kvsp/container"
)

// splitRange is layers [i, j) (indexes in the block) of a block split
// between device memory (its first devLayers layers) and a host tail: a
// GET sends its header, then the device layers copied out through a
// staging buffer, then the host layers straight from the tail.
type splitRange struct {
	e    *entry
	p    parts
	i, j int
}

// stagingSize is the device-to-host copy unit: large enough to amortise a
// copy's launch, small enough to overlap copying with sending.
const stagingSize = 1 << 20

var staging = sync.Pool{New: func() any { b := make([]byte, stagingSize); return &b }}

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
		bp := staging.Get().(*[]byte)
		defer staging.Put(bp)
		for off := a; off < min(b, devEnd); {
			chunk := (*bp)[:min(int64(len(*bp)), min(b, devEnd)-off)]
			if err := r.p.dev.CopyOut(chunk, off); err != nil {
				return total, err
			}
			n, err := w.Write(chunk)
			total += int64(n)
			if err != nil {
				return total, err
			}
			off += int64(len(chunk))
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
func (r splitRange) Digest() container.Digest {
	h := sha256.New()
	r.WriteTo(h) // a hash.Hash never fails; a device copy error leaves a digest no client accepts
	var d container.Digest
	h.Sum(d[:0])
	return d
}

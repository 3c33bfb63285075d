package container

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
)

// Layer is one layer yielded by a Reader. K and V alias the Reader's buffer
// and are valid until the next call to Next.
type Layer struct {
	Index  uint32 // the layer number in the model
	K, V   []byte
	Digest Digest
}

// Reader decodes a container from a stream, layer by layer. Next returns a
// layer only when all its octets have arrived and its digest has been
// checked against the expected one (if set), so a consumer can use layer l
// while l+1 is in flight; a stream cut inside a layer gives an error and
// never a partial layer. Lengths are checked against the Geometry before
// the layer buffer is allocated (once, for the largest layer).
type Reader struct {
	r       io.Reader
	g       Geometry
	h       Header
	hdrDone bool
	next    int
	buf     []byte
	fixed   [FixedHeaderLen]byte
	lens    []byte // the length pairs of the header
	sum     []byte // Sum's output, reused
	layer   hash.Hash
	whole   hash.Hash
	digests []Digest
	expect  []Digest // indexed by model layer; nil: not checked
	expectC Digest
	checkC  bool
	err     error
}

// NewReader returns a Reader of one container from r, for geometry g.
func NewReader(r io.Reader, g Geometry) *Reader {
	rd := &Reader{layer: sha256.New(), whole: sha256.New()}
	rd.Reset(r, g)
	return rd
}

// Reset prepares the Reader for another container, keeping its buffers
// and dropping expectations.
func (r *Reader) Reset(src io.Reader, g Geometry) {
	layers := r.h.Layers[:0]
	*r = Reader{r: src, g: g, buf: r.buf, lens: r.lens, sum: r.sum, layer: r.layer, whole: r.whole, digests: r.digests[:0]}
	r.h.Layers = layers
	r.layer.Reset()
	r.whole.Reset()
}

// ExpectLayerDigests makes Next check each layer against d[layer], where d
// is indexed by model layer as a Replica Record's layer_digests.
func (r *Reader) ExpectLayerDigests(d []Digest) { r.expect = d }

// ExpectContainerDigest makes the end of the stream check the container
// digest (the Repr-Digest of the response).
func (r *Reader) ExpectContainerDigest(d Digest) { r.expectC, r.checkC = d, true }

// fill reads p completely; layer < 0 means the header. Errors are
// formatted only when they happen: reading allocates nothing.
func (r *Reader) fill(p []byte, layer int64) error {
	if _, err := io.ReadFull(r.r, p); err != nil {
		where := "header"
		if layer >= 0 {
			where = fmt.Sprintf("layer %d", layer)
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return truncated(where)
		}
		return fmt.Errorf("container: reading %s: %w", where, err)
	}
	r.whole.Write(p)
	return nil
}

// Header reads and validates the header.
func (r *Reader) Header() (*Header, error) {
	if r.hdrDone || r.err != nil {
		return &r.h, r.err
	}
	r.hdrDone = true
	if r.err = r.fill(r.fixed[:], -1); r.err != nil {
		return &r.h, r.err
	}
	n, err := parseFixed(r.fixed[:], r.g, &r.h)
	if err != nil {
		r.err = err
		return &r.h, err
	}
	if cap(r.lens) < LayerEntryLen*n { // n <= g.Layers, checked above
		r.lens = make([]byte, LayerEntryLen*n)
	}
	lens := r.lens[:LayerEntryLen*n]
	if r.err = r.fill(lens, -1); r.err != nil {
		return &r.h, r.err
	}
	if cap(r.h.Layers) < n {
		r.h.Layers = make([]LayerLen, n)
	}
	r.h.Layers = r.h.Layers[:n]
	if r.err = parseLengths(lens, r.g, &r.h); r.err != nil {
		return &r.h, r.err
	}
	need := r.h.Layers[0].K + r.h.Layers[0].V // all layers have the codec's lengths
	if uint64(cap(r.buf)) < need {
		r.buf = make([]byte, need)
	}
	r.buf = r.buf[:need]
	return &r.h, nil
}

// Next returns the next layer, or io.EOF after the last one once the
// stream has been checked to end there and, if expected, the container
// digest matched.
func (r *Reader) Next() (Layer, error) {
	if _, err := r.Header(); err != nil {
		return Layer{}, err
	}
	if r.err != nil {
		return Layer{}, r.err
	}
	if r.next == len(r.h.Layers) {
		r.err = r.finish()
		if r.err == nil {
			r.err = io.EOF
		}
		return Layer{}, r.err
	}
	l := r.h.Layers[r.next]
	idx := r.h.FirstLayer + uint32(r.next)
	if r.err = r.fill(r.buf, int64(idx)); r.err != nil {
		return Layer{}, r.err
	}
	r.layer.Reset()
	r.layer.Write(r.buf)
	r.sum = r.layer.Sum(r.sum[:0])
	d := Digest(r.sum)
	if r.expect != nil {
		if int(idx) >= len(r.expect) || r.expect[idx] != d {
			r.err = fmt.Errorf("%w: layer %d", ErrDigestMismatch, idx)
			return Layer{}, r.err
		}
	}
	r.digests = append(r.digests, d)
	r.next++
	return Layer{Index: idx, K: r.buf[:l.K:l.K], V: r.buf[l.K:], Digest: d}, nil
}

// finish checks that nothing follows the last layer (A-9: the sum of the
// lengths is the body) and the container digest.
func (r *Reader) finish() error {
	n, err := io.ReadFull(r.r, r.fixed[:1]) // the header buffer is free by now
	if n > 0 {
		return fmt.Errorf("%w: octets after the last layer", ErrMalformed)
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("container: reading after the last layer: %w", err)
	}
	if r.checkC {
		r.sum = r.whole.Sum(r.sum[:0])
		if Digest(r.sum) != r.expectC {
			return fmt.Errorf("%w: container", ErrDigestMismatch)
		}
	}
	return nil
}

// Digests returns the digests of the layers read so far and, after Next
// returned io.EOF, of the container.
func (r *Reader) Digests() Digests {
	d := Digests{Layers: r.digests}
	if r.err == io.EOF {
		r.sum = r.whole.Sum(r.sum[:0])
		d.Container = Digest(r.sum)
	}
	return d
}

package container

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
)

// Digests are what a Writer or Reader computed while the octets passed.
type Digests struct {
	// Layers holds the layer digest of each layer of the container, in
	// order (index 0 is the First Layer).
	Layers []Digest
	// Container is the SHA-256 of the whole container (Repr-Digest).
	Container Digest
}

// Writer streams a container to an io.Writer in ascending layer order,
// without assembling it in memory. Byte-slice layers are handed to the
// destination as they are (no copy here; a TLS connection's sealing is the
// only copy). Each octet is hashed once for its layer digest and once for
// the container digest as it passes.
//
// Writers are reusable with Reset; a Writer allocates nothing per layer.
type Writer struct {
	w       io.Writer
	h       Header
	next    int
	layer   hash.Hash
	whole   hash.Hash
	digests []Digest
	hdr     []byte
	sum     []byte // Sum's output, reused: a Digest passed to Sum would escape
	buf     []byte // staging for WriteLayerFrom
	err     error
	n       int64
}

// NewWriter returns a Writer of the container with header h to w. The
// header is written with the first layer.
func NewWriter(w io.Writer, h Header) *Writer {
	wr := &Writer{layer: sha256.New(), whole: sha256.New()}
	wr.Reset(w, h)
	return wr
}

// Reset prepares the Writer for another container, keeping its buffers.
func (w *Writer) Reset(dst io.Writer, h Header) {
	w.w, w.h, w.next, w.err, w.n = dst, h, 0, nil, 0
	w.layer.Reset()
	w.whole.Reset()
	w.digests = w.digests[:0]
	w.hdr = h.Append(w.hdr[:0])
	if h.LayerCount() == 0 {
		w.err = fmt.Errorf("%w: no layers", ErrMalformed)
	}
}

// Written returns the octets written so far.
func (w *Writer) Written() int64 { return w.n }

func (w *Writer) write(p []byte) error {
	if len(p) == 0 {
		return nil
	}
	w.whole.Write(p)
	n, err := w.w.Write(p)
	w.n += int64(n)
	if err == nil && n != len(p) {
		err = io.ErrShortWrite
	}
	return err
}

func (w *Writer) begin(klen, vlen uint64) error {
	if w.err != nil {
		return w.err
	}
	if w.next >= len(w.h.Layers) {
		return fmt.Errorf("%w: more layers than the header's %d", ErrMalformed, len(w.h.Layers))
	}
	if l := w.h.Layers[w.next]; l.K != klen || l.V != vlen {
		return fmt.Errorf("%w: layer %d sections are %d+%d octets, header says %d+%d", ErrMalformed, w.h.FirstLayer+uint32(w.next), klen, vlen, l.K, l.V)
	}
	if w.next == 0 {
		if err := w.write(w.hdr); err != nil {
			w.err = err
			return err
		}
	}
	w.layer.Reset()
	return nil
}

func (w *Writer) end() {
	w.sum = w.layer.Sum(w.sum[:0])
	w.digests = append(w.digests, Digest(w.sum))
	w.next++
}

// WriteLayer writes the next layer's K and V sections.
func (w *Writer) WriteLayer(k, v []byte) error {
	if err := w.begin(uint64(len(k)), uint64(len(v))); err != nil {
		return err
	}
	for _, s := range [2][]byte{k, v} {
		w.layer.Write(s)
		if err := w.write(s); err != nil {
			w.err = err
			return err
		}
	}
	w.end()
	return nil
}

// writerChunk is the staging size of WriteLayerFrom.
const writerChunk = 256 << 10

// WriteLayerFrom writes the next layer from readers that yield exactly the
// header's section lengths (for example pinned staging buffers filled by a
// device copy). A reader that ends early fails the container.
func (w *Writer) WriteLayerFrom(k, v io.Reader) error {
	if w.next >= len(w.h.Layers) {
		return w.begin(0, 0)
	}
	l := w.h.Layers[w.next]
	if err := w.begin(l.K, l.V); err != nil {
		return err
	}
	if w.buf == nil {
		w.buf = make([]byte, writerChunk)
	}
	for _, s := range [2]struct {
		r io.Reader
		n uint64
	}{{k, l.K}, {v, l.V}} {
		for rest := s.n; rest > 0; {
			chunk := w.buf[:min(rest, uint64(len(w.buf)))]
			if _, err := io.ReadFull(s.r, chunk); err != nil {
				if errors.Is(err, io.EOF) {
					err = io.ErrUnexpectedEOF
				}
				w.err = fmt.Errorf("container: layer %d source: %w", w.h.FirstLayer+uint32(w.next), err)
				return w.err
			}
			w.layer.Write(chunk)
			if err := w.write(chunk); err != nil {
				w.err = err
				return err
			}
			rest -= uint64(len(chunk))
		}
	}
	w.end()
	return nil
}

// Close checks that every layer was written and returns the digests. The
// Layers slice is the Writer's and valid until Reset.
func (w *Writer) Close() (Digests, error) {
	if w.err != nil {
		return Digests{}, w.err
	}
	if w.next != len(w.h.Layers) {
		return Digests{}, fmt.Errorf("%w: %d of %d layers written", ErrMalformed, w.next, len(w.h.Layers))
	}
	w.sum = w.whole.Sum(w.sum[:0])
	return Digests{Layers: w.digests, Container: Digest(w.sum)}, nil
}

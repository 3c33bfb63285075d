package container

import (
	"crypto/sha256"
	"fmt"
	"io"
	"runtime"
	"sync"
)

// Block is a validated container held in memory, ready to serve whole or by
// layer range. Its layer digests and container digest are computed once,
// when it is opened, never per request.
type Block struct {
	data    []byte
	h       Header
	hl      int      // header octets
	offs    []uint64 // offset in data of each layer's K section, plus the end
	layers  []Digest // layer digests, index 0 = First Layer
	whole   Digest
	replica Digest // over this container's layers
}

// OpenBlock validates data as one complete container for g (A-9: the
// lengths add up to exactly len(data)) and computes its layer digests and
// container digest in one pass over the octets, spread over cores when
// there are several. data is kept, not copied: the caller must not change
// it afterwards.
func OpenBlock(data []byte, g Geometry) (*Block, error) {
	h, hl, err := ParseHeader(data, g)
	if err != nil {
		return nil, err
	}
	if size := h.Size(); uint64(len(data)) != size {
		if uint64(len(data)) < size {
			return nil, truncated("data")
		}
		return nil, fmt.Errorf("%w: %d octets after the last layer", ErrMalformed, uint64(len(data))-size)
	}
	b := &Block{data: data, h: h, hl: hl, offs: make([]uint64, len(h.Layers)+1), layers: make([]Digest, len(h.Layers))}
	off := uint64(hl)
	for i, l := range h.Layers {
		b.offs[i] = off
		off += l.K + l.V
	}
	b.offs[len(h.Layers)] = off
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the container digest is sequential: one core for it
		defer wg.Done()
		b.whole = sha256.Sum256(data)
	}()
	hashLayers(b.layers, data, b.offs, runtime.GOMAXPROCS(0)-1)
	wg.Wait()
	b.replica = ReplicaDigest(b.layers)
	return b, nil
}

// AdoptBlock returns the Block of data, a complete container for g whose
// layer digests and container digest were computed when this process
// received it (a holder moving a verified block between its own tiers, or
// reassembling it from them): the structure is validated again, the octets
// are not hashed again. data is kept, not copied.
func AdoptBlock(data []byte, g Geometry, layers []Digest, whole Digest) (*Block, error) {
	h, hl, err := ParseHeader(data, g)
	if err != nil {
		return nil, err
	}
	if uint64(len(data)) != h.Size() || len(layers) != len(h.Layers) {
		return nil, fmt.Errorf("%w: %d octets and %d digests for a container of %d octets and %d layers", ErrMalformed, len(data), len(layers), h.Size(), len(h.Layers))
	}
	b := &Block{data: data, h: h, hl: hl, offs: make([]uint64, len(h.Layers)+1), layers: layers, whole: whole}
	off := uint64(hl)
	for i, l := range h.Layers {
		b.offs[i] = off
		off += l.K + l.V
	}
	b.offs[len(h.Layers)] = off
	b.replica = ReplicaDigest(layers)
	return b, nil
}

// hashLayers computes the digest of each layer [offs[i], offs[i+1]) with up
// to `workers` goroutines (at least one).
func hashLayers(out []Digest, data []byte, offs []uint64, workers int) {
	workers = max(1, min(workers, len(out)))
	if workers == 1 {
		for i := range out {
			out[i] = sha256.Sum256(data[offs[i]:offs[i+1]])
		}
		return
	}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < len(out); i += workers {
				out[i] = sha256.Sum256(data[offs[i]:offs[i+1]])
			}
		}(w)
	}
	wg.Wait()
}

// Verify checks layer digests against want, indexed by model layer (a
// Replica Record's layer_digests), for every layer of the block.
func (b *Block) Verify(want []Digest) error {
	for i, d := range b.layers {
		l := b.h.FirstLayer + uint32(i)
		if int(l) >= len(want) || want[l] != d {
			return fmt.Errorf("%w: layer %d", ErrDigestMismatch, l)
		}
	}
	return nil
}

// Header returns the block's header; do not modify it.
func (b *Block) Header() *Header { return &b.h }

// Bytes returns the stored container; do not modify it.
func (b *Block) Bytes() []byte { return b.data }

// LayerDigests returns the layer digests, index 0 = First Layer.
func (b *Block) LayerDigests() []Digest { return b.layers }

// ContainerDigest returns the SHA-256 of the whole container.
func (b *Block) ContainerDigest() Digest { return b.whole }

// ReplicaDigest returns the replica digest over the block's layers; for a
// block of all the model's layers it is the Replica Record's digest.
func (b *Block) ReplicaDigest() Digest { return b.replica }

// PayloadSize returns the octets of the K and V sections (a Replica
// Record's size, A-1).
func (b *Block) PayloadSize() uint64 { return b.offs[len(b.offs)-1] - uint64(b.hl) }

// Layer returns the K and V sections of model layer l, without copying.
func (b *Block) Layer(l uint32) (k, v []byte, err error) {
	i := int64(l) - int64(b.h.FirstLayer)
	if i < 0 || i >= int64(len(b.h.Layers)) {
		return nil, nil, fmt.Errorf("container: layer %d not in this block", l)
	}
	off := b.offs[i]
	mid := off + b.h.Layers[i].K
	return b.data[off:mid:mid], b.data[mid:b.offs[i+1]], nil
}

// Full returns the view of the whole block.
func (b *Block) Full() View { return View{b: b, i: 0, j: len(b.h.Layers)} }

// Range returns the view of model layers first..last inclusive (the
// "layers=a-b" query): O(1), no allocation, no copy.
func (b *Block) Range(first, last uint32) (View, error) {
	i := int64(first) - int64(b.h.FirstLayer)
	j := int64(last) - int64(b.h.FirstLayer) + 1
	if first > last || i < 0 || j > int64(len(b.h.Layers)) {
		return View{}, fmt.Errorf("container: layers %d-%d not in this block (%d-%d)", first, last, b.h.FirstLayer, b.h.LastLayer())
	}
	return View{b: b, i: int(i), j: int(j)}, nil
}

// View is a layer range of a stored Block: a header of its own followed by
// one contiguous slice of the block's data.
type View struct {
	b    *Block
	i, j int // layer indexes within the block, half-open
}

// FirstLayer returns the view's first model layer.
func (v View) FirstLayer() uint32 { return v.b.h.FirstLayer + uint32(v.i) }

// LayerCount returns the view's number of layers.
func (v View) LayerCount() int { return v.j - v.i }

// IsFull reports whether the view is the whole stored container.
func (v View) IsFull() bool { return v.i == 0 && v.j == len(v.b.h.Layers) }

// HeaderLen returns the octets of the view's header.
func (v View) HeaderLen() int { return HeaderLen(v.j - v.i) }

// Len returns the octets of the view's container.
func (v View) Len() int64 { return int64(v.HeaderLen()) + int64(v.b.offs[v.j]-v.b.offs[v.i]) }

// Data returns the view's sections: a subslice of the stored block.
func (v View) Data() []byte { return v.b.data[v.b.offs[v.i]:v.b.offs[v.j]] }

// AppendHeader appends the view's header to dst.
func (v View) AppendHeader(dst []byte) []byte {
	if v.IsFull() {
		return append(dst, v.b.data[:v.b.hl]...)
	}
	h := Header{Codec: v.b.h.Codec, FirstLayer: v.FirstLayer(), TokenCount: v.b.h.TokenCount, Layers: v.b.h.Layers[v.i:v.j]}
	return h.Append(dst)
}

// headerPool recycles header buffers of views, so that serving a range
// allocates nothing in steady state.
var headerPool = sync.Pool{New: func() any { b := make([]byte, 0, HeaderLen(128)); return &b }}

// WriteTo writes the view's container to w: its header, then the stored
// sections in one Write, so the stored memory goes to the connection
// without a copy here.
func (v View) WriteTo(w io.Writer) (int64, error) {
	bp := headerPool.Get().(*[]byte)
	hdr := v.AppendHeader((*bp)[:0])
	n, err := w.Write(hdr)
	*bp = hdr[:0]
	headerPool.Put(bp)
	if err != nil {
		return int64(n), err
	}
	m, err := w.Write(v.Data())
	return int64(n + m), err
}

// Digest returns the container digest of the view, for Repr-Digest. The
// whole block's is stored; a range costs one SHA-256 over its octets
// (holders cache it per range).
func (v View) Digest() Digest {
	if v.IsFull() {
		return v.b.whole
	}
	bp := headerPool.Get().(*[]byte)
	hdr := v.AppendHeader((*bp)[:0])
	h := sha256.New()
	h.Write(hdr)
	h.Write(v.Data())
	*bp = hdr[:0]
	headerPool.Put(bp)
	var d Digest
	h.Sum(d[:0])
	return d
}

// LayerDigests returns the layer digests of the view's layers.
func (v View) LayerDigests() []Digest { return v.b.layers[v.i:v.j] }

// VerifyParallel parses data as a complete container for g and checks every
// layer against want (indexed by model layer), spreading the layers over
// `workers` goroutines (GPU nodes have many cores); want == nil only
// computes. It returns the layer digests.
func VerifyParallel(data []byte, g Geometry, want []Digest, workers int) ([]Digest, error) {
	h, hl, err := ParseHeader(data, g)
	if err != nil {
		return nil, err
	}
	if uint64(len(data)) != h.Size() {
		return nil, fmt.Errorf("%w: body is %d octets, header says %d", ErrMalformed, len(data), h.Size())
	}
	offs := make([]uint64, len(h.Layers)+1)
	off := uint64(hl)
	for i, l := range h.Layers {
		offs[i] = off
		off += l.K + l.V
	}
	offs[len(h.Layers)] = off
	out := make([]Digest, len(h.Layers))
	hashLayers(out, data, offs, workers)
	if want != nil {
		for i, d := range out {
			l := h.FirstLayer + uint32(i)
			if int(l) >= len(want) || want[l] != d {
				return out, fmt.Errorf("%w: layer %d", ErrDigestMismatch, l)
			}
		}
	}
	return out, nil
}

// Block returns the stored block the view is of.
func (v View) Block() *Block { return v.b }

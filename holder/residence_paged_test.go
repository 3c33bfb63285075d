//go:build nogpu

package holder

import (
	"bytes"
	"fmt"
	"io"

	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// pagedBlock is a test tier, and the proof that a new place for blocks is
// one file: a block held as one host buffer per layer (as a paged engine
// keeps K and V), in the host tier's registry name. It implements the five
// methods of residence; TestResidenceConformance runs it with one line.
type pagedBlock struct {
	e      *entry
	layers [][]byte // K then V of each layer
}

func pagedResidence(t *testing.T, s *store, blk *container.Block) residence {
	p := pagedBlock{e: newEntry(id(9), blk, bigGeom)}
	for l := range bigGeom.Layers {
		k, v, _ := blk.Layer(l)
		p.layers = append(p.layers, append(bytes.Clone(k), v...))
	}
	return p
}

func (p pagedBlock) where() kvsp.Tier { return kvsp.TierHost }

func (p pagedBlock) residency(layers uint32, r rates) []kvsp.Residency {
	return whole(kvsp.TierHost, layers, r.host)
}

func (p pagedBlock) body(span layerSpan) (rangeBody, error) { return pagedRange{span, p}, nil }

func (p pagedBlock) materialize() (*container.Block, func(), error) {
	var buf bytes.Buffer
	if _, err := (pagedRange{spanOf(p.e, p.e.hdr.FirstLayer, p.e.hdr.LastLayer()), p}).WriteTo(&buf); err != nil {
		return nil, nil, err
	}
	blk, err := container.AdoptBlock(buf.Bytes(), p.e.g, p.e.layers, p.e.whole)
	return blk, func() {}, err
}

func (p pagedBlock) expose(x RDMA, client string, span layerSpan) ([]kvsp.RDMASegment, func(), error) {
	var xs exposures
	var err error
	for i := span.i; i < span.j && err == nil; i++ {
		addr, rkey, rel, xerr := x.Expose(client, nil, p.layers[i])
		err = xs.add(addr, rkey, rel, uint64(len(p.layers[i])), xerr)
	}
	return xs.done(err)
}

type pagedRange struct {
	layerSpan
	p pagedBlock
}

func (r pagedRange) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(r.headerBytes())
	total := int64(n)
	for i := r.i; i < r.j && err == nil; i++ {
		n, err = w.Write(r.p.layers[i])
		total += int64(n)
	}
	if err != nil {
		return total, fmt.Errorf("paged: %w", err)
	}
	return total, nil
}

func (r pagedRange) Digest() (container.Digest, error) { return digestOf(r) }

package holder

import (
	"fmt"
	"io"
	"strconv"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/tier"
)

// residence is where one stored block's layers live while a GET, an RDMA
// read or a replica record uses them: one implementation per kind of
// place (host memory, read back from local storage, split between device
// and host memory, an attached engine's pages). The store is the only
// code that tells the kinds apart (residenceLocked); everything that
// serves, exposes or describes a block goes through this interface, and
// TestResidenceConformance runs every implementation, so a new place is
// one file and one line of that test.
type residence interface {
	// where names the tier its octets are read from (the metrics' tier
	// label).
	where() kvsp.Tier
	// residency is what a replica record says of layers 0..layers-1:
	// which tier holds each, read at which rate (R-IS residency).
	residency(layers uint32, r rates) []kvsp.Residency
	// body is span's layers as a container (its length, digest and
	// octets), as a GET sends it.
	body(span layerSpan) (rangeBody, error)
	// materialize returns the whole container in host memory, and what
	// gives that memory back.
	materialize() (*container.Block, func(), error)
	// expose lets an RDMA client read span's section octets in place:
	// the segments, in order, and what ends the exposure.
	expose(x RDMA, client string, span layerSpan) ([]kvsp.RDMASegment, func(), error)
}

// rangeBody is a range of a block as a GET writes it.
type rangeBody interface {
	io.WriterTo
	Len() int64
	Digest() (container.Digest, error)
}

// rates are the read rates a holder advertises per tier (Config's
// ReadMbitPerS, DeviceReadMbitPerS, DiskReadMbitPerS).
type rates struct{ host, device, disk uint64 }

// whole is one residency entry of every layer.
func whole(t kvsp.Tier, layers uint32, rate uint64) []kvsp.Residency {
	return []kvsp.Residency{{Tier: t, Layers: kvsp.LayerRange{0, layers - 1}, ReadMbitPerS: rate}}
}

// exposures collects the segments of one RDMA exposure.
type exposures struct {
	segs     []kvsp.RDMASegment
	releases []func()
}

func (x *exposures) add(addr uint64, rkey uint32, release func(), n uint64, err error) error {
	if err != nil {
		return fmt.Errorf("%w: registering the block for RDMA: %v", kvsp.ErrUnavailable, err)
	}
	x.releases = append(x.releases, release)
	x.segs = append(x.segs, kvsp.RDMASegment{Addr: strconv.FormatUint(addr, 16), RKey: rkey, Length: n})
	return nil
}

func (x *exposures) end() {
	for _, r := range x.releases {
		r()
	}
}

// done returns the segments, or ends them on err.
func (x *exposures) done(err error) ([]kvsp.RDMASegment, func(), error) {
	if err == nil && len(x.segs) == 0 {
		err = fmt.Errorf("%w: no octets to expose", kvsp.ErrUnavailable)
	}
	if err != nil {
		x.end()
		return nil, nil, err
	}
	return x.segs, x.end, nil
}

// hostBlock is a block in the host tier: the whole container in the
// holder's own memory.
type hostBlock struct{ blk *container.Block }

func (b hostBlock) where() kvsp.Tier { return kvsp.TierHost }

func (b hostBlock) residency(layers uint32, r rates) []kvsp.Residency {
	return whole(kvsp.TierHost, layers, r.host)
}

func (b hostBlock) body(span layerSpan) (rangeBody, error) {
	v, err := b.blk.Range(span.first(), span.last())
	if err != nil {
		return nil, fmt.Errorf("%w: layers %d-%d", kvsp.ErrLayersUnavailable, span.first(), span.last())
	}
	return hostRange{v}, nil
}

func (b hostBlock) materialize() (*container.Block, func(), error) { return b.blk, func() {}, nil }

// expose registers the holder's memory once for all the blocks it will
// hold in it (mem is the whole allocation).
func (b hostBlock) expose(x RDMA, client string, span layerSpan) ([]kvsp.RDMASegment, func(), error) {
	mem := b.blk.Bytes()
	return b.exposeIn(x, client, span, mem[:cap(mem)])
}

func (b hostBlock) exposeIn(x RDMA, client string, span layerSpan, mem []byte) ([]kvsp.RDMASegment, func(), error) {
	v, err := b.blk.Range(span.first(), span.last())
	if err != nil {
		return nil, nil, fmt.Errorf("%w: layers %d-%d", kvsp.ErrLayersUnavailable, span.first(), span.last())
	}
	var xs exposures
	addr, rkey, rel, err := x.Expose(client, mem, v.Data())
	return xs.done(xs.add(addr, rkey, rel, uint64(len(v.Data())), err))
}

// hostRange is a range of a block in host memory.
type hostRange struct{ container.View }

// Digest returns the range's container digest.
func (r hostRange) Digest() (container.Digest, error) { return r.View.Digest(), nil }

// diskBlock is a block of the local-storage tier, read back (decrypted
// and verified) into memory of its own for one use.
type diskBlock struct{ hostBlock }

func (b diskBlock) where() kvsp.Tier { return kvsp.TierLocalStorage }

func (b diskBlock) residency(layers uint32, r rates) []kvsp.Residency {
	return whole(kvsp.TierLocalStorage, layers, r.disk)
}

// expose registers the read-back copy for this read only (no mem).
func (b diskBlock) expose(x RDMA, client string, span layerSpan) ([]kvsp.RDMASegment, func(), error) {
	return b.exposeIn(x, client, span, nil)
}

// splitBlock is a block split between device memory (its first devLayers
// layers, back to back, no header) and a host tail (the rest).
type splitBlock struct {
	d         *tier.Device
	dev       tier.DeviceBuffer
	devLayers int
	tail      []byte
	e         *entry
	bufs      *bufferPool // for materialize's copy
}

func (b splitBlock) where() kvsp.Tier { return kvsp.TierDevice }

// residency says exactly which layers are where.
func (b splitBlock) residency(layers uint32, r rates) []kvsp.Residency {
	d := uint32(b.devLayers)
	res := []kvsp.Residency{{Tier: kvsp.TierDevice, Layers: kvsp.LayerRange{0, d - 1}, ReadMbitPerS: r.device}}
	if d < layers {
		res = append(res, kvsp.Residency{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{d, layers - 1}, ReadMbitPerS: r.host})
	}
	return res
}

func (b splitBlock) body(span layerSpan) (rangeBody, error) {
	return splitRange{layerSpan: span, b: b}, nil
}

// materialize assembles the whole container in a pooled host buffer:
// the header, the device layers copied out, the tail.
func (b splitBlock) materialize() (*container.Block, func(), error) {
	e := b.e
	buf := b.bufs.get(int(e.octets))
	out := e.hdr.Append(buf[:0])
	hl := len(out)
	out = out[:hl+int(b.dev.Len())]
	if err := b.dev.CopyOut(out[hl:], 0); err != nil {
		b.bufs.put(buf)
		return nil, nil, err
	}
	out = append(out, b.tail...)
	blk, err := container.AdoptBlock(out, e.g, e.layers, e.whole)
	if err != nil {
		b.bufs.put(buf)
		return nil, nil, err
	}
	return blk, func() { b.bufs.put(blk.Bytes()) }, nil
}

// expose gives a device segment (GPUDirect RDMA) and a host one, as the
// span's layers fall.
func (b splitBlock) expose(x RDMA, client string, span layerSpan) ([]kvsp.RDMASegment, func(), error) {
	var xs exposures
	var err error
	a, c := span.e.layerOffset(span.i), span.e.layerOffset(span.j)
	devEnd := span.e.layerOffset(b.devLayers)
	if a < devEnd {
		n := uint64(min(c, devEnd) - a)
		addr, rkey, rel, xerr := x.ExposeDevice(client, b.dev, uint64(a), n)
		err = xs.add(addr, rkey, rel, n, xerr)
	}
	if err == nil && c > devEnd {
		part := b.tail[max(a, devEnd)-devEnd : c-devEnd]
		addr, rkey, rel, xerr := x.Expose(client, b.tail[:cap(b.tail)], part)
		err = xs.add(addr, rkey, rel, uint64(len(part)), xerr)
	}
	return xs.done(err)
}

// attachedBlock is a block in an attached engine's pages (device memory
// the engine lent), gathered for each read.
type attachedBlock struct {
	d  *tier.Device
	at *attached
}

func (b attachedBlock) where() kvsp.Tier { return kvsp.TierDevice }

func (b attachedBlock) residency(layers uint32, r rates) []kvsp.Residency {
	return whole(kvsp.TierDevice, layers, r.device)
}

func (b attachedBlock) body(span layerSpan) (rangeBody, error) {
	return attachedRange{layerSpan: span, d: b.d, at: b.at}, nil
}

func (b attachedBlock) materialize() (*container.Block, func(), error) {
	blk, err := b.at.a.read(b.at)
	return blk, func() {}, err
}

// expose refuses: the engine's pages are not one region per block.
func (b attachedBlock) expose(RDMA, string, layerSpan) ([]kvsp.RDMASegment, func(), error) {
	return nil, nil, fmt.Errorf("%w: the block is in an engine's pages; GET it", kvsp.ErrUnavailable)
}

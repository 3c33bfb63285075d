package client

import (
	"context"
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// RDMAReader reads remote memory by one-sided RDMA READ, one queue pair
// per holder (rdma.Reader implements it).
type RDMAReader interface {
	// Endpoint returns this side's queue pair for holder (its base URI).
	Endpoint(holder string) (string, error)
	// Connect connects that queue pair (local, as Endpoint gave it) to
	// the holder's endpoint (once); an error if it is gone meanwhile.
	Connect(holder, local, remote string) error
	// Read reads len(dst) octets at addr with rkey from holder into dst.
	Read(ctx context.Context, holder string, dst []byte, addr uint64, rkey uint32) error
	// Buffer returns n octets to read into (registered once, from a
	// pool) and the release that gives them back.
	Buffer(n int) ([]byte, func(), error)
}

// ReadBlockRDMA reads a block (or o.Layers of it) by RDMA READ: the
// holder authorizes the request as a GET and exposes the octets (POST
// rdma/reads), r reads them, and the container is verified as a GET's is:
// every layer digest against o.LayerDigests when given (R-BLK-9), the
// whole against the holder's Repr-Digest (R-BLK-8). The exposure is ended
// before it returns. The block lies in one of r's buffers: release gives
// it back once the caller is done with the block. Errors leave the caller
// free to GET instead.
func (h *Holder) ReadBlockRDMA(ctx context.Context, b BlockRef, g container.Geometry, o GetOptions, r RDMAReader) (blk *container.Block, release func(), err error) {
	ep, err := r.Endpoint(h.base)
	if err != nil {
		return nil, nil, err
	}
	q := &kvsp.RDMAReadRequest{ScopeID: b.Scope, CompatID: b.Compat, BlockKey: b.Key, Layers: o.Layers, Endpoint: ep}
	var x kvsp.RDMAReadResponse
	if _, _, err := h.c.doJSON(ctx, http.MethodPost, join(h.base, "rdma/reads"), q, &x); err != nil {
		return nil, nil, err
	}
	defer func() { // end the exposure now rather than at its TTL
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		h.c.doJSON(dctx, http.MethodDelete, join(h.base, "rdma/reads/"+x.ID), nil, nil)
	}()
	hdr, err := hex.DecodeString(x.Header)
	if err != nil || len(hdr) < container.HeaderLen(1) || len(hdr) > container.HeaderLen(int(g.Layers)) {
		return nil, nil, fmt.Errorf("%w: rdma read: header", kvsp.ErrInvalid)
	}
	segs := []kvsp.RDMASegment{{Addr: x.Addr, RKey: x.RKey, Length: x.Length}} // validated by Decode
	segs = append(segs, x.More...)
	want, err := container.ParseReprDigest(x.ReprDigest)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: rdma read: %v", kvsp.ErrDigestMismatch, err)
	}
	maxBlock := uint64(container.HeaderLen(int(g.Layers))) + 2*uint64(g.Layers)*g.RawSectionLen()
	var total uint64
	for _, s := range segs { // each below 2^53: no overflow
		total += s.Length
	}
	if total > maxBlock {
		return nil, nil, fmt.Errorf("%w: rdma read of %d octets: a block of this geometry is at most %d", kvsp.ErrInvalid, total, maxBlock)
	}
	if err := r.Connect(h.base, ep, x.Endpoint); err != nil {
		return nil, nil, err
	}
	buf, rel, err := r.Buffer(len(hdr) + int(total))
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			rel()
		}
	}()
	copy(buf, hdr)
	at := len(hdr)
	for _, s := range segs {
		addr, _ := strconv.ParseUint(s.Addr, 16, 64)
		if err := r.Read(ctx, h.base, buf[at:at+int(s.Length)], addr, s.RKey); err != nil {
			return nil, nil, fmt.Errorf("client: rdma read: %w", err)
		}
		at += int(s.Length)
	}
	blk, err = container.OpenBlock(buf, g)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: rdma read: %v", kvsp.ErrDigestMismatch, err)
	}
	if o.Layers != nil && (blk.Header().FirstLayer != o.Layers[0] || blk.Header().LastLayer() != o.Layers[1]) {
		return nil, nil, fmt.Errorf("%w: rdma read: layers %d-%d, asked %d-%d", kvsp.ErrInvalid, blk.Header().FirstLayer, blk.Header().LastLayer(), o.Layers[0], o.Layers[1])
	}
	if blk.ContainerDigest() != want {
		return nil, nil, fmt.Errorf("%w: rdma read: Repr-Digest", kvsp.ErrDigestMismatch)
	}
	if o.LayerDigests != nil && (o.ReplicaCodec == 0 || blk.Header().Codec == o.ReplicaCodec) {
		if err := blk.Verify(o.LayerDigests); err != nil {
			return nil, nil, fmt.Errorf("%w: rdma read: %v", kvsp.ErrDigestMismatch, err)
		}
	}
	return blk, rel, nil
}

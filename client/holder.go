package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// Holder is a client of a holder's blocks and leases.
type Holder struct {
	c    *Client
	base string
}

// Holder returns a client of the holder at base.
func (c *Client) Holder(base string) *Holder { return &Holder{c, base} }

// BlockRef names a block resource: blocks/{compat}/{scope}/{block_key}.
type BlockRef struct {
	Compat kvsp.CompatID
	Scope  kvsp.ScopeID
	Key    kvsp.BlockKey
}

func (h *Holder) blockURL(b BlockRef) string {
	return join(h.base, "blocks/"+b.Compat.String()+"/"+b.Scope.String()+"/"+b.Key.String())
}

// GetOptions select what a GET asks for.
type GetOptions struct {
	// Layers, when set, asks for the inclusive range (layers=a-b).
	Layers *kvsp.LayerRange
	// Codec, when non-zero, asks for a codec (codec=n); the answer may
	// still be in the native codec.
	Codec uint16
	// LayerDigests, indexed by model layer (a Replica Record's
	// layer_digests), are checked layer by layer when the answer is in the
	// replica's codec (R-BLK-9).
	LayerDigests []container.Digest
	// ReplicaCodec is the record's codec: layer digests apply only to it.
	ReplicaCodec uint16
}

// BlockStream is a block being received: a container.Reader that yields
// each layer once it has arrived and verified, and checks Repr-Digest at
// the end (R-BLK-8). Close it.
type BlockStream struct {
	*container.Reader
	body   io.ReadCloser
	Header http.Header
}

// Close releases the response.
func (s *BlockStream) Close() error { return s.body.Close() }

// GetBlock starts a block GET for geometry g. The holder must send
// Repr-Digest (R-BLK-6); its absence is an error. A GET is retried on
// transport errors before the body starts; once layers flow, a failure is
// the caller's to handle (another replica, or recomputation: R-IS-10).
func (h *Holder) GetBlock(ctx context.Context, b BlockRef, g container.Geometry, o GetOptions) (*BlockStream, error) {
	url := h.blockURL(b)
	q := ""
	if o.Layers != nil {
		q = "?layers=" + strconv.FormatUint(uint64(o.Layers[0]), 10) + "-" + strconv.FormatUint(uint64(o.Layers[1]), 10)
	}
	if o.Codec != 0 {
		if q == "" {
			q = "?"
		} else {
			q += "&"
		}
		q += "codec=" + strconv.FormatUint(uint64(o.Codec), 10)
	}
	resp, err := h.c.doOn(h.c.bulk, ctx, http.MethodGet, url+q, http.Header{
		"Accept":          {kvsp.MediaTypeBlock + ", " + kvsp.MediaTypeProblem},
		"Accept-Encoding": {"identity"},
	}, nil)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, ProblemFrom(resp)
	}
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt != kvsp.MediaTypeBlock {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: block answered with Content-Type %q", kvsp.ErrInvalid, mt)
	}
	d, err := container.ParseReprDigest(resp.Header.Get("Repr-Digest"))
	if err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %v", kvsp.ErrDigestMismatch, err)
	}
	r := container.NewReader(resp.Body, g)
	r.ExpectContainerDigest(d)
	s := &BlockStream{Reader: r, body: resp.Body, Header: resp.Header}
	if o.LayerDigests != nil {
		hdr, err := r.Header()
		if err != nil {
			s.Close()
			return nil, err
		}
		if o.ReplicaCodec == 0 || hdr.Codec == o.ReplicaCodec {
			r.ExpectLayerDigests(o.LayerDigests)
		}
	}
	return s, nil
}

// ErrExists is returned by PutBlock when the holder already has a replica
// for the key and kept it (412, R-BLK-14).
var ErrExists = errors.New("client: the holder already has this block")

// PutBlock stores a container at the holder with If-None-Match: * and the
// container's Repr-Digest (R-BLK-12, A-4). It is not retried: the body is
// a stream.
func (h *Holder) PutBlock(ctx context.Context, b BlockRef, body io.Reader, size int64, digest container.Digest) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, h.blockURL(b), body)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	req.ContentLength = size
	req.Header.Set("Content-Type", kvsp.MediaTypeBlock)
	req.Header.Set("If-None-Match", "*")
	req.Header.Set("Repr-Digest", container.ReprDigest(digest))
	resp, err := h.c.bulk.Do(req)
	if err != nil {
		return fmt.Errorf("client: PUT block: %w", err)
	}
	if resp.StatusCode == http.StatusPreconditionFailed {
		resp.Body.Close()
		return ErrExists
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return ProblemFrom(resp)
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
	return resp.Body.Close()
}

// Lease asks for a lease on blocks (POST leases, A-2).
func (h *Holder) Lease(ctx context.Context, q *kvsp.LeaseRequest) (*kvsp.LeaseResponse, error) {
	var out kvsp.LeaseResponse
	if _, _, err := h.c.doJSON(ctx, http.MethodPost, join(h.base, "leases"), q, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RenewLease renews a lease (PUT leases/{id}).
func (h *Holder) RenewLease(ctx context.Context, id string, ttlMs uint64) (*kvsp.LeaseResponse, error) {
	var out kvsp.LeaseResponse
	if _, _, err := h.c.doJSON(ctx, http.MethodPut, join(h.base, "leases/"+id), &kvsp.LeaseRenewal{TTLMs: ttlMs}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ReleaseLease releases a lease (DELETE leases/{id}).
func (h *Holder) ReleaseLease(ctx context.Context, id string) error {
	_, _, err := h.c.doJSON(ctx, http.MethodDelete, join(h.base, "leases/"+id), nil, nil)
	return err
}

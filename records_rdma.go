package kvsp

import (
	"strconv"
)

// RDMAReadRequest is the body of POST {holder}rdma/reads, a kvsp
// extension (not in the draft): it asks a holder to expose a block's
// octets, or a layer range's, for one-sided RDMA READ by the client's
// queue pair. Authorization is a block GET's (scope first).
type RDMAReadRequest struct {
	ScopeID  ScopeID     `json:"scope_id"`
	CompatID CompatID    `json:"compat_id"`
	BlockKey BlockKey    `json:"block_key"`
	Layers   *LayerRange `json:"layers,omitempty"` // default: all the model's layers
	// Endpoint is the client's RC queue pair (package rdma's text form).
	Endpoint string `json:"endpoint"`
	// TTLMs bounds the exposure; the holder caps it. Default 10 s.
	TTLMs uint64 `json:"ttl_ms,omitempty"`
}

// Validate implements Validator.
func (q *RDMAReadRequest) Validate() error {
	switch {
	case q.ScopeID.IsZero():
		return invalidf("rdma read: scope_id: required")
	case q.CompatID.IsZero():
		return invalidf("rdma read: compat_id: required")
	case q.BlockKey.IsZero():
		return invalidf("rdma read: block_key: required")
	case q.Endpoint == "" || len(q.Endpoint) > 128:
		return invalidf("rdma read: endpoint: required, at most 128 characters")
	case q.Layers != nil && q.Layers[0] > q.Layers[1]:
		return invalidf("rdma read: layers: first after last")
	}
	return checkInt("rdma read: ttl_ms", q.TTLMs)
}

// RDMAReadResponse answers an RDMAReadRequest (201): where the octets are
// and how to check them. The client reads Length octets at Addr with RKey,
// then each of More in order (a block split between device and host
// memory is two segments), after the container header Header (hex):
// together they are the KVB1 container of the range, whose SHA-256 is
// ReprDigest. DELETE rdma/reads/{id} ends the exposure early.
type RDMAReadResponse struct {
	ID         string        `json:"id"`
	Endpoint   string        `json:"endpoint"` // the holder's queue pair
	Addr       string        `json:"addr"`     // hex: addresses may exceed 2^53
	RKey       uint32        `json:"rkey"`
	Length     uint64        `json:"length"`
	More       []RDMASegment `json:"more,omitempty"`
	Header     string        `json:"header"`
	ReprDigest string        `json:"repr_digest"`
	TTLMs      uint64        `json:"ttl_ms"`
}

// RDMASegment is further octets of an RDMA read, after the first.
type RDMASegment struct {
	Addr   string `json:"addr"` // hex
	RKey   uint32 `json:"rkey"`
	Length uint64 `json:"length"`
}

// MaxRDMASegments bounds the segments of one RDMA read.
const MaxRDMASegments = 4

// Validate implements Validator.
func (r *RDMAReadResponse) Validate() error {
	if _, err := strconv.ParseUint(r.Addr, 16, 64); err != nil || r.ID == "" || r.Endpoint == "" || r.Header == "" || r.ReprDigest == "" || r.Length == 0 {
		return invalidf("rdma read response: id, endpoint, addr (hex), length, header and repr_digest required")
	}
	if len(r.More) == 0 {
		r.More = nil // "more": [] is no more: one form for both
	}
	if len(r.More)+1 > MaxRDMASegments {
		return invalidf("rdma read response: more than %d segments", MaxRDMASegments)
	}
	for _, s := range r.More {
		if _, err := strconv.ParseUint(s.Addr, 16, 64); err != nil || s.Length == 0 {
			return invalidf("rdma read response: more: addr (hex) and length required")
		}
		if err := checkInt("rdma read response: more: length", s.Length); err != nil {
			return err
		}
	}
	if err := checkInt("rdma read response: ttl_ms", r.TTLMs); err != nil {
		return err
	}
	return checkInt("rdma read response: length", r.Length)
}

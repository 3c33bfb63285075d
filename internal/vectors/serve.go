package main

import (
	"bufio"
	"encoding/hex"
	"encoding/json"
	"io"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// query is one line of the helper protocol (vectors -serve): the Python
// property tests send inputs Hypothesis makes up and compare Go's answer
// with their own, over one long-lived process.
type query struct {
	Op       string        `json:"op"` // header, descriptor, keys, base_uri, record
	Hex      string        `json:"hex,omitempty"`
	Geometry *GeometryJSON `json:"geometry,omitempty"`
	JSON     string        `json:"json,omitempty"`
	Type     string        `json:"type,omitempty"`
	Input    string        `json:"input,omitempty"`
	ScopeKey string        `json:"scope_key,omitempty"`
	Compat   string        `json:"compat,omitempty"`
	B        int           `json:"b,omitempty"`
	Tokens   []uint32      `json:"tokens,omitempty"`
}

// answer is Go's result: ok, and what the input gave.
type answer struct {
	OK     bool       `json:"ok"`
	Kind   string     `json:"kind,omitempty"` // a refusal's sentinel
	Header *HeaderOut `json:"header,omitempty"`
	Value  string     `json:"value,omitempty"` // compat_id, normalized URI
	Keys   []string   `json:"keys,omitempty"`
}

// HeaderOut is a parsed header.
type HeaderOut struct {
	Codec      uint16      `json:"codec"`
	FirstLayer uint32      `json:"first_layer"`
	TokenCount uint32      `json:"token_count"`
	Layers     [][2]uint64 `json:"layers"`
	Len        int         `json:"len"`
}

// serve answers queries, one JSON line each, until in ends.
func serve(in io.Reader, out io.Writer) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	enc := json.NewEncoder(out)
	for sc.Scan() {
		var q query
		if err := json.Unmarshal(sc.Bytes(), &q); err != nil {
			return err
		}
		if err := enc.Encode(answerOf(&q)); err != nil {
			return err
		}
	}
	return sc.Err()
}

func refused(err error) answer {
	return answer{Kind: kvsp.ProblemFor(err).Unwrap().Error()}
}

func answerOf(q *query) answer {
	switch q.Op {
	case "header":
		b, err := hex.DecodeString(q.Hex)
		if err != nil {
			return answer{Kind: "bad query"}
		}
		g := container.Geometry{}
		if q.Geometry != nil {
			g = q.Geometry.geometry()
		}
		h, n, err := container.ParseHeader(b, g)
		if err != nil {
			return answer{Kind: "refused"}
		}
		ho := &HeaderOut{Codec: h.Codec, FirstLayer: h.FirstLayer, TokenCount: h.TokenCount, Len: n, Layers: [][2]uint64{}}
		for _, l := range h.Layers {
			ho.Layers = append(ho.Layers, [2]uint64{l.K, l.V})
		}
		return answer{OK: true, Header: ho}
	case "descriptor":
		d, err := kvsp.ParseDescriptor([]byte(q.JSON))
		if err != nil {
			return refused(err)
		}
		id, err := d.CompatID()
		if err != nil {
			return refused(err)
		}
		return answer{OK: true, Value: id.String()}
	case "keys":
		k, err := kvsp.ParseScopeKey([]byte(q.ScopeKey))
		if err != nil {
			return refused(err)
		}
		c, err := kvsp.ParseCompatID(q.Compat)
		if err != nil {
			return refused(err)
		}
		keys, err := kvsp.BlockKeys(k, c, q.B, q.Tokens)
		if err != nil {
			return refused(err)
		}
		a := answer{OK: true, Keys: []string{}}
		for _, x := range keys {
			a.Keys = append(a.Keys, x.String())
		}
		return a
	case "base_uri":
		n, err := kvsp.NormalizeBaseURI(q.Input)
		if err != nil {
			return refused(err)
		}
		return answer{OK: true, Value: n}
	case "record":
		var r kvsp.Validator
		switch q.Type {
		case "replica":
			r = new(kvsp.ReplicaRecord)
		case "lookup_request":
			r = new(kvsp.LookupRequest)
		case "status":
			r = new(kvsp.InstanceStatus)
		case "checkpoint":
			r = new(kvsp.Checkpoint)
		case "place_request":
			r = new(kvsp.PlaceRequest)
		default:
			return answer{Kind: "bad query"}
		}
		if err := kvsp.Decode([]byte(q.JSON), r); err != nil {
			return refused(err)
		}
		return answer{OK: true}
	}
	return answer{Kind: "bad query"}
}

package kvsp_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// sharedVectors is testdata/vectors/core.json's shape (internal/vectors
// writes it; python/tests/test_vectors.py reads it too).
type sharedVectors struct {
	Count       int `json:"count"`
	Descriptors []struct {
		Name, JSON, JCS, Error string
		JSONHex                string `json:"json_hex"`
		CompatID               string `json:"compat_id"`
	} `json:"descriptors"`
	ScopeKeys []struct {
		Name, Text, Error string
		ScopeID           string `json:"scope_id"`
	} `json:"scope_keys"`
	BlockKeys []struct {
		Name        string
		ScopeKey    string `json:"scope_key"`
		CompatID    string `json:"compat_id"`
		BlockTokens int    `json:"block_tokens"`
		Tokens      []uint32
		Keys        []string
	} `json:"block_keys"`
	Layers []struct {
		Name   string
		KHex   string `json:"k_hex"`
		VHex   string `json:"v_hex"`
		Digest string
	} `json:"layer_digests"`
	Replicas []struct {
		Name, Digest string
		Layers       []string
		ReprDigest   string `json:"repr_digest"`
	} `json:"replica_digests"`
	ReprFields []struct{ Name, Field, Digest, Error string } `json:"repr_digest_fields"`
	NewHeaders []struct {
		Name         string
		Geometry     geometryJSON
		Codec        uint16
		First, Count uint32
		Hex, Error   string
	} `json:"new_headers"`
	Headers []struct {
		Name       string
		Geometry   *geometryJSON
		Hex, Error string
		Codec      uint16
		FirstLayer uint32 `json:"first_layer"`
		TokenCount uint32 `json:"token_count"`
		Layers     [][2]uint64
		Len        int
	} `json:"headers"`
	Containers []struct {
		Name            string
		Geometry        geometryJSON
		Hex             string
		ExpectLayers    []string `json:"expect_layer_digests"`
		ExpectContainer string   `json:"expect_container_digest"`
		Layers          []struct {
			Index  uint32
			Digest string
		}
		Container string `json:"container_digest"`
		Error     string
	} `json:"containers"`
	Problems []struct {
		Name                    string
		HTTPStatus              int `json:"http_status"`
		Body, Type, Kind, Error string
		Status                  int
	} `json:"problems"`
	BaseURIs []struct {
		Name, Input, Normalized, Error string
		Valid                          bool
		ResourceID                     string `json:"resource_id"`
	} `json:"base_uris"`
	Records []struct{ Type, Name, JSON, Error, Kind string } `json:"records"`
	FP8     []struct {
		Name     string
		Geometry geometryJSON
		RawHex   string `json:"raw_hex"`
		FP8Hex   string `json:"fp8_hex"`
		BackHex  string `json:"back_hex"`
		Error    string
	} `json:"fp8_sections"`
}

type geometryJSON struct {
	Layers      uint32 `json:"layers"`
	BlockTokens uint32 `json:"block_tokens"`
	KVHeads     uint32 `json:"kv_heads"`
	HeadDim     uint32 `json:"head_dim"`
	Elem        string `json:"elem"`
}

func (g *geometryJSON) geometry() container.Geometry {
	if g == nil {
		return container.Geometry{}
	}
	e, _ := container.ParseElemType(g.Elem)
	return container.Geometry{Layers: g.Layers, BlockTokens: g.BlockTokens, KVHeads: g.KVHeads, HeadDim: g.HeadDim, Elem: e}
}

// TestSharedVectors runs every vector of the committed file against Go (issue
// 48: one set of vectors, run by both languages; the Python suite runs the
// same count). make test regenerates the file and fails if it moved.
func TestSharedVectors(t *testing.T) {
	b, err := os.ReadFile("testdata/vectors/core.json")
	if err != nil {
		t.Fatal(err)
	}
	var v sharedVectors
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	ran := 0
	for _, c := range v.Descriptors {
		in := []byte(c.JSON)
		if c.JSONHex != "" {
			in, _ = hex.DecodeString(c.JSONHex)
		}
		d, err := kvsp.ParseDescriptor(in)
		var j []byte
		var id kvsp.CompatID
		if err == nil {
			if j, err = d.JCS(); err == nil {
				id, err = d.CompatID()
			}
		}
		switch {
		case c.Error != "" && err == nil:
			t.Errorf("descriptor %q: accepted, want refused (%s)", c.Name, c.Error)
		case c.Error == "" && err != nil:
			t.Errorf("descriptor %q: %v", c.Name, err)
		case c.Error == "" && (string(j) != c.JCS || id.String() != c.CompatID):
			t.Errorf("descriptor %q: JCS %s, compat_id %s; want %s, %s", c.Name, j, id, c.JCS, c.CompatID)
		}
		ran++
	}
	for _, c := range v.ScopeKeys {
		k, err := kvsp.ParseScopeKey([]byte(c.Text))
		switch {
		case c.Error != "" && err == nil:
			t.Errorf("scope key %q: accepted, want refused", c.Name)
		case c.Error == "" && (err != nil || k.ID().String() != c.ScopeID):
			t.Errorf("scope key %q: %v, want scope_id %s", c.Name, err, c.ScopeID)
		}
		ran++
	}
	for _, c := range v.BlockKeys {
		k, err := kvsp.ParseScopeKey([]byte(c.ScopeKey))
		if err != nil {
			t.Fatal(err)
		}
		compat, _ := kvsp.ParseCompatID(c.CompatID)
		keys, err := kvsp.BlockKeys(k, compat, c.BlockTokens, c.Tokens)
		var got []string
		for _, x := range keys {
			got = append(got, x.String())
		}
		if err != nil || !slices.Equal(got, c.Keys) && len(got)+len(c.Keys) > 0 {
			t.Errorf("block keys %q: %v %v, want %v", c.Name, err, got, c.Keys)
		}
		// The incremental chain gives the same keys, token by token.
		ch, _ := kvsp.NewChain(k, compat, c.BlockTokens)
		var inc []string
		for _, tok := range c.Tokens {
			if ch.Push(tok) {
				last, _ := ch.Last()
				inc = append(inc, last.String())
			}
		}
		if !slices.Equal(inc, got) {
			t.Errorf("block keys %q: the chain gives %v, the bulk %v", c.Name, inc, got)
		}
		ran++
	}
	for _, c := range v.Layers {
		k, _ := hex.DecodeString(c.KHex)
		vv, _ := hex.DecodeString(c.VHex)
		if d := container.LayerDigest(k, vv); hex.EncodeToString(d[:]) != c.Digest {
			t.Errorf("layer digest %q: %x, want %s", c.Name, d, c.Digest)
		}
		ran++
	}
	for _, c := range v.Replicas {
		var ls []container.Digest
		for _, l := range c.Layers {
			var d container.Digest
			hex.Decode(d[:], []byte(l))
			ls = append(ls, d)
		}
		if d := container.ReplicaDigest(ls); hex.EncodeToString(d[:]) != c.Digest || container.ReprDigest(d) != c.ReprDigest {
			t.Errorf("replica digest %q: %x, want %s", c.Name, d, c.Digest)
		}
		ran++
	}
	for _, c := range v.ReprFields {
		d, err := container.ParseReprDigest(c.Field)
		switch {
		case c.Error != "" && err == nil:
			t.Errorf("Repr-Digest %q: accepted, want refused", c.Name)
		case c.Error == "" && (err != nil || hex.EncodeToString(d[:]) != c.Digest):
			t.Errorf("Repr-Digest %q: %v %x, want %s", c.Name, err, d, c.Digest)
		}
		ran++
	}
	for _, c := range v.NewHeaders {
		h, err := container.NewHeader(c.Codec, c.First, c.Count, c.Geometry.geometry())
		switch {
		case c.Error != "" && err == nil:
			t.Errorf("new header %q: made, want refused", c.Name)
		case c.Error == "" && (err != nil || hex.EncodeToString(h.Append(nil)) != c.Hex):
			t.Errorf("new header %q: %v %x, want %s", c.Name, err, h.Append(nil), c.Hex)
		}
		ran++
	}
	for _, c := range v.Headers {
		b, _ := hex.DecodeString(c.Hex)
		h, n, err := container.ParseHeader(b, c.Geometry.geometry())
		var layers [][2]uint64
		for _, l := range h.Layers {
			layers = append(layers, [2]uint64{l.K, l.V})
		}
		switch {
		case c.Error != "" && err == nil:
			t.Errorf("header %q: accepted, want refused (%s)", c.Name, c.Error)
		case c.Error == "" && (err != nil || h.Codec != c.Codec || h.FirstLayer != c.FirstLayer || h.TokenCount != c.TokenCount || n != c.Len || !slices.Equal(layers, c.Layers)):
			t.Errorf("header %q: %v %+v (%d octets)", c.Name, err, h, n)
		}
		ran++
	}
	for _, c := range v.Containers {
		b, _ := hex.DecodeString(c.Hex)
		r := container.NewReader(bytes.NewReader(b), c.Geometry.geometry())
		if c.ExpectLayers != nil {
			ds := make([]container.Digest, len(c.ExpectLayers))
			for i, x := range c.ExpectLayers {
				hex.Decode(ds[i][:], []byte(x))
			}
			r.ExpectLayerDigests(ds)
		}
		if c.ExpectContainer != "" {
			var d container.Digest
			hex.Decode(d[:], []byte(c.ExpectContainer))
			r.ExpectContainerDigest(d)
		}
		var got []string
		var err error
		for {
			var l container.Layer
			if l, err = r.Next(); err != nil {
				break
			}
			got = append(got, fmt.Sprintf("%d:%x", l.Index, l.Digest))
		}
		var want []string
		for _, l := range c.Layers {
			want = append(want, fmt.Sprintf("%d:%s", l.Index, l.Digest))
		}
		d := r.Digests().Container
		switch {
		case !slices.Equal(got, want):
			t.Errorf("container %q: layers %v, want %v", c.Name, got, want)
		case c.Error != "" && err == io.EOF:
			t.Errorf("container %q: read whole, want refused (%s)", c.Name, c.Error)
		case c.Error == "" && (err != io.EOF || hex.EncodeToString(d[:]) != c.Container):
			t.Errorf("container %q: %v, container digest %x", c.Name, err, d)
		}
		ran++
	}
	for _, c := range v.Problems {
		p, err := kvsp.ParseProblem([]byte(c.Body), c.HTTPStatus)
		switch {
		case c.Error != "" && err == nil:
			t.Errorf("problem %q: accepted, want refused", c.Name)
		case c.Error == "" && (err != nil || p.Type != c.Type || p.Status != c.Status || p.Unwrap() == nil || p.Unwrap().Error() != c.Kind):
			t.Errorf("problem %q: %v %+v, want %s %d %s", c.Name, err, p, c.Type, c.Status, c.Kind)
		}
		ran++
	}
	for _, c := range v.BaseURIs {
		n, err := kvsp.NormalizeBaseURI(c.Input)
		valid := kvsp.ValidateBaseURI("uri", c.Input) == nil
		switch {
		case valid != c.Valid:
			t.Errorf("base URI %q: valid %v, want %v", c.Name, valid, c.Valid)
		case c.Error != "" && err == nil:
			t.Errorf("base URI %q: normalized to %s, want refused", c.Name, n)
		case c.Error == "" && (err != nil || n != c.Normalized || kvsp.ResourceID(n) != c.ResourceID):
			t.Errorf("base URI %q: %v %s", c.Name, err, n)
		}
		ran++
	}
	for _, c := range v.Records {
		var r kvsp.Validator
		switch c.Type {
		case "replica":
			r = new(kvsp.ReplicaRecord)
		case "lease_request":
			r = new(kvsp.LeaseRequest)
		case "lease_response":
			r = new(kvsp.LeaseResponse)
		case "prefetch_directive":
			r = new(kvsp.PrefetchDirective)
		case "prefetch_status":
			r = new(kvsp.PrefetchStatus)
		case "lookup_request":
			r = new(kvsp.LookupRequest)
		case "lookup_response":
			r = new(kvsp.LookupResponse)
		case "status":
			r = new(kvsp.InstanceStatus)
		case "checkpoint":
			r = new(kvsp.Checkpoint)
		case "place_request":
			r = new(kvsp.PlaceRequest)
		case "place_response":
			r = new(kvsp.PlaceResponse)
		case "generate_request":
			r = new(kvsp.GenerateRequest)
		case "generated_token":
			r = new(kvsp.GeneratedToken)
		case "shard_map":
			r = new(kvsp.ShardMap)
		case "reshard":
			r = new(kvsp.Reshard)
		case "map_update":
			r = new(kvsp.MapUpdate)
		default:
			t.Fatalf("record %q: unknown type %q", c.Name, c.Type)
		}
		err := kvsp.Decode([]byte(c.JSON), r)
		if (err != nil) != (c.Error != "") || err != nil && kvsp.ProblemFor(err).Unwrap().Error() != c.Kind {
			t.Errorf("%s %q: %v, want error %q (%s)", c.Type, c.Name, err, c.Error, c.Kind)
		}
		ran++
	}
	for _, c := range v.FP8 {
		g := c.Geometry.geometry()
		raw, _ := hex.DecodeString(c.RawHex)
		codec := container.LookupCodec(container.CodecFP8Head)
		sec := make([]byte, codec.SectionLen(g))
		err := codec.FromRaw(sec, raw, g)
		back := make([]byte, g.RawSectionLen())
		if err == nil {
			err = codec.ToRaw(back, sec, g)
		}
		switch {
		case c.Error != "" && err == nil:
			t.Errorf("fp8 %q: encoded, want refused", c.Name)
		case c.Error == "" && (err != nil || hex.EncodeToString(sec) != c.FP8Hex || hex.EncodeToString(back) != c.BackHex):
			t.Errorf("fp8 %q: %v", c.Name, err)
		}
		ran++
	}
	if ran != v.Count || ran < 518 {
		t.Fatalf("ran %d vectors, the file says %d", ran, v.Count)
	}
	t.Logf("%d shared vectors", ran)
}

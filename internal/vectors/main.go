// Command vectors writes testdata/vectors/core.json (make vectors): the
// test vectors both implementations run, Go's and Python's (issue 48).
// The values come from the Go implementation; the spec's appendix vectors
// are among them, and TestSharedVectors holds Go to the committed file, so
// a Go change cannot move a vector silently.
package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strings"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// Vectors is the file's shape; kvsp's TestSharedVectors and the Python
// tests read it.
type Vectors struct {
	Comment     string             `json:"comment"`
	Count       int                `json:"count"` // every vector below: both suites run exactly these
	Descriptors []DescriptorVector `json:"descriptors"`
	ScopeKeys   []ScopeKeyVector   `json:"scope_keys"`
	BlockKeys   []BlockKeysVector  `json:"block_keys"`
	Layers      []LayerVector      `json:"layer_digests"`
	Replicas    []ReplicaVector    `json:"replica_digests"`
	ReprFields  []ReprVector       `json:"repr_digest_fields"`
	NewHeaders  []NewHeaderVector  `json:"new_headers"`
	Headers     []HeaderVector     `json:"headers"`
	Containers  []ContainerVector  `json:"containers"`
	Problems    []ProblemVector    `json:"problems"`
	BaseURIs    []BaseURIVector    `json:"base_uris"`
	Records     []RecordVector     `json:"records"`
	FP8         []FP8Vector        `json:"fp8_sections"`
}

// FP8Vector is a raw K or V section and what codec 0xFF01 makes of it
// (FromRaw), and of that back (ToRaw), or a refusal.
type FP8Vector struct {
	Name     string       `json:"name"`
	Geometry GeometryJSON `json:"geometry"`
	RawHex   string       `json:"raw_hex"`
	FP8Hex   string       `json:"fp8_hex,omitempty"`
	BackHex  string       `json:"back_hex,omitempty"`
	Error    string       `json:"error,omitempty"`
}

// RecordVector is a JSON record of one type (replica, lease_request,
// lease_response) and whether Go's Decode accepts it.
type RecordVector struct {
	Type  string `json:"type"`
	Name  string `json:"name"`
	JSON  string `json:"json"`
	Error string `json:"error,omitempty"`
	Kind  string `json:"kind,omitempty"` // the refusal's sentinel (its problem type and status)
}

// BaseURIVector is a string offered as a base URI: its normalized form (or
// a refusal), whether it is valid as it stands (an https base URI in
// normalized form), and the resource id of the normalized form
// ({holder-id}, {instance-id}).
type BaseURIVector struct {
	Name       string `json:"name"`
	Input      string `json:"input"`
	Normalized string `json:"normalized,omitempty"`
	Valid      bool   `json:"valid"`
	ResourceID string `json:"resource_id,omitempty"`
	Error      string `json:"error,omitempty"`
}

// ProblemVector is a problem details body with its HTTP status, and the
// error it decodes to: its type, status and the sentinel it stands for
// (Go's error text, each Python class's kind), or a refusal.
type ProblemVector struct {
	Name       string `json:"name"`
	HTTPStatus int    `json:"http_status"`
	Body       string `json:"body"`
	Type       string `json:"type,omitempty"`
	Status     int    `json:"status,omitempty"`
	Kind       string `json:"kind,omitempty"`
	Error      string `json:"error,omitempty"`
}

// ContainerVector is a whole container read as a stream against a
// geometry, optionally holding it to expected layer digests (indexed by
// model layer) and a container digest: the layers it yields (index and
// digest) before it ends or fails, and the container digest at its end.
type ContainerVector struct {
	Name            string       `json:"name"`
	Geometry        GeometryJSON `json:"geometry"`
	Hex             string       `json:"hex"`
	ExpectLayers    []string     `json:"expect_layer_digests,omitempty"`
	ExpectContainer string       `json:"expect_container_digest,omitempty"`
	Layers          []LayerOut   `json:"layers"`
	Container       string       `json:"container_digest,omitempty"`
	Error           string       `json:"error,omitempty"`
}

// LayerOut is a layer a Reader yielded.
type LayerOut struct {
	Index  uint32 `json:"index"`
	Digest string `json:"digest"`
}

// GeometryJSON is a container.Geometry with the element type's name.
type GeometryJSON struct {
	Layers      uint32 `json:"layers"`
	BlockTokens uint32 `json:"block_tokens"`
	KVHeads     uint32 `json:"kv_heads"`
	HeadDim     uint32 `json:"head_dim"`
	Elem        string `json:"elem"`
}

func (g GeometryJSON) geometry() container.Geometry {
	e, _ := container.ParseElemType(g.Elem)
	return container.Geometry{Layers: g.Layers, BlockTokens: g.BlockTokens, KVHeads: g.KVHeads, HeadDim: g.HeadDim, Elem: e}
}

// NewHeaderVector is the header of layers [first, first+count) under a
// codec, encoded (or a refusal).
type NewHeaderVector struct {
	Name     string       `json:"name"`
	Geometry GeometryJSON `json:"geometry"`
	Codec    uint16       `json:"codec"`
	First    uint32       `json:"first"`
	Count    uint32       `json:"count"`
	Hex      string       `json:"hex,omitempty"`
	Error    string       `json:"error,omitempty"`
}

// HeaderVector is a header's octets parsed against a geometry (null: the
// holder's case, no descriptor), and what they give.
type HeaderVector struct {
	Name       string        `json:"name"`
	Geometry   *GeometryJSON `json:"geometry"`
	Hex        string        `json:"hex"`
	Codec      uint16        `json:"codec"`
	FirstLayer uint32        `json:"first_layer"`
	TokenCount uint32        `json:"token_count"`
	Layers     [][2]uint64   `json:"layers,omitempty"`
	Len        int           `json:"len"`
	Error      string        `json:"error,omitempty"`
}

// LayerVector is one layer's K and V sections and SHA-256(K || V).
type LayerVector struct {
	Name   string `json:"name"`
	KHex   string `json:"k_hex"`
	VHex   string `json:"v_hex"`
	Digest string `json:"digest"`
}

// ReplicaVector is layer digests (hex) and the replica digest over their
// raw octets, with its Repr-Digest field value.
type ReplicaVector struct {
	Name       string   `json:"name"`
	Layers     []string `json:"layers"`
	Digest     string   `json:"digest"`
	ReprDigest string   `json:"repr_digest"`
}

// ReprVector is a Repr-Digest field value and the sha-256 it carries (or
// a refusal).
type ReprVector struct {
	Name   string `json:"name"`
	Field  string `json:"field"`
	Digest string `json:"digest,omitempty"`
	Error  string `json:"error,omitempty"`
}

// DescriptorVector is a descriptor's octets and what they must give: its
// canonical JSON and compat_id, or (Error set) a refusal.
type DescriptorVector struct {
	Name     string `json:"name"`
	JSON     string `json:"json"` // the octets, as a JSON string (they may not be UTF-8: then JSONHex)
	JSONHex  string `json:"json_hex,omitempty"`
	JCS      string `json:"jcs,omitempty"`
	CompatID string `json:"compat_id,omitempty"`
	Error    string `json:"error,omitempty"` // Go's message; any InvalidError in Python
}

// ScopeKeyVector is a key file's text and its Scope ID (or a refusal).
type ScopeKeyVector struct {
	Name    string `json:"name"`
	Text    string `json:"text"`
	ScopeID string `json:"scope_id,omitempty"`
	Error   string `json:"error,omitempty"`
}

// BlockKeysVector is a token sequence's Block Keys.
type BlockKeysVector struct {
	Name        string   `json:"name"`
	ScopeKey    string   `json:"scope_key"`
	CompatID    string   `json:"compat_id"`
	BlockTokens int      `json:"block_tokens"`
	Tokens      []uint32 `json:"tokens"`
	Keys        []string `json:"keys"`
}

const appendix = `{"block_tokens":4,"head_dim":128,"kv_dtype":"bf16","kv_heads":8,"layers":32,"layout":"kvsp-layout-1","model":"example-model","model_digest":"sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda","positional":"rope","tokenizer_digest":"sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c"}`

const (
	md = `"sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda"`
	td = `"sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c"`
)

// descriptor builds a descriptor's JSON from the appendix's with members
// replaced (raw JSON values) or removed (value "").
func descriptor(over map[string]string) string {
	base := []struct{ k, v string }{{"model", `"example-model"`}, {"model_digest", md}, {"tokenizer_digest", td}, {"layers", "32"},
		{"kv_heads", "8"}, {"head_dim", "128"}, {"kv_dtype", `"bf16"`}, {"positional", `"rope"`}, {"block_tokens", "4"}, {"layout", `"kvsp-layout-1"`}}
	var b bytes.Buffer
	b.WriteByte('{')
	first := true
	add := func(k, v string) {
		if !first {
			b.WriteByte(',')
		}
		first = false
		fmt.Fprintf(&b, "%q:%s", k, v)
	}
	for _, m := range base {
		v, ok := over[m.k]
		if !ok {
			v = m.v
		}
		if v != "" {
			add(m.k, v)
		}
	}
	for k, v := range over { // members the appendix has not
		known := false
		for _, m := range base {
			known = known || m.k == k
		}
		if !known && v != "" {
			add(k, v)
		}
	}
	b.WriteByte('}')
	return b.String()
}

func descriptorCases() []DescriptorVector {
	type c struct{ name, json string }
	cases := []c{
		{"appendix (KVSP draft, Test Vectors)", appendix},
		{"members in another order", descriptor(nil)},
		{"whitespace around members", "{ \"model\" : \"example-model\" ,\n\"model_digest\":" + md + ",\"tokenizer_digest\":" + td + ",\"layers\":32,\"kv_heads\":8,\"head_dim\":128,\"kv_dtype\":\"bf16\",\"positional\":\"rope\",\"block_tokens\":4,\"layout\":\"kvsp-layout-1\" }"},
		{"one adapter", descriptor(map[string]string{"adapters": "[" + md + "]"})},
		{"two adapters, order kept", descriptor(map[string]string{"adapters": "[" + td + "," + md + "]"})},
		{"rope with theta", descriptor(map[string]string{"positional": `"rope;theta=500000"`})},
		{"rope with scaling then theta (canonical: theta first)", descriptor(map[string]string{"positional": `"rope;scaling=yarn,theta=10000"`})},
		{"rope with scaling", descriptor(map[string]string{"positional": `"rope;scaling=linear_2"`})},
		{"positional none", descriptor(map[string]string{"positional": `"none"`})},
		{"fp8-e4m3", descriptor(map[string]string{"kv_dtype": `"fp8-e4m3"`})},
		{"fp8-e5m2", descriptor(map[string]string{"kv_dtype": `"fp8-e5m2"`})},
		{"fp16", descriptor(map[string]string{"kv_dtype": `"fp16"`})},
		{"fp32", descriptor(map[string]string{"kv_dtype": `"fp32"`})},
		{"model name with non-ASCII and escapes", descriptor(map[string]string{"model": `"m\u00f6del/\u20ac\"x\"\\\n"`})},
		{"model name with an astral character", descriptor(map[string]string{"model": `"model-\ud83d\ude00"`})},
		{"block_tokens 2^20", descriptor(map[string]string{"block_tokens": "1048576"})},
		{"layers 2^32-1", descriptor(map[string]string{"layers": "4294967295", "kv_heads": "1", "head_dim": "1", "block_tokens": "1"})},
		// Refusals.
		{"model absent", descriptor(map[string]string{"model": ""})},
		{"model empty", descriptor(map[string]string{"model": `""`})},
		{"model_digest absent", descriptor(map[string]string{"model_digest": ""})},
		{"model_digest all zero", descriptor(map[string]string{"model_digest": `"sha-256:0000000000000000000000000000000000000000000000000000000000000000"`})},
		{"model_digest uppercase hex", descriptor(map[string]string{"model_digest": `"sha-256:254E528C669A2084C9727298CACB83E8854E0A6FF80E2BF18096B9DCE0F7EBDA"`})},
		{"model_digest without its prefix", descriptor(map[string]string{"model_digest": `"254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda"`})},
		{"model_digest short", descriptor(map[string]string{"model_digest": `"sha-256:254e"`})},
		{"adapters empty", descriptor(map[string]string{"adapters": "[]"})},
		{"adapters null", descriptor(map[string]string{"adapters": "null"})},
		{"adapters not an array", descriptor(map[string]string{"adapters": md})},
		{"adapter not a digest", descriptor(map[string]string{"adapters": `["lora"]`})},
		{"layers 0", descriptor(map[string]string{"layers": "0"})},
		{"layers negative", descriptor(map[string]string{"layers": "-1"})},
		{"layers 2^32", descriptor(map[string]string{"layers": "4294967296"})},
		{"layers true", descriptor(map[string]string{"layers": "true"})},
		{"layers 32.0", descriptor(map[string]string{"layers": "32.0"})},
		{"layers 3.2e1", descriptor(map[string]string{"layers": "3.2e1"})},
		{"layers as a string", descriptor(map[string]string{"layers": `"32"`})},
		{"layers null", descriptor(map[string]string{"layers": "null"})},
		{"layers NaN", descriptor(map[string]string{"layers": "NaN"})},
		{"layers Infinity", descriptor(map[string]string{"layers": "Infinity"})},
		{"head_dim past 2^53", descriptor(map[string]string{"head_dim": "9007199254740993"})},
		{"block_tokens past 2^20", descriptor(map[string]string{"block_tokens": "1048577"})},
		{"section size past 2^53", descriptor(map[string]string{"kv_heads": "4294967295", "head_dim": "4294967295", "block_tokens": "1048576", "kv_dtype": `"fp32"`})},
		{"kv_dtype unregistered", descriptor(map[string]string{"kv_dtype": `"int8"`})},
		{"kv_dtype uppercase", descriptor(map[string]string{"kv_dtype": `"BF16"`})},
		{"positional unregistered", descriptor(map[string]string{"positional": `"alibi"`})},
		{"positional none with a parameter", descriptor(map[string]string{"positional": `"none;theta=1"`})},
		{"rope theta with a leading zero", descriptor(map[string]string{"positional": `"rope;theta=0100"`})},
		{"rope theta twice", descriptor(map[string]string{"positional": `"rope;theta=1,theta=2"`})},
		{"rope theta past 2^53", descriptor(map[string]string{"positional": `"rope;theta=9007199254740992"`})},
		{"rope theta signed", descriptor(map[string]string{"positional": `"rope;theta=+5"`})},
		{"rope empty parameter list", descriptor(map[string]string{"positional": `"rope;"`})},
		{"rope unknown parameter", descriptor(map[string]string{"positional": `"rope;base=5"`})},
		{"rope scaling uppercase", descriptor(map[string]string{"positional": `"rope;scaling=YaRN"`})},
		{"layout unknown", descriptor(map[string]string{"layout": `"kvsp-layout-2"`})},
		{"unknown member", descriptor(map[string]string{"quantization": `"q4"`})},
		{"duplicate member", replaceOnce(appendix, `"layers":32`, `"layers":32,"layers":32`)},
		{"lone high surrogate", descriptor(map[string]string{"model": `"m\ud800"`})},
		{"lone low surrogate", descriptor(map[string]string{"model": `"m\udc00x"`})},
		{"byte-order mark", "\ufeff" + appendix},
		{"trailing data", appendix + " {}"},
		{"trailing comma", appendix[:len(appendix)-1] + ",}"},
		{"not an object", "[" + appendix + "]"},
		{"empty", ""},
		{"model name of 1025 octets", descriptor(map[string]string{"model": `"` + string(bytes.Repeat([]byte("m"), 1025)) + `"`})},
	}
	var out []DescriptorVector
	for _, k := range cases {
		v := DescriptorVector{Name: k.name, JSON: k.json}
		d, err := kvsp.ParseDescriptor([]byte(k.json))
		if err == nil {
			var j []byte
			j, err = d.JCS()
			if err == nil {
				id, _ := d.CompatID()
				v.JCS, v.CompatID = string(j), id.String()
			}
		}
		if err != nil {
			v.Error = errText(err)
		}
		out = append(out, v)
	}
	// Octets that are not UTF-8: carried as hex.
	bad := bytes.Replace([]byte(appendix), []byte(`"example-model"`), []byte("\"example-\xffmodel\""), 1)
	v := DescriptorVector{Name: "invalid UTF-8 in a string", JSONHex: hex.EncodeToString(bad)}
	if _, err := kvsp.ParseDescriptor(bad); err != nil {
		v.Error = errText(err)
	}
	return append(out, v)
}

func slicesRepeat(d container.Digest, n int) []container.Digest {
	out := make([]container.Digest, n)
	for i := range out {
		out[i] = d
	}
	return out
}

// errText is an error's text for the file, cut where the JSON library's own
// message begins: go-json-experiment words its errors differently from run
// to run on purpose ("cannot" or "unable to"), so that nothing depends on
// them; the file must not move when nothing did.
func errText(err error) string {
	s := err.Error()
	for _, lib := range []string{"json: ", "jsontext: "} {
		if i := strings.Index(s, lib); i >= 0 {
			return s[:i] + "(the JSON library's message)"
		}
	}
	return s
}

func replaceOnce(s, old, new string) string {
	return string(bytes.Replace([]byte(s), []byte(old), []byte(new), 1))
}

func main() {
	out := flag.String("o", "testdata/vectors/core.json", "file to write")
	srv := flag.Bool("serve", false, "answer queries, one JSON line each on stdin, on stdout: the Python property tests' Go side")
	flag.Parse()
	if *srv {
		if err := serve(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "vectors:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(*out); err != nil {
		fmt.Fprintln(os.Stderr, "vectors:", err)
		os.Exit(1)
	}
}

func run(path string) error {
	v := Vectors{Comment: "Generated by make vectors (internal/vectors) from the Go implementation; run by kvsp's TestSharedVectors and python/tests/test_vectors.py. Never edit by hand."}
	v.Descriptors = descriptorCases()
	rng := rand.New(rand.NewPCG(48, 2026))
	keyText := func(n int) string {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return hex.EncodeToString(b)
	}
	for _, c := range []struct{ name, text string }{
		{"appendix key", "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"},
		{"32 octets and a newline", keyText(32) + "\n"},
		{"33 octets", keyText(33)},
		{"64 octets", keyText(64)},
		{"65 octets (longer than an HMAC block: hashed first)", keyText(65)},
		{"31 octets", keyText(31)},
		{"odd length", keyText(32) + "a"},
		{"uppercase hex", "000102030405060708090A0B0C0D0E0F101112131415161718191A1B1C1D1E1F"},
		{"two newlines", keyText(32) + "\n\n"},
		{"empty", ""},
	} {
		kv := ScopeKeyVector{Name: c.name, Text: c.text}
		k, err := kvsp.ParseScopeKey([]byte(c.text))
		if err != nil {
			kv.Error = errText(err)
		} else {
			kv.ScopeID = k.ID().String()
		}
		v.ScopeKeys = append(v.ScopeKeys, kv)
	}
	appendixCompat := "5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f"
	blockCase := func(name, key, compat string, b int, toks []uint32) error {
		k, err := kvsp.ParseScopeKey([]byte(key))
		if err != nil {
			return err
		}
		c, err := kvsp.ParseCompatID(compat)
		if err != nil {
			return err
		}
		keys, err := kvsp.BlockKeys(k, c, b, toks)
		if err != nil {
			return err
		}
		bv := BlockKeysVector{Name: name, ScopeKey: key, CompatID: compat, BlockTokens: b, Tokens: toks, Keys: []string{}}
		for _, x := range keys {
			bv.Keys = append(bv.Keys, x.String())
		}
		v.BlockKeys = append(v.BlockKeys, bv)
		return nil
	}
	if err := blockCase("appendix: B=4, K[0] and K[1]", "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f", appendixCompat, 4,
		[]uint32{128000, 791, 6460, 374, 264, 1296, 315, 279}); err != nil {
		return err
	}
	tokens := func(n int, max uint32) []uint32 {
		t := make([]uint32, n)
		for i := range t {
			t[i] = rng.Uint32N(max)
		}
		return t
	}
	for _, c := range []struct {
		name string
		b, n int
		max  uint32
	}{
		{"B=1, 7 tokens", 1, 7, 32000},
		{"B=4, 10 tokens (a 2-token tail without a key)", 4, 10, 128256},
		{"B=16, 100 tokens", 16, 100, 128256},
		{"B=256, 1000 tokens", 256, 1000, 152064},
		{"B=16, fewer tokens than a block", 16, 15, 32000},
		{"B=8, tokens up to 2^32-1", 8, 24, 1<<32 - 1},
	} {
		key := keyText(32)
		sum := sha256.Sum256(binary.BigEndian.AppendUint32([]byte("compat"), uint32(c.b)))
		if err := blockCase(c.name, key, hex.EncodeToString(sum[:]), c.b, tokens(c.n, c.max)); err != nil {
			return err
		}
	}
	octets := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	var layerDigests []container.Digest
	for _, c := range []struct {
		name string
		k, v []byte
	}{
		{"all-zero 8192+8192 layer (derived vector)", make([]byte, 8192), make([]byte, 8192)},
		{"64+64 octets", octets(64), octets(64)},
		{"K and V of different lengths (a codec's sections)", octets(100), octets(37)},
		{"empty V", octets(16), nil},
	} {
		d := container.LayerDigest(c.k, c.v)
		layerDigests = append(layerDigests, d)
		v.Layers = append(v.Layers, LayerVector{Name: c.name, KHex: hex.EncodeToString(c.k), VHex: hex.EncodeToString(c.v), Digest: hex.EncodeToString(d[:])})
	}
	for _, c := range []struct {
		name   string
		layers []container.Digest
	}{
		{"two all-zero layers (derived vector)", []container.Digest{layerDigests[0], layerDigests[0]}},
		{"32 all-zero layers (derived vector)", slicesRepeat(layerDigests[0], 32)},
		{"the four layers above, in order", layerDigests},
		{"one layer", layerDigests[1:2]},
	} {
		d := container.ReplicaDigest(c.layers)
		rv := ReplicaVector{Name: c.name, Digest: hex.EncodeToString(d[:]), ReprDigest: container.ReprDigest(d)}
		for _, l := range c.layers {
			rv.Layers = append(rv.Layers, hex.EncodeToString(l[:]))
		}
		v.Replicas = append(v.Replicas, rv)
	}
	zero := container.ReprDigest(layerDigests[0])
	for _, c := range []struct{ name, field string }{
		{"sha-256 alone", zero},
		{"after another algorithm", "sha-512=:AAAA:, " + zero},
		{"with a parameter", zero + ";q=1"},
		{"spaces and tabs around members", " \t" + zero + " \t, unixsum=:AA==:"},
		{"no sha-256", "sha-512=:AAAA:"},
		{"sha-256 not a byte sequence", "sha-256=abc"},
		{"sha-256 of 31 octets", "sha-256=:" + "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==" + ":"},
		{"base64 with non-zero padding bits", "sha-256=:" + zero[len("sha-256=:"):len(zero)-3] + "B=:"},
		{"base64url alphabet", "sha-256=:" + "_-" + zero[len("sha-256=:")+2:]},
		{"uppercase algorithm", "SHA-256=" + zero[len("sha-256="):]},
		{"empty", ""},
	} {
		rv := ReprVector{Name: c.name, Field: c.field}
		d, err := container.ParseReprDigest(c.field)
		if err != nil {
			rv.Error = errText(err)
		} else {
			rv.Digest = hex.EncodeToString(d[:])
		}
		v.ReprFields = append(v.ReprFields, rv)
	}
	headerVectors(&v)
	containerVectors(&v, octets)
	problemVectors(&v)
	baseURIVectors(&v)
	recordVectors(&v)
	fp8Vectors(&v, rng)
	v.Count = len(v.Descriptors) + len(v.ScopeKeys) + len(v.BlockKeys) + len(v.Layers) + len(v.Replicas) + len(v.ReprFields) +
		len(v.NewHeaders) + len(v.Headers) + len(v.Containers) + len(v.Problems) + len(v.BaseURIs) + len(v.Records) + len(v.FP8)
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", " ")
	if err := enc.Encode(&v); err != nil {
		return err
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		return errors.Join(errors.New("writing "+path), err)
	}
	return nil
}

func headerVectors(v *Vectors) {
	appendixG := GeometryJSON{32, 4, 8, 128, "bf16"}
	tiny := GeometryJSON{4, 16, 2, 64, "fp16"}
	for _, c := range []struct {
		name         string
		g            GeometryJSON
		codec        uint16
		first, count uint32
	}{
		{"appendix: raw, layers 0-1 (KVSP draft, Test Vectors)", appendixG, container.CodecRaw, 0, 2},
		{"raw, every layer", tiny, container.CodecRaw, 0, 4},
		{"raw, the last layer", tiny, container.CodecRaw, 3, 1},
		{"fp8 per-head codec", tiny, container.CodecFP8Head, 1, 2},
		{"fp32", GeometryJSON{2, 4, 1, 8, "fp32"}, container.CodecRaw, 0, 2},
		{"past the model's layers", tiny, container.CodecRaw, 3, 2},
		{"no layers", tiny, container.CodecRaw, 0, 0},
		{"unregistered codec", tiny, 0x0002, 0, 1},
		{"geometry with a zero dimension", GeometryJSON{4, 0, 2, 64, "fp16"}, container.CodecRaw, 0, 1},
	} {
		hv := NewHeaderVector{Name: c.name, Geometry: c.g, Codec: c.codec, First: c.first, Count: c.count}
		h, err := container.NewHeader(c.codec, c.first, c.count, c.g.geometry())
		if err != nil {
			hv.Error = errText(err)
		} else {
			hv.Hex = hex.EncodeToString(h.Append(nil))
		}
		v.NewHeaders = append(v.NewHeaders, hv)
	}
	good, _ := container.NewHeader(container.CodecRaw, 1, 2, tiny.geometry())
	ok := good.Append(nil)
	fp8, _ := container.NewHeader(container.CodecFP8Head, 0, 4, tiny.geometry())
	with := func(off int, b ...byte) []byte {
		x := append([]byte(nil), ok...)
		copy(x[off:], b)
		return x
	}
	be32 := func(n uint32) []byte { return binary.BigEndian.AppendUint32(nil, n) }
	be64 := func(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }
	huge := append(append(with(12, be32(1)...)[:20], be64(1<<61)...), be64(1<<61+1)...)
	bigLayers := append(with(8, be32(1<<32-1)...)[:12], be32(2)...)
	bigLayers = append(append(bigLayers, ok[16:20]...), ok[20:52]...)
	for _, c := range []struct {
		name string
		g    *GeometryJSON
		b    []byte
	}{
		{"raw, layers 1-2", &tiny, ok},
		{"raw, layers 1-2, no geometry", nil, ok},
		{"followed by data (only the header is read)", &tiny, append(append([]byte(nil), ok...), 1, 2, 3)},
		{"fp8 per-head codec", &tiny, fp8.Append(nil)},
		{"truncated in the fixed part", &tiny, ok[:19]},
		{"truncated in the lengths", &tiny, ok[:51]},
		{"empty", &tiny, nil},
		{"magic", &tiny, with(0, 'K', 'V', 'B', '2')},
		{"version 2", &tiny, with(4, 2)},
		{"version 0", nil, with(4, 0)},
		{"reserved flags", &tiny, with(5, 1)},
		{"codec 0", nil, with(6, 0, 0)},
		{"unregistered codec", &tiny, with(6, 0, 2)},
		{"unregistered codec, no geometry (the consumer checks it)", nil, with(6, 0, 2)},
		{"layer count 0", nil, with(12, be32(0)...)},
		{"layers beyond the model", &tiny, with(8, be32(3)...)},
		{"token count", &tiny, with(16, be32(17)...)},
		{"token count, no geometry", nil, with(16, be32(17)...)},
		{"a K length off by one", &tiny, with(20, be64(2049)...)},
		{"a V length of another codec", &tiny, with(44, be64(4*2+16*2*64)...)},
		{"layer count 2^32-1 in 52 octets (nothing allocated)", &tiny, with(12, be32(1<<32-1)...)},
		{"layer count 2^32-1, no geometry", nil, with(12, be32(1<<32-1)...)},
		{"layers past 2^32, no geometry", nil, bigLayers},
		{"section lengths past 2^62, no geometry", nil, huge},
	} {
		hv := HeaderVector{Name: c.name, Geometry: c.g, Hex: hex.EncodeToString(c.b)}
		g := container.Geometry{}
		if c.g != nil {
			g = c.g.geometry()
		}
		h, n, err := container.ParseHeader(c.b, g)
		if err != nil {
			hv.Error = errText(err)
		} else {
			hv.Codec, hv.FirstLayer, hv.TokenCount, hv.Len = h.Codec, h.FirstLayer, h.TokenCount, n
			for _, l := range h.Layers {
				hv.Layers = append(hv.Layers, [2]uint64{l.K, l.V})
			}
		}
		v.Headers = append(v.Headers, hv)
	}
}

func containerVectors(v *Vectors, octets func(int) []byte) {
	gj := GeometryJSON{3, 4, 1, 8, "fp16"}
	g := gj.geometry()
	build := func(codec uint16, first, count uint32) ([]byte, container.Digests) {
		h, err := container.NewHeader(codec, first, count, g)
		if err != nil {
			panic(err)
		}
		var b bytes.Buffer
		w := container.NewWriter(&b, h)
		n := container.LookupCodec(codec).SectionLen(g)
		for range count {
			if err := w.WriteLayer(octets(int(n)), octets(int(n))); err != nil {
				panic(err)
			}
		}
		d, err := w.Close()
		if err != nil {
			panic(err)
		}
		return b.Bytes(), container.Digests{Layers: append([]container.Digest(nil), d.Layers...), Container: d.Container}
	}
	all, dAll := build(container.CodecRaw, 0, 3)
	rng, dRng := build(container.CodecRaw, 1, 2)
	fp8, _ := build(container.CodecFP8Head, 0, 3)
	byModel := func(d container.Digests, first int) []string {
		out := make([]string, 3)
		for i := range out {
			out[i] = hex.EncodeToString(make([]byte, 32))
		}
		for i, l := range d.Layers {
			out[first+i] = hex.EncodeToString(l[:])
		}
		return out
	}
	wrong := byModel(dAll, 0)
	wrong[1] = hex.EncodeToString(bytes.Repeat([]byte{0xab}, 32))
	for _, c := range []struct {
		name   string
		b      []byte
		layers []string
		whole  string
	}{
		{"every layer", all, nil, ""},
		{"every layer, digests expected", all, byModel(dAll, 0), hex.EncodeToString(dAll.Container[:])},
		{"layers 1-2, digests expected by model layer", rng, byModel(dRng, 1), hex.EncodeToString(dRng.Container[:])},
		{"fp8 per-head codec", fp8, nil, ""},
		{"a layer digest that differs (after layer 0)", all, wrong, ""},
		{"the container digest differs", all, nil, hex.EncodeToString(bytes.Repeat([]byte{1}, 32))},
		{"cut inside layer 1", all[:52+16+128+100], nil, ""},
		{"cut at a layer's end", all[:52+16+128], nil, ""},
		{"cut inside the header", all[:30], nil, ""},
		{"an octet after the last layer", append(append([]byte(nil), all...), 0), nil, ""},
	} {
		cv := ContainerVector{Name: c.name, Geometry: gj, Hex: hex.EncodeToString(c.b), ExpectLayers: c.layers, ExpectContainer: c.whole, Layers: []LayerOut{}}
		r := container.NewReader(bytes.NewReader(c.b), g)
		if c.layers != nil {
			ds := make([]container.Digest, len(c.layers))
			for i, x := range c.layers {
				hex.Decode(ds[i][:], []byte(x))
			}
			r.ExpectLayerDigests(ds)
		}
		if c.whole != "" {
			var d container.Digest
			hex.Decode(d[:], []byte(c.whole))
			r.ExpectContainerDigest(d)
		}
		for {
			l, err := r.Next()
			if err == io.EOF {
				d := r.Digests().Container
				cv.Container = hex.EncodeToString(d[:])
				break
			}
			if err != nil {
				cv.Error = errText(err)
				break
			}
			cv.Layers = append(cv.Layers, LayerOut{l.Index, hex.EncodeToString(l.Digest[:])})
		}
		v.Containers = append(v.Containers, cv)
	}
}

func problemVectors(v *Vectors) {
	type c struct {
		name   string
		status int
		body   string
	}
	var cases []c
	for _, t := range kvsp.ProblemTypes { // every row of the table, as a server sends it
		b, err := kvsp.MarshalProblem(kvsp.NewProblem(t.Err, "detail"))
		if err != nil {
			panic(err)
		}
		cases = append(cases, c{"the row " + t.Err.Error(), t.Status, string(b)})
	}
	cases = append(cases,
		c{"a stale epoch with its extension member", 409, `{"type":"https://iana.org/assignments/kvsp#kvsp-stale-epoch","status":409,"epoch":12}`},
		c{"an unknown KVSP type: by status", 409, `{"type":"https://iana.org/assignments/kvsp#kvsp-new-thing","status":409}`},
		c{"an unknown 404 type: a miss", 404, `{"type":"https://example.com/other","status":404}`},
		c{"an unlisted 4xx status: invalid", 418, `{"status":418}`},
		c{"an unlisted 5xx status: unavailable", 502, `{}`},
		c{"no type: about:blank", 403, `{"status":403,"title":"Forbidden"}`},
		c{"status absent: the HTTP status", 429, `{"type":"about:blank"}`},
		c{"status disagreeing with HTTP", 404, `{"type":"about:blank","status":409}`},
		c{"status a string", 404, `{"status":"404"}`},
		c{"status 404.0", 404, `{"status":404.0}`},
		c{"status true", 404, `{"status":true}`},
		c{"type a number", 404, `{"type":7,"status":404}`},
		c{"not an object", 404, `[]`},
		c{"duplicate status", 404, `{"status":404,"status":404}`},
		c{"trailing data", 404, `{"status":404} x`},
	)
	for _, k := range cases {
		pv := ProblemVector{Name: k.name, HTTPStatus: k.status, Body: k.body}
		p, err := kvsp.ParseProblem([]byte(k.body), k.status)
		if err != nil {
			pv.Error = errText(err)
		} else {
			pv.Type, pv.Status = p.Type, p.Status
			if s := p.Unwrap(); s != nil {
				pv.Kind = s.Error()
			}
		}
		v.Problems = append(v.Problems, pv)
	}
}

func baseURIVectors(v *Vectors) {
	for _, c := range []struct{ name, in string }{
		{"holder (CONFORMANCE 2.5)", "https://h1.example/kvsp/"},
		{"without the final slash", "https://h1.example/kvsp"},
		{"unnormalised (CONFORMANCE 2.5)", "https://H1.example:443/kvsp/"},
		{"instance (CONFORMANCE 2.5)", "https://ii7.example/kvsp/"},
		{"uppercase scheme", "HTTPS://h.example/"},
		{"no path", "https://h.example"},
		{"a port", "https://h.example:8443/kvsp/"},
		{"a port with leading zeros", "https://h.example:08443/"},
		{"the default port with leading zeros", "https://h.example:0443/"},
		{"an empty port", "https://h.example:/"},
		{"port past 65535", "https://h.example:65536/"},
		{"port 65535", "https://h.example:65535/"},
		{"IPv4", "https://127.0.0.1:8443/kvsp/"},
		{"IPv6", "https://[::1]:8443/kvsp/"},
		{"IPv6 uppercase", "https://[FE80::A]/"},
		{"IPv6 IPv4-mapped", "https://[::ffff:1.2.3.4]/"},
		{"IPv4 in brackets", "https://[1.2.3.4]/"},
		{"IPv6 with a zone", "https://[fe80::1%25en0]/"},
		{"IPv6 unclosed", "https://[::1/"},
		{"IPv6 not an address", "https://[::g]/"},
		{"two colons in the host", "https://a:1:2/"},
		{"a non-numeric port", "https://h.example:https/"},
		{"dot segments", "https://h.example/a/./b/../c/"},
		{"dot segments past the root", "https://h.example/../../a/"},
		{"a final dot segment", "https://h.example/a/b/.."},
		{"percent-encoded unreserved", "https://h.example/%7Euser/%61/"},
		{"percent-encoding lowercase hex", "https://h.example/a%2fb/"},
		{"percent-encoding uppercase hex", "https://h.example/a%2Fb/"},
		{"truncated percent-encoding", "https://h.example/a%2/"},
		{"bad percent-encoding", "https://h.example/a%zz/"},
		{"a space in the path", "https://h.example/a b/"},
		{"non-ASCII in the path", "https://h.example/caf\u00e9/"},
		{"sub-delims in the path", "https://h.example/a!$&'()*+,;=:@/"},
		{"brackets in the path", "https://h.example/a[b]/"},
		{"non-ASCII host", "https://b\u00fccher.example/"},
		{"percent-encoded host", "https://h%2e.example/"},
		{"percent-encoded non-ASCII host", "https://h%c3%bc.example/"},
		{"a quote in the host", "https://h\"x.example/"},
		{"a space in the host", "https://h x.example/"},
		{"uppercase host", "https://H.EXAMPLE/"},
		{"user information", "https://user@h.example/"},
		{"empty user information", "https://@h.example/"},
		{"a query", "https://h.example/?x=1"},
		{"an empty query", "https://h.example/?"},
		{"a fragment", "https://h.example/#x"},
		{"an empty fragment", "https://h.example/#"},
		{"http", "http://h.example/"},
		{"moqt", "moqt://relay.example/kvsp/"},
		{"no scheme", "//h.example/"},
		{"opaque", "https:h.example/"},
		{"one slash", "https:/h.example/"},
		{"three slashes", "https:///h.example/"},
		{"a control character", "https://h.example/\u0001/"},
		{"a tab", "https://h.example/a\tb/"},
		{"empty", ""},
		{"a scheme starting with a digit", "1https://h.example/"},
		{"a colon first", ":https://h.example/"},
		{"longer than 2048 octets", "https://h.example/" + strings.Repeat("a", 2030) + "/"},
	} {
		in := c.in
		bv := BaseURIVector{Name: c.name, Input: in}
		n, err := kvsp.NormalizeBaseURI(in)
		if err != nil {
			bv.Error = errText(err)
		} else {
			bv.Normalized, bv.ResourceID = n, kvsp.ResourceID(n)
		}
		bv.Valid = kvsp.ValidateBaseURI("uri", in) == nil
		v.BaseURIs = append(v.BaseURIs, bv)
	}
}

// object writes base's members in order, each replaced by over[k] (raw
// JSON; "" removes it), then over's members base has not.
func object(base [][2]string, over map[string]string) string {
	var b strings.Builder
	b.WriteByte('{')
	n := 0
	add := func(k, v string) {
		if n > 0 {
			b.WriteByte(',')
		}
		n++
		fmt.Fprintf(&b, "%q:%s", k, v)
	}
	seen := map[string]bool{}
	for _, m := range base {
		seen[m[0]] = true
		v, ok := over[m[0]]
		if !ok {
			v = m[1]
		}
		if v != "" {
			add(m[0], v)
		}
	}
	var extra []string
	for k := range over {
		if !seen[k] {
			extra = append(extra, k)
		}
	}
	slices.Sort(extra)
	for _, k := range extra {
		if over[k] != "" {
			add(k, over[k])
		}
	}
	b.WriteByte('}')
	return b.String()
}

func recordVectors(v *Vectors) {
	hex32 := func(c byte) string {
		return `"` + strings.Repeat(string([]byte{"0123456789abcdef"[c>>4], "0123456789abcdef"[c&15]}), 32) + `"`
	}
	hex16 := func(c byte) string {
		return `"` + strings.Repeat(string([]byte{"0123456789abcdef"[c>>4], "0123456789abcdef"[c&15]}), 16) + `"`
	}
	digest := `"sha-256:` + strings.Repeat("ab", 32) + `"`
	replica := [][2]string{{"block_key", hex32(1)}, {"compat_id", hex32(2)}, {"scope_id", hex16(3)}, {"holder", `"https://h1.example/kvsp/"`},
		{"codec", "1"}, {"size", "65536"}, {"digest", digest}, {"layer_digests", "[" + hex32(4) + "," + hex32(5) + "," + hex32(6) + "," + hex32(7) + "]"},
		{"residency", `[{"tier":"host","layers":[0,1]},{"tier":"local-storage","layers":[2,3],"read_mbit_per_s":8000}]`}, {"ttl_ms", "60000"}}
	ns := base64.RawURLEncoding.EncodeToString([]byte("\x01a\x01b\x01c\x01d\x01e"))
	type c struct {
		name string
		over map[string]string
	}
	for _, k := range []c{
		{"complete", nil},
		{"without layer digests", map[string]string{"layer_digests": ""}},
		{"an unknown member, ignored", map[string]string{"x_extension": `{"a":[1,2]}`}},
		{"one layer", map[string]string{"residency": `[{"tier":"device","layers":[3,3]}]`}},
		{"ranges out of order", map[string]string{"residency": `[{"tier":"host","layers":[2,3]},{"tier":"host","layers":[0,1]}]`}},
		{"moqt", map[string]string{"holder": `"moqt://relay.example/kvsp/"`, "moqt_namespace": `"` + ns + `"`}},
		{"block_key absent", map[string]string{"block_key": ""}},
		{"block_key null", map[string]string{"block_key": "null"}},
		{"block_key zero", map[string]string{"block_key": hex32(0)}},
		{"block_key uppercase", map[string]string{"block_key": `"` + strings.Repeat("AB", 32) + `"`}},
		{"block_key short", map[string]string{"block_key": `"abcd"`}},
		{"block_key a number", map[string]string{"block_key": "7"}},
		{"scope_id of 32 octets", map[string]string{"scope_id": hex32(3)}},
		{"compat_id zero", map[string]string{"compat_id": hex32(0)}},
		{"codec 0", map[string]string{"codec": "0"}},
		{"codec past 2^16", map[string]string{"codec": "65536"}},
		{"codec -1", map[string]string{"codec": "-1"}},
		{"codec 1.0", map[string]string{"codec": "1.0"}},
		{"codec true", map[string]string{"codec": "true"}},
		{"codec a string", map[string]string{"codec": `"1"`}},
		{"size 0", map[string]string{"size": "0"}},
		{"size 2^53", map[string]string{"size": "9007199254740992"}},
		{"size 2^64", map[string]string{"size": "18446744073709551616"}},
		{"size 1e3", map[string]string{"size": "1e3"}},
		{"digest without its prefix", map[string]string{"digest": `"` + strings.Repeat("ab", 32) + `"`}},
		{"digest zero", map[string]string{"digest": `"sha-256:` + strings.Repeat("00", 32) + `"`}},
		{"ttl_ms 0", map[string]string{"ttl_ms": "0"}},
		{"ttl_ms absent", map[string]string{"ttl_ms": ""}},
		{"holder http", map[string]string{"holder": `"http://h1.example/kvsp/"`}},
		{"holder unnormalised", map[string]string{"holder": `"https://H1.example/kvsp/"`}},
		{"holder without a slash", map[string]string{"holder": `"https://h1.example/kvsp"`}},
		{"holder moqt without a namespace", map[string]string{"holder": `"moqt://relay.example/kvsp/"`}},
		{"moqt namespace with an https holder", map[string]string{"moqt_namespace": `"` + ns + `"`}},
		{"moqt namespace with padding", map[string]string{"holder": `"moqt://relay.example/kvsp/"`, "moqt_namespace": `"` + ns + `="`}},
		{"moqt namespace of four fields", map[string]string{"holder": `"moqt://relay.example/kvsp/"`, "moqt_namespace": `"` + base64.RawURLEncoding.EncodeToString([]byte("\x01a\x01b\x01c\x01d")) + `"`}},
		{"moqt namespace with a field truncated", map[string]string{"holder": `"moqt://relay.example/kvsp/"`, "moqt_namespace": `"` + base64.RawURLEncoding.EncodeToString([]byte("\x01a\x01b\x01c\x01d\x05e")) + `"`}},
		{"moqt namespace with octets after", map[string]string{"holder": `"moqt://relay.example/kvsp/"`, "moqt_namespace": `"` + base64.RawURLEncoding.EncodeToString([]byte("\x01a\x01b\x01c\x01d\x01ef")) + `"`}},
		{"residency empty", map[string]string{"residency": "[]"}},
		{"residency absent", map[string]string{"residency": ""}},
		{"residency overlapping", map[string]string{"residency": `[{"tier":"host","layers":[0,2]},{"tier":"host","layers":[2,3]}]`}},
		{"residency first past last", map[string]string{"residency": `[{"tier":"host","layers":[3,2]}]`}},
		{"residency unregistered tier", map[string]string{"residency": `[{"tier":"cloud","layers":[0,3]}]`}},
		{"residency layers past 2^32", map[string]string{"residency": `[{"tier":"host","layers":[0,4294967296]}]`}},
		{"residency layers of three", map[string]string{"residency": `[{"tier":"host","layers":[0,1,2]}]`}},
		{"residency rate past 2^53", map[string]string{"residency": `[{"tier":"host","layers":[0,3],"read_mbit_per_s":9007199254740992}]`}},
		{"layer digests fewer than the layers", map[string]string{"layer_digests": "[" + hex32(4) + "]"}},
		{"layer digests empty", map[string]string{"layer_digests": "[]"}},
		{"layer digest with a prefix", map[string]string{"layer_digests": `["sha-256:` + strings.Repeat("ab", 32) + `"]`}},
		{"10,000 layer digests", map[string]string{"layer_digests": "[" + strings.TrimSuffix(strings.Repeat(hex32(9)+",", 10000), ",") + "]"}},
		{"duplicate member", map[string]string{"ttl_ms": "1,\"ttl_ms\":2"}},
		{"not an object", map[string]string{"": ""}},
	} {
		j := object(replica, k.over)
		if k.name == "not an object" {
			j = "[" + object(replica, nil) + "]"
		}
		rv := RecordVector{Type: "replica", Name: k.name, JSON: j}
		var r kvsp.ReplicaRecord
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	lease := [][2]string{{"scope_id", hex16(3)}, {"compat_id", hex32(2)}, {"block_keys", "[" + hex32(1) + "," + hex32(8) + "]"}, {"ttl_ms", "2000"}}
	for _, k := range []c{
		{"complete", nil},
		{"block_keys empty", map[string]string{"block_keys": "[]"}},
		{"block_keys with a zero key", map[string]string{"block_keys": "[" + hex32(1) + "," + hex32(0) + "]"}},
		{"block_keys with a null", map[string]string{"block_keys": "[" + hex32(1) + ",null]"}},
		{"ttl_ms 0", map[string]string{"ttl_ms": "0"}},
		{"ttl_ms 2^53", map[string]string{"ttl_ms": "9007199254740992"}},
		{"scope_id absent", map[string]string{"scope_id": ""}},
		{"compat_id null", map[string]string{"compat_id": "null"}},
	} {
		j := object(lease, k.over)
		rv := RecordVector{Type: "lease_request", Name: k.name, JSON: j}
		var r kvsp.LeaseRequest
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	uuid := `"a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10"`
	blocks := `[{"block_key":` + hex32(1) + `,"sources":["https://h1.example/kvsp/","https://h2.example/kvsp/"]},{"block_key":` + hex32(8) + `,"sources":["https://h1.example/kvsp/"]}]`
	directive := [][2]string{{"directive", uuid}, {"request_ref", `"opaque-value-from-PC"`}, {"scope_id", hex16(3)}, {"compat_id", hex32(2)},
		{"blocks", blocks}, {"layer_order", `"ascending"`}, {"deadline_ms", "50"}, {"lease_ms", "2000"}}
	for _, k := range []c{
		{"the spec's example shape", nil},
		{"without request_ref and layer_order", map[string]string{"request_ref": "", "layer_order": ""}},
		{"directive uppercase", map[string]string{"directive": `"A2B7C9E0-1F3D-4C1A-8F5B-6D2E9A7C3B10"`}},
		{"directive without dashes", map[string]string{"directive": `"a2b7c9e01f3d4c1a8f5b6d2e9a7c3b10"`}},
		{"directive braced", map[string]string{"directive": `"{a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10}"`}},
		{"directive nil", map[string]string{"directive": `"00000000-0000-0000-0000-000000000000"`}},
		{"directive absent", map[string]string{"directive": ""}},
		{"blocks empty", map[string]string{"blocks": "[]"}},
		{"a block without sources", map[string]string{"blocks": `[{"block_key":` + hex32(1) + `,"sources":[]}]`}},
		{"a block with a zero key", map[string]string{"blocks": `[{"block_key":` + hex32(0) + `,"sources":["https://h1.example/kvsp/"]}]`}},
		{"a source unnormalised", map[string]string{"blocks": `[{"block_key":` + hex32(1) + `,"sources":["https://H1.example/kvsp/"]}]`}},
		{"a source over http", map[string]string{"blocks": `[{"block_key":` + hex32(1) + `,"sources":["http://h1.example/kvsp/"]}]`}},
		{"a null block", map[string]string{"blocks": `[null]`}},
		{"layer_order descending", map[string]string{"layer_order": `"descending"`}},
		{"request_ref of 4096 octets", map[string]string{"request_ref": `"` + strings.Repeat("r", 4096) + `"`}},
		{"request_ref of 4097 octets", map[string]string{"request_ref": `"` + strings.Repeat("r", 4097) + `"`}},
		{"deadline_ms 0", map[string]string{"deadline_ms": "0"}},
		{"lease_ms 2^53", map[string]string{"lease_ms": "9007199254740992"}},
		{"deadline_ms negative", map[string]string{"deadline_ms": "-50"}},
	} {
		j := object(directive, k.over)
		rv := RecordVector{Type: "prefetch_directive", Name: k.name, JSON: j}
		var r kvsp.PrefetchDirective
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	status := [][2]string{{"directive", uuid}, {"state", `"partial"`}, {"loaded", "[" + hex32(1) + "]"}, {"failed", "[" + hex32(8) + "]"}}
	for _, k := range []c{
		{"partial", nil},
		{"complete, nothing failed", map[string]string{"state": `"complete"`, "failed": "[]"}},
		{"state unknown", map[string]string{"state": `"done"`}},
		{"state uppercase", map[string]string{"state": `"PENDING"`}},
		{"loaded absent", map[string]string{"loaded": ""}},
		{"failed null", map[string]string{"failed": "null"}},
		{"a loaded key not hex", map[string]string{"loaded": `["xyz"]`}},
	} {
		j := object(status, k.over)
		rv := RecordVector{Type: "prefetch_status", Name: k.name, JSON: j}
		var r kvsp.PrefetchStatus
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	lookup := [][2]string{{"scope_id", hex16(3)}, {"compat_id", hex32(2)}, {"block_keys", "[" + hex32(1) + "," + hex32(8) + "]"},
		{"targets", `["https://ii1.example/kvsp/","https://ii2.example/kvsp/"]`}}
	for _, k := range []c{
		{"complete", nil},
		{"no targets", map[string]string{"targets": ""}},
		{"no block keys (an empty array)", map[string]string{"block_keys": "[]"}},
		{"block_keys absent", map[string]string{"block_keys": ""}},
		{"block_keys null", map[string]string{"block_keys": "null"}},
		{"block_keys an object", map[string]string{"block_keys": "{}"}},
		{"a block key null", map[string]string{"block_keys": "[" + hex32(1) + ",null]"}},
		{"a block key a number", map[string]string{"block_keys": "[1]"}},
		{"a block key escaped", map[string]string{"block_keys": `["\u0030` + strings.Repeat("1", 63) + `"]`}},
		{"a target unnormalised", map[string]string{"targets": `["https://II1.example/kvsp/"]`}},
		{"a target null", map[string]string{"targets": `[null]`}},
		{"scope_id a number", map[string]string{"scope_id": "3"}},
		{"an unknown member", map[string]string{"hint": `[1,{"x":null}]`}},
	} {
		j := object(lookup, k.over)
		rv := RecordVector{Type: "lookup_request", Name: k.name, JSON: j}
		var r kvsp.LookupRequest
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	rec := object(replica, nil)
	lresp := [][2]string{{"matched", "2"}, {"replicas", "[[" + rec + "],[" + rec + "," + rec + "]]"},
		{"targets", `[{"instance":"https://ii1.example/kvsp/","fetch_us":0,"recompute_us":1500}]`}}
	for _, k := range []c{
		{"two blocks matched", nil},
		{"nothing matched", map[string]string{"matched": "0", "replicas": "[]", "targets": ""}},
		{"nothing matched, replicas null", map[string]string{"matched": "0", "replicas": "null", "targets": ""}},
		{"matched absent", map[string]string{"matched": ""}},
		{"matched null", map[string]string{"matched": "null"}},
		{"matched more than the replicas", map[string]string{"matched": "3"}},
		{"matched negative", map[string]string{"matched": "-1", "replicas": "[]"}},
		{"an empty entry", map[string]string{"replicas": "[[" + rec + "],[]]"}},
		{"an invalid replica inside", map[string]string{"replicas": "[[" + rec + "],[" + object(replica, map[string]string{"ttl_ms": "0"}) + "]]"}},
		{"a target without fetch_us", map[string]string{"targets": `[{"instance":"https://ii1.example/kvsp/","recompute_us":1500}]`}},
		{"a target with fetch_us null", map[string]string{"targets": `[{"instance":"https://ii1.example/kvsp/","fetch_us":null,"recompute_us":1500}]`}},
		{"a target's instance over http", map[string]string{"targets": `[{"instance":"http://ii1.example/kvsp/","fetch_us":0,"recompute_us":1500}]`}},
		{"a target's recompute_us past 2^53", map[string]string{"targets": `[{"instance":"https://ii1.example/kvsp/","fetch_us":0,"recompute_us":9007199254740992}]`}},
	} {
		j := object(lresp, k.over)
		rv := RecordVector{Type: "lookup_response", Name: k.name, JSON: j}
		var r kvsp.LookupResponse
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	istatus := [][2]string{{"instance", `"https://ii1.example/kvsp/"`}, {"epoch", "1765000000000"}, {"state", `"active"`}, {"running", "3"}, {"queued", "0"},
		{"batch_size", "8"}, {"kv_utilization", "0.42"}, {"prefill_tokens_per_s", "5000"}, {"decode_tokens_per_s", "1.5e3"},
		{"links", `[{"holder":"https://h1.example/kvsp/","mbit_per_s":100000,"rtt_us":20}]`}, {"requested_state", "null"}, {"ttl_ms", "3000"},
		{"compat_id", hex32(2)}, {"holder", `"https://h1.example/kvsp/"`}, {"vocab_size", "2048"}, {"context_tokens", "8192"}, {"max_output_tokens", "1024"},
		{"started", "[" + hex16(9) + "]"}}
	for _, k := range []c{
		{"complete", nil},
		{"without kvsp's extension members", map[string]string{"compat_id": "", "holder": "", "vocab_size": "", "context_tokens": "", "max_output_tokens": "", "started": ""}},
		{"requested sleeping", map[string]string{"requested_state": `"sleeping"`}},
		{"requested_state absent", map[string]string{"requested_state": ""}},
		{"requested draining", map[string]string{"requested_state": `"draining"`}},
		{"requested an unknown state", map[string]string{"requested_state": `"resting"`}},
		{"no links (an empty array)", map[string]string{"links": "[]"}},
		{"links absent", map[string]string{"links": ""}},
		{"a link at 0 Mbit/s", map[string]string{"links": `[{"holder":"https://h1.example/kvsp/","mbit_per_s":0,"rtt_us":20}]`}},
		{"a link's holder unnormalised", map[string]string{"links": `[{"holder":"https://h1.example:443/kvsp/","mbit_per_s":1,"rtt_us":20}]`}},
		{"running absent", map[string]string{"running": ""}},
		{"queued null", map[string]string{"queued": "null"}},
		{"kv_utilization absent", map[string]string{"kv_utilization": ""}},
		{"kv_utilization 0", map[string]string{"kv_utilization": "0"}},
		{"kv_utilization 1", map[string]string{"kv_utilization": "1"}},
		{"kv_utilization 1.01", map[string]string{"kv_utilization": "1.01"}},
		{"kv_utilization negative", map[string]string{"kv_utilization": "-0.1"}},
		{"kv_utilization a string", map[string]string{"kv_utilization": `"0.4"`}},
		{"prefill rate negative", map[string]string{"prefill_tokens_per_s": "-1"}},
		{"prefill rate 1e400", map[string]string{"prefill_tokens_per_s": "1e400"}},
		{"prefill rate an integer of 400 digits", map[string]string{"prefill_tokens_per_s": "1" + strings.Repeat("0", 400)}},
		{"epoch 0", map[string]string{"epoch": "0"}},
		{"epoch 2^53", map[string]string{"epoch": "9007199254740992"}},
		{"state unknown", map[string]string{"state": `"resting"`}},
		{"state absent", map[string]string{"state": ""}},
		{"ttl_ms 0", map[string]string{"ttl_ms": "0"}},
		{"instance over http", map[string]string{"instance": `"http://ii1.example/kvsp/"`}},
		{"holder without a slash", map[string]string{"holder": `"https://h1.example/kvsp"`}},
		{"started of 4096", map[string]string{"started": "[" + strings.TrimSuffix(strings.Repeat(hex16(9)+",", 4096), ",") + "]"}},
		{"started of 4097", map[string]string{"started": "[" + strings.TrimSuffix(strings.Repeat(hex16(9)+",", 4097), ",") + "]"}},
		{"a started grant short", map[string]string{"started": `["abcd"]`}},
		{"context_tokens 2^53", map[string]string{"context_tokens": "9007199254740992"}},
	} {
		j := object(istatus, k.over)
		rv := RecordVector{Type: "status", Name: k.name, JSON: j}
		var r kvsp.InstanceStatus
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	sampler := `{"method":"top-p","params":{"p":0.9},"seed":7,"step":3,"deterministic":false}`
	checkpoint := [][2]string{{"session", uuid}, {"epoch", "12"}, {"compat_id", hex32(2)}, {"scope_id", hex16(3)}, {"prompt_blocks", "[" + hex32(1) + "," + hex32(8) + "]"},
		{"prompt_tail", "[5, 6,7]"}, {"generated", "[100,4294967295,0]"}, {"output_offset", "3"}, {"sampler", sampler}}
	for _, k := range []c{
		{"complete", nil},
		{"nothing generated yet", map[string]string{"generated": "[]", "output_offset": "0"}},
		{"greedy, empty params", map[string]string{"sampler": `{"method":"greedy","params":{},"seed":0,"step":0,"deterministic":true}`}},
		{"output_offset off by one", map[string]string{"output_offset": "2"}},
		{"output_offset absent", map[string]string{"output_offset": ""}},
		{"generated absent", map[string]string{"generated": "", "output_offset": "0"}},
		{"prompt_tail null", map[string]string{"prompt_tail": "null"}},
		{"prompt_blocks empty", map[string]string{"prompt_blocks": "[]"}},
		{"a token 2^32", map[string]string{"generated": "[100,4294967296,0]"}},
		{"a token negative", map[string]string{"generated": "[100,-1,0]"}},
		{"a token 1.0", map[string]string{"generated": "[100,1.0,0]"}},
		{"a token 1e2", map[string]string{"generated": "[100,1e2,0]"}},
		{"a token null", map[string]string{"generated": "[100,null,0]"}},
		{"a token true", map[string]string{"generated": "[100,true,0]"}},
		{"a token a string", map[string]string{"generated": `[100,"1",0]`}},
		{"tokens an object", map[string]string{"prompt_tail": `{"0":5}`}},
		{"a zero prompt block", map[string]string{"prompt_blocks": "[" + hex32(0) + "]"}},
		{"epoch 0", map[string]string{"epoch": "0"}},
		{"session absent", map[string]string{"session": ""}},
		{"sampler absent", map[string]string{"sampler": ""}},
		{"sampler null", map[string]string{"sampler": "null"}},
		{"sampler without seed", map[string]string{"sampler": `{"method":"top-p","params":{},"step":3,"deterministic":false}`}},
		{"sampler without deterministic", map[string]string{"sampler": `{"method":"top-p","params":{},"seed":1,"step":3}`}},
		{"sampler deterministic a number", map[string]string{"sampler": `{"method":"top-p","params":{},"seed":1,"step":3,"deterministic":1}`}},
		{"sampler without params", map[string]string{"sampler": `{"method":"top-p","seed":1,"step":3,"deterministic":false}`}},
		{"sampler params an array", map[string]string{"sampler": `{"method":"top-p","params":[],"seed":1,"step":3,"deterministic":false}`}},
		{"sampler method empty", map[string]string{"sampler": `{"method":"","params":{},"seed":1,"step":3,"deterministic":false}`}},
		{"sampler seed 2^53", map[string]string{"sampler": `{"method":"top-p","params":{},"seed":9007199254740992,"step":3,"deterministic":false}`}},
		{"finished at the end-of-generation token (A-39)", map[string]string{"finish": `"stop"`}},
		{"finished at max_tokens", map[string]string{"finish": `"length"`}},
		{"cancelled by the front end", map[string]string{"finish": `"cancelled"`}},
		{"finish null", map[string]string{"finish": "null"}},
		{"finish unknown", map[string]string{"finish": `"eos"`}},
		{"finish uppercase", map[string]string{"finish": `"STOP"`}},
		{"finish a boolean", map[string]string{"finish": "true"}},
	} {
		j := object(checkpoint, k.over)
		rv := RecordVector{Type: "checkpoint", Name: k.name, JSON: j}
		var r kvsp.Checkpoint
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	le := func(toks ...uint32) string {
		b := make([]byte, 0, 4*len(toks))
		for _, t := range toks {
			b = binary.LittleEndian.AppendUint32(b, t)
		}
		return `"` + base64.StdEncoding.EncodeToString(b) + `"`
	}
	place := [][2]string{{"scope_id", hex16(3)}, {"compat_id", hex32(2)}, {"tokens", "[1,2,3,4,5]"}, {"session", uuid},
		{"sampler", `{"method":"top-p","params":{"p":0.9},"seed":7}`}, {"max_tokens", "16"}}
	for _, k := range []c{
		{"complete", nil},
		{"greedy, no session", map[string]string{"session": "", "sampler": `{"method":"greedy","seed":0}`}},
		{"no sampler", map[string]string{"sampler": "null"}},
		{"tokens_le32 instead of tokens", map[string]string{"tokens": "", "tokens_le32": le(1, 2, 3, 4294967295)}},
		{"both tokens and tokens_le32", map[string]string{"tokens_le32": le(1)}},
		{"tokens_le32 not a multiple of 4", map[string]string{"tokens": "", "tokens_le32": `"AQID"`}},
		{"tokens_le32 unpadded base64", map[string]string{"tokens": "", "tokens_le32": `"AQAAAA"`}},
		{"tokens_le32 base64url", map[string]string{"tokens": "", "tokens_le32": `"_____w=="`}},
		{"tokens_le32 empty", map[string]string{"tokens": "", "tokens_le32": `""`}},
		{"tokens empty", map[string]string{"tokens": "[]"}},
		{"tokens absent", map[string]string{"tokens": ""}},
		{"max_tokens 0", map[string]string{"max_tokens": "0"}},
		{"max_tokens 2^20", map[string]string{"max_tokens": "1048576"}},
		{"max_tokens past 2^20", map[string]string{"max_tokens": "1048577"}},
		{"session nil", map[string]string{"session": `"00000000-0000-0000-0000-000000000000"`}},
		{"session null", map[string]string{"session": "null"}},
		{"sampler unknown method", map[string]string{"sampler": `{"method":"beam","seed":1}`}},
		{"sampler method absent", map[string]string{"sampler": `{"seed":1}`}},
		{"top-p without p", map[string]string{"sampler": `{"method":"top-p","params":{},"seed":1}`}},
		{"top-p with p 1", map[string]string{"sampler": `{"method":"top-p","params":{"p":1},"seed":1}`}},
		{"top-p with p 0", map[string]string{"sampler": `{"method":"top-p","params":{"p":0},"seed":1}`}},
		{"top-p with p 1.5", map[string]string{"sampler": `{"method":"top-p","params":{"p":1.5},"seed":1}`}},
		{"top-p with p a string", map[string]string{"sampler": `{"method":"top-p","params":{"p":"0.5"},"seed":1}`}},
		{"top-p with p null", map[string]string{"sampler": `{"method":"top-p","params":{"p":null},"seed":1}`}},
		{"top-p with another parameter", map[string]string{"sampler": `{"method":"top-p","params":{"p":0.5,"k":4},"seed":1}`}},
		{"greedy with p", map[string]string{"sampler": `{"method":"greedy","params":{"p":0.5},"seed":1}`}},
		{"seed 2^53", map[string]string{"sampler": `{"method":"greedy","seed":9007199254740992}`}},
		{"scope_id absent", map[string]string{"scope_id": ""}},
	} {
		j := object(place, k.over)
		rv := RecordVector{Type: "place_request", Name: k.name, JSON: j}
		var r kvsp.PlaceRequest
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	presp := [][2]string{{"session", uuid}, {"epoch", "3"}, {"instance", `"https://ii1.example/kvsp/"`}, {"matched", "4"}, {"directive", uuid}, {"grant", `"AbC-_0"`}}
	for _, k := range []c{
		{"complete", nil},
		{"no directive, no grant", map[string]string{"directive": "null", "grant": ""}},
		{"epoch 0", map[string]string{"epoch": "0"}},
		{"instance unnormalised", map[string]string{"instance": `"https://II1.example/kvsp/"`}},
		{"grant of 2972 characters", map[string]string{"grant": `"` + strings.Repeat("A", 2972) + `"`}},
		{"grant of 2973 characters", map[string]string{"grant": `"` + strings.Repeat("A", 2973) + `"`}},
		{"matched negative (not checked)", map[string]string{"matched": "-2"}},
		{"session absent", map[string]string{"session": ""}},
	} {
		j := object(presp, k.over)
		rv := RecordVector{Type: "place_response", Name: k.name, JSON: j}
		var r kvsp.PlaceResponse
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	gen := [][2]string{{"session", uuid}, {"epoch", "3"}, {"scope_id", hex16(3)}, {"compat_id", hex32(2)}, {"tokens", "[1,2,3]"}, {"max_tokens", "8"},
		{"sampler", `{"method":"greedy","seed":0}`}, {"from", "2"}, {"grant", `"AbC-_0"`}}
	for _, k := range []c{
		{"complete", nil},
		{"from 0", map[string]string{"from": "0"}},
		{"max_tokens past 2^20: 413", map[string]string{"max_tokens": "1048577"}},
		{"max_tokens 0", map[string]string{"max_tokens": "0"}},
		{"epoch absent", map[string]string{"epoch": ""}},
		{"session a number", map[string]string{"session": "1"}},
		{"tokens with a null", map[string]string{"tokens": "[1,null]"}},
		{"grant of 2973 characters", map[string]string{"grant": `"` + strings.Repeat("A", 2973) + `"`}},
		{"from negative", map[string]string{"from": "-1"}},
	} {
		j := object(gen, k.over)
		rv := RecordVector{Type: "generate_request", Name: k.name, JSON: j}
		var r kvsp.GenerateRequest
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	tok := [][2]string{{"index", "0"}, {"epoch", "3"}, {"token", "42"}, {"prefill", `{"cached_tokens":512,"computed_tokens":52}`}}
	for _, k := range []c{
		{"the first line, with prefill", nil},
		{"the last line", map[string]string{"prefill": "", "done": "true"}},
		{"epoch 0", map[string]string{"epoch": "0"}},
		{"token 2^32", map[string]string{"token": "4294967296"}},
		{"done a string", map[string]string{"done": `"true"`}},
		{"prefill an array", map[string]string{"prefill": "[512,52]"}},
		{"the last line, stopped (A-39)", map[string]string{"prefill": "", "done": "true", "finish": `"stop"`}},
		{"the last line, at max_tokens", map[string]string{"prefill": "", "done": "true", "finish": `"length"`}},
		{"finish without done", map[string]string{"prefill": "", "finish": `"stop"`}},
		{"finish unknown", map[string]string{"prefill": "", "done": "true", "finish": `"end"`}},
		{"finish a number", map[string]string{"prefill": "", "done": "true", "finish": "1"}},
	} {
		j := object(tok, k.over)
		rv := RecordVector{Type: "generated_token", Name: k.name, JSON: j}
		var r kvsp.GeneratedToken
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	smap := `{"map":"c3f8e1","version":4,"shards":[{"tokens":[0,32768],"instance":"https://ii1.example/kvsp/"},{"tokens":[32768,65536],"instance":"https://ii2.example/kvsp/"}]}`
	for _, k := range []struct{ name, json string }{
		{"the spec's shape", smap},
		{"one shard", `{"map":"m","version":0,"shards":[{"tokens":[0,1],"instance":"https://ii1.example/kvsp/"}]}`},
		{"version absent", `{"map":"m","shards":[{"tokens":[0,1],"instance":"https://ii1.example/kvsp/"}]}`},
		{"version null", `{"map":"m","version":null,"shards":[{"tokens":[0,1],"instance":"https://ii1.example/kvsp/"}]}`},
		{"map empty", `{"map":"","version":1,"shards":[{"tokens":[0,1],"instance":"https://ii1.example/kvsp/"}]}`},
		{"map of 257 octets", `{"map":"` + strings.Repeat("m", 257) + `","version":1,"shards":[{"tokens":[0,1],"instance":"https://ii1.example/kvsp/"}]}`},
		{"no shards", `{"map":"m","version":1,"shards":[]}`},
		{"not starting at 0", `{"map":"m","version":1,"shards":[{"tokens":[1,2],"instance":"https://ii1.example/kvsp/"}]}`},
		{"a gap", `{"map":"m","version":1,"shards":[{"tokens":[0,2],"instance":"https://ii1.example/kvsp/"},{"tokens":[3,4],"instance":"https://ii2.example/kvsp/"}]}`},
		{"an empty range", `{"map":"m","version":1,"shards":[{"tokens":[0,0],"instance":"https://ii1.example/kvsp/"}]}`},
		{"a range past 2^53", `{"map":"m","version":1,"shards":[{"tokens":[0,9007199254740992],"instance":"https://ii1.example/kvsp/"}]}`},
		{"a range of three", `{"map":"m","version":1,"shards":[{"tokens":[0,1,2],"instance":"https://ii1.example/kvsp/"}]}`},
		{"an instance over http", `{"map":"m","version":1,"shards":[{"tokens":[0,1],"instance":"http://ii1.example/kvsp/"}]}`},
	} {
		rv := RecordVector{Type: "shard_map", Name: k.name, JSON: k.json}
		var r kvsp.ShardMap
		if err := kvsp.Decode([]byte(k.json), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	for _, k := range []struct{ name, json string }{
		{"the spec's plan", `{"map":"c3f8e1","from":4,"to":5,"deadline_ms":200,"retain":[[0,32768]],"fetch":[{"tokens":[32768,49152],"from":"https://ii2.example/kvsp/"}],"release":[]}`},
		{"a plan with kvsp's members", `{"map":"m","from":1,"to":2,"deadline_ms":50,"retain":[],"fetch":[{"tokens":[0,8],"from":"https://ii2.example/kvsp/","holder":"https://h2.example/kvsp/","block_keys":[` + hex32(1) + `,` + hex32(8) + `]}],"release":[[8,16]],"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `,"plan":` + uuid + `,"term":3}`},
		{"a plan without lists", `{"map":"m","from":1,"to":2,"deadline_ms":50}`},
		{"a commit", `{"map":"m","commit":5}`},
		{"an abort", `{"map":"m","abort":5,"plan":` + uuid + `}`},
		{"a plan without to", `{"map":"m","from":1,"deadline_ms":50}`},
		{"a plan with to null", `{"map":"m","from":1,"to":null,"deadline_ms":50}`},
		{"a plan and a commit", `{"map":"m","from":1,"to":2,"deadline_ms":50,"commit":2}`},
		{"a commit and an abort", `{"map":"m","commit":2,"abort":2}`},
		{"nothing", `{"map":"m"}`},
		{"a plan without deadline", `{"map":"m","from":1,"to":2}`},
		{"overlapping retain and fetch", `{"map":"m","from":1,"to":2,"deadline_ms":50,"retain":[[0,10]],"fetch":[{"tokens":[5,15],"from":"https://ii2.example/kvsp/"}]}`},
		{"overlapping releases", `{"map":"m","from":1,"to":2,"deadline_ms":50,"release":[[0,10],[9,20]]}`},
		{"an empty range", `{"map":"m","from":1,"to":2,"deadline_ms":50,"retain":[[4,4]]}`},
		{"a fetch from http", `{"map":"m","from":1,"to":2,"deadline_ms":50,"fetch":[{"tokens":[0,8],"from":"http://ii2.example/kvsp/"}]}`},
		{"a fetch's holder unnormalised", `{"map":"m","from":1,"to":2,"deadline_ms":50,"fetch":[{"tokens":[0,8],"from":"https://ii2.example/kvsp/","holder":"https://H2.example/kvsp/"}]}`},
		{"a commit past 2^53", `{"map":"m","commit":9007199254740992}`},
		{"map absent", `{"commit":2}`},
	} {
		rv := RecordVector{Type: "reshard", Name: k.name, JSON: k.json}
		var r kvsp.Reshard
		if err := kvsp.Decode([]byte(k.json), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	for _, k := range []struct{ name, json string }{
		{"complete", `{"map":` + smap + `,"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `,"tokens":[1,2,3],"deadline_ms":500}`},
		{"without tokens and deadline", `{"map":` + smap + `,"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `}`},
		{"without a scope", `{"map":` + smap + `,"compat_id":` + hex32(2) + `}`},
		{"map absent", `{"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `}`},
		{"map null", `{"map":null,"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `}`},
		{"a map without version", `{"map":{"map":"m","shards":[{"tokens":[0,1],"instance":"https://ii1.example/kvsp/"}]},"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `}`},
		{"an invalid map", `{"map":{"map":"m","version":1,"shards":[]},"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `}`},
		{"deadline past 2^53", `{"map":` + smap + `,"scope_id":` + hex16(3) + `,"compat_id":` + hex32(2) + `,"deadline_ms":9007199254740992}`},
	} {
		rv := RecordVector{Type: "map_update", Name: k.name, JSON: k.json}
		var r kvsp.MapUpdate
		if err := kvsp.Decode([]byte(k.json), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
	resp := [][2]string{{"lease", `"l-0123_abc.~"`}, {"ttl_ms", "2000"}, {"block_keys", "[" + hex32(1) + "]"}}
	for _, k := range []c{
		{"complete", nil},
		{"lease empty", map[string]string{"lease": `""`}},
		{"lease of 128 octets", map[string]string{"lease": `"` + strings.Repeat("a", 128) + `"`}},
		{"lease of 129 octets", map[string]string{"lease": `"` + strings.Repeat("a", 129) + `"`}},
		{"lease with a slash", map[string]string{"lease": `"a/b"`}},
		{"lease with a percent", map[string]string{"lease": `"a%20b"`}},
		{"lease non-ASCII", map[string]string{"lease": `"caf\u00e9"`}},
		{"lease a dot segment", map[string]string{"lease": `".."`}},
		{"ttl_ms absent", map[string]string{"ttl_ms": ""}},
		{"block_keys absent", map[string]string{"block_keys": ""}},
	} {
		j := object(resp, k.over)
		rv := RecordVector{Type: "lease_response", Name: k.name, JSON: j}
		var r kvsp.LeaseResponse
		if err := kvsp.Decode([]byte(j), &r); err != nil {
			rv.Error, rv.Kind = errText(err), kvsp.ProblemFor(err).Unwrap().Error()
		}
		v.Records = append(v.Records, rv)
	}
}

func fp8Vectors(v *Vectors, rng *rand.Rand) {
	// Random finite elements of every magnitude (subnormals, zeros of both
	// signs, values past the fp8 range), as bit patterns.
	finite := func(elem string, n int, scaleBits int) []byte {
		var b []byte
		for i := range n {
			switch elem {
			case "bf16", "fp16":
				var x uint16
				for {
					x = uint16(rng.Uint32())
					if scaleBits > 0 { // a narrower range of exponents: values within a few binades
						x = x&0x83ff | uint16(scaleBits+int(rng.Uint32N(4)))<<10
						if elem == "bf16" {
							x = x&0x807f | uint16(120+int(rng.Uint32N(8)))<<7
						}
					}
					exp := x >> 10 & 0x1f
					if elem == "bf16" {
						exp = x >> 7 & 0xff
						if exp != 0xff {
							break
						}
						continue
					}
					if exp != 0x1f {
						break
					}
				}
				if i%17 == 0 {
					x = 0x8000 // negative zero
				}
				b = binary.LittleEndian.AppendUint16(b, x)
			default:
				var x uint32
				for {
					x = rng.Uint32()
					if scaleBits > 0 {
						x = x&0x807fffff | uint32(120+int(rng.Uint32N(8)))<<23
					}
					if x>>23&0xff != 0xff {
						break
					}
				}
				if i%13 == 0 {
					x = 0
				}
				b = binary.LittleEndian.AppendUint32(b, x)
			}
		}
		return b
	}
	for _, c := range []struct {
		name  string
		g     GeometryJSON
		scale int
		edit  func([]byte) []byte
	}{
		{"bf16, every magnitude", GeometryJSON{1, 4, 2, 8, "bf16"}, 0, nil},
		{"bf16, a few binades", GeometryJSON{1, 4, 2, 8, "bf16"}, 1, nil},
		{"fp16, every magnitude", GeometryJSON{1, 4, 2, 8, "fp16"}, 0, nil},
		{"fp16, a few binades", GeometryJSON{1, 4, 2, 8, "fp16"}, 12, nil},
		{"fp32, every magnitude", GeometryJSON{1, 4, 2, 8, "fp32"}, 0, nil},
		{"fp32, a few binades", GeometryJSON{1, 4, 2, 8, "fp32"}, 1, nil},
		{"fp16, one head all zero", GeometryJSON{1, 4, 2, 8, "fp16"}, 12, func(b []byte) []byte {
			for t := 0; t < 4; t++ { // head 1 of each token: elements (2t+1)*8 .. +8
				clear(b[2*(2*t+1)*8 : 2*(2*t+2)*8])
			}
			return b
		}},
		{"bf16 with a NaN", GeometryJSON{1, 4, 2, 8, "bf16"}, 1, func(b []byte) []byte { binary.LittleEndian.PutUint16(b[10:], 0x7fc1); return b }},
		{"fp16 with an infinity", GeometryJSON{1, 4, 2, 8, "fp16"}, 12, func(b []byte) []byte { binary.LittleEndian.PutUint16(b[20:], 0xfc00); return b }},
		{"fp8 elements cannot be scaled", GeometryJSON{1, 4, 2, 8, "fp8-e4m3"}, 0, func(b []byte) []byte { return make([]byte, 64) }},
	} {
		g := c.g.geometry()
		raw := finite(c.g.Elem, int(g.Elements()), c.scale)
		if c.edit != nil {
			raw = c.edit(raw)
		}
		fv := FP8Vector{Name: c.name, Geometry: c.g, RawHex: hex.EncodeToString(raw)}
		codec := container.LookupCodec(container.CodecFP8Head)
		sec := make([]byte, codec.SectionLen(g))
		if err := codec.FromRaw(sec, raw, g); err != nil {
			fv.Error = errText(err)
		} else {
			back := make([]byte, g.RawSectionLen())
			if err := codec.ToRaw(back, sec, g); err != nil {
				panic(err)
			}
			fv.FP8Hex, fv.BackHex = hex.EncodeToString(sec), hex.EncodeToString(back)
		}
		v.FP8 = append(v.FP8, fv)
	}
}

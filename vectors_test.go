package kvsp_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// vector is one test vector and where it came from. These values are never
// edited to make code pass (STYLE.md rule 4).
type vector struct {
	name   string
	source string
	value  string
}

// Source labels.
const (
	srcAppendix = "KVSP draft, section Test Vectors (CONFORMANCE.md 2.2)"
	srcDerived  = "CONFORMANCE.md 2.5, derived vectors"
	srcRFC8785  = "RFC 8785 section 3.2.2 and 3.2.3"
)

// The appendix vectors (KVSP §Test Vectors), joined as CONFORMANCE.md 2.2
// gives them.
var (
	vecJCS = vector{"JCS(descriptor)", srcAppendix,
		`{"block_tokens":4,"head_dim":128,"kv_dtype":"bf16","kv_heads":8,"layers":32,"layout":"kvsp-layout-1","model":"example-model","model_digest":"sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda","positional":"rope","tokenizer_digest":"sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c"}`}
	vecCompatID = vector{"compat_id", srcAppendix, "5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f"}
	vecScopeKey = vector{"scope_key", srcAppendix, "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"}
	vecTokens   = []uint32{128000, 791, 6460, 374, 264, 1296, 315, 279} // srcAppendix, B = 4
	vecScopeID  = vector{"scope_id", srcAppendix, "6d1c6481cd428737da312c089db3832a"}
	vecK0       = vector{"K[0]", srcAppendix, "9ca9d8b60f37f84726a27deb4cdc0d075714607a131632c2366e30b99fb1163b"}
	vecK1       = vector{"K[1]", srcAppendix, "653275884ca44f8945fd4c902611c467394b73656e64c78d8522648cb75aefc1"}
	vecHeader   = vector{"container header, raw, layers 0-1, 4 tokens, 8192-octet sections", srcAppendix,
		"4b564231 01 00 0001 00000000 00000002 00000004 0000000000002000 0000000000002000 0000000000002000 0000000000002000"}
)

// Derived vectors (CONFORMANCE.md 2.5), not in the draft.
var derivedIDs = []struct {
	uri string
	id  vector
}{
	{"https://h1.example/kvsp/", vector{"{holder-id}", srcDerived, "lHUr-xSeDt_3qpqwQwQffdTj0kqh7BCC4vrbIxWUOkw"}},
	{"https://h1.example/kvsp", vector{"{holder-id} without slash", srcDerived, "al7Q7__j5EdzWKCmEyujfpumsy4atfV2XR_ya5Svy7E"}},
	{"https://H1.example:443/kvsp/", vector{"{holder-id} unnormalised", srcDerived, "3DLYH9LIGjcJd53q2d5-kLxHep6IhWUEx4Axuwbk0rQ"}},
	{"https://ii7.example/kvsp/", vector{"{instance-id}", srcDerived, "58d6G7izbs_Ozh_F64VfWLmQZWH0x7X73uUUYx7YBHs"}},
	{"https://ii9.example/kvsp/", vector{"{instance-id}", srcDerived, "QB4JfS27yednmhlIYOe5WuByBfaIDQ-htEOhzYwm7M0"}},
}

var (
	vecZeroContainerSHA = vector{"SHA-256 of appendix header + 32768 zero octets", srcDerived, "f98ae5e40d6faf140d1d041b8fc0ac0897f2813e55cb7986829af6ea73c8445f"}
	vecZeroReprDigest   = vector{"Repr-Digest of the same", srcDerived, "sha-256=:+Yrl5A1vrxQNHQQbj8CsCJfygT5Vy3mGgpr26nPIRF8=:"}
	vecZeroLayer        = vector{"layer digest of an all-zero 8192+8192 layer", srcDerived, "4fe7b59af6de3b665b67788cc2f99892ab827efae3a467342b3bb4e3bc8e5bfe"}
	vecTwoZeroLayers    = vector{"replica digest over two raw zero-layer digests", srcDerived, "c36d0dd6a886e1fce758b6b5c531b703a1f21e8f6453785c390931cf8fa8a76d"}
	vecTwoZeroLayersHex = vector{"the same over hex text (wrong)", srcDerived, "fca81061b241f9431d0066ff97109a697f6711592ef61423ce7311e41026076f"}
	vec32ZeroLayers     = vector{"replica digest, 32 all-zero layers", srcDerived, "c4081f861e5348bea93d6d13087a2466118f72e397cc5deb8ca8eb3821b01e77"}
)

// RFC 8785 examples in the descriptor's domain (strings, integers, member
// order).
var (
	rfc8785StringIn  = vector{"string escaping input", srcRFC8785, `{"escaping":"\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/"}`}
	rfc8785StringOut = vector{"string escaping output", srcRFC8785, `{"escaping":"€$\u000f\nA'B\"\\\\\"/"}`}
	rfc8785SortIn    = vector{"member sorting input", srcRFC8785,
		`{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One","\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}`}
	// Sorted by UTF-16 code units: U+000D, "1", U+0080, U+00F6, U+20AC,
	// U+D83D (the emoji's high surrogate), U+FB33.
	rfc8785SortOrder = []string{"Carriage Return", "One", "Control", "Latin Small Letter O With Diaeresis", "Euro Sign", "Emoji: Grinning Face", "Hebrew Letter Dalet With Dagesh"}
)

func appendixDescriptor(t testing.TB) kvsp.Descriptor {
	t.Helper()
	d, err := kvsp.ParseDescriptor([]byte(vecJCS.value))
	if err != nil {
		t.Fatalf("appendix descriptor: %v", err)
	}
	return d
}

func appendixScopeKey(t testing.TB) kvsp.ScopeKey {
	t.Helper()
	k, err := kvsp.ParseScopeKey([]byte(vecScopeKey.value))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func mustHex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestS6_BlockKeyVectorsAndDomainSeparation is row S6 of RELIABILITY.md.
// It checks every value of the spec's appendix exactly (R-CMP-13, R-CMP-14,
// R-KEY-2..5, R-CNT-1..6), the container header octets as the container
// package encodes them, and then the domain-separation properties of the
// derivation (R-CMP-5, R-CMP-6, R-KEY-7, R-KEY-11, R-KEY-12): changing one
// token, one descriptor member, adapters absent vs present, or the scope
// key changes K[i..] and only K[i..]; an empty adapters array is rejected;
// JCS is stable under member reordering; and 10^6 distinct inputs give 10^6
// distinct keys (s6CollisionSamples; KVSP_S6_SAMPLES overrides it).
func TestS6_BlockKeyVectorsAndDomainSeparation(t *testing.T) {
	d := appendixDescriptor(t)

	t.Run(vecJCS.name, func(t *testing.T) {
		got, err := d.JCS()
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != vecJCS.value {
			t.Errorf("%s (%s):\n got %s\nwant %s", vecJCS.name, vecJCS.source, got, vecJCS.value)
		}
		if len(got) != 329 {
			t.Errorf("JCS length %d, want 329 octets", len(got))
		}
	})
	t.Run(vecCompatID.name, func(t *testing.T) {
		c, err := d.CompatID()
		if err != nil {
			t.Fatal(err)
		}
		if c.String() != vecCompatID.value {
			t.Errorf("%s (%s) = %s, want %s", vecCompatID.name, vecCompatID.source, c, vecCompatID.value)
		}
	})
	key := appendixScopeKey(t)
	t.Run(vecScopeID.name, func(t *testing.T) {
		if got := key.ID().String(); got != vecScopeID.value {
			t.Errorf("%s (%s) = %s, want %s", vecScopeID.name, vecScopeID.source, got, vecScopeID.value)
		}
	})
	t.Run("K[0] and K[1]", func(t *testing.T) {
		compat, _ := kvsp.ParseCompatID(vecCompatID.value)
		keys, err := kvsp.BlockKeys(key, compat, 4, vecTokens)
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) != 2 {
			t.Fatalf("got %d keys, want 2", len(keys))
		}
		for i, want := range []vector{vecK0, vecK1} {
			if keys[i].String() != want.value {
				t.Errorf("%s (%s) = %s, want %s", want.name, want.source, keys[i], want.value)
			}
		}
	})
	t.Run(vecHeader.name, func(t *testing.T) {
		// The container package encodes headers (issue 3); here the
		// field map of CONFORMANCE.md 2.4 is checked against the octets.
		h := mustHex(t, vecHeader.value)
		if len(h) != 52 {
			t.Fatalf("header is %d octets, want 52", len(h))
		}
		sz := uint64(d.BlockTokens) * uint64(d.KVHeads) * uint64(d.HeadDim) * uint64(d.KVDType.Size())
		if d.SectionSize() != sz || sz != 8192 {
			t.Errorf("raw section size = %d, want 8192 (R-CNT-10)", d.SectionSize())
		}
		want := []byte("KVB1\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x04")
		if !bytes.Equal(h[:20], want) {
			t.Errorf("fixed header = %x, want %x", h[:20], want)
		}
		for i := 20; i < 52; i += 8 {
			if got := h[i : i+8]; !bytes.Equal(got, []byte{0, 0, 0, 0, 0, 0, 0x20, 0}) {
				t.Errorf("length at %d = %x, want 8192", i, got)
			}
		}
		// The same octets from the encoder (R-CNT-1..6).
		elem, _ := container.ParseElemType(string(d.KVDType))
		g := container.Geometry{Layers: uint32(d.Layers), BlockTokens: uint32(d.BlockTokens), KVHeads: uint32(d.KVHeads), HeadDim: uint32(d.HeadDim), Elem: elem}
		hd, err := container.NewHeader(container.CodecRaw, 0, 2, g)
		if err != nil {
			t.Fatal(err)
		}
		if got := hd.Append(nil); !bytes.Equal(got, h) {
			t.Errorf("encoded header (%s)\n got %x\nwant %x", vecHeader.source, got, h)
		}
	})
	t.Run("S6 domain separation", func(t *testing.T) { s6DomainSeparation(t, d) })
	t.Run("S6 empty adapters rejected", s6EmptyAdapters)
	t.Run("S6 JCS stable under member reordering", s6JCSReorder)
	t.Run("S6 no collision", s6NoCollision)
}

// TestDerivedVectors checks CONFORMANCE.md 2.5.
func TestDerivedVectors(t *testing.T) {
	for _, c := range derivedIDs {
		if got := kvsp.ResourceID(c.uri); got != c.id.value {
			t.Errorf("%s of %s (%s) = %s, want %s", c.id.name, c.uri, c.id.source, got, c.id.value)
		}
	}
	// the unnormalised spelling normalises to the canonical one.
	if n, err := kvsp.NormalizeBaseURI("https://H1.example:443/kvsp/"); err != nil || n != "https://h1.example/kvsp/" {
		t.Errorf("NormalizeBaseURI = %q, %v", n, err)
	}

	header := mustHex(t, vecHeader.value)
	container := append(header, make([]byte, 4*8192)...)
	sum := sha256.Sum256(container)
	if got := hex.EncodeToString(sum[:]); got != vecZeroContainerSHA.value {
		t.Errorf("%s = %s, want %s", vecZeroContainerSHA.name, got, vecZeroContainerSHA.value)
	}
	if got := "sha-256=:" + base64.StdEncoding.EncodeToString(sum[:]) + ":"; got != vecZeroReprDigest.value {
		t.Errorf("%s = %s, want %s", vecZeroReprDigest.name, got, vecZeroReprDigest.value)
	}
	layer := sha256.Sum256(make([]byte, 2*8192))
	if got := hex.EncodeToString(layer[:]); got != vecZeroLayer.value {
		t.Errorf("%s = %s, want %s", vecZeroLayer.name, got, vecZeroLayer.value)
	}
	two := sha256.Sum256(append(layer[:], layer[:]...))
	if got := hex.EncodeToString(two[:]); got != vecTwoZeroLayers.value {
		t.Errorf("%s = %s, want %s", vecTwoZeroLayers.name, got, vecTwoZeroLayers.value)
	}
	lh := hex.EncodeToString(layer[:])
	wrong := sha256.Sum256([]byte(lh + lh))
	if got := hex.EncodeToString(wrong[:]); got != vecTwoZeroLayersHex.value {
		t.Errorf("%s = %s, want %s", vecTwoZeroLayersHex.name, got, vecTwoZeroLayersHex.value)
	}
	var all []byte
	for range 32 {
		all = append(all, layer[:]...)
	}
	s32 := sha256.Sum256(all)
	if got := hex.EncodeToString(s32[:]); got != vec32ZeroLayers.value {
		t.Errorf("%s = %s, want %s", vec32ZeroLayers.name, got, vec32ZeroLayers.value)
	}
}

// TestRFC8785 checks the JCS implementation on the RFC's examples that
// apply to descriptors: string escaping and member order by UTF-16 code
// units (R-CMP-14).
func TestRFC8785(t *testing.T) {
	got, err := jcs.Transform([]byte(rfc8785StringIn.value))
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != rfc8785StringOut.value {
		t.Errorf("%s (%s):\n got %s\nwant %s", rfc8785StringIn.name, rfc8785StringIn.source, got, rfc8785StringOut.value)
	}
	got, err = jcs.Transform([]byte(rfc8785SortIn.value))
	if err != nil {
		t.Fatal(err)
	}
	last := -1
	for _, v := range rfc8785SortOrder {
		i := bytes.Index(got, []byte(`"`+v+`"`))
		if i < 0 || i < last {
			t.Fatalf("%s: %q out of order in %s", rfc8785SortIn.name, v, got)
		}
		last = i
	}
	// Idempotence: JCS(JCS(x)) == JCS(x).
	again, err := jcs.Transform(got)
	if err != nil || !bytes.Equal(again, got) {
		t.Errorf("JCS is not idempotent: %s vs %s (%v)", again, got, err)
	}
}

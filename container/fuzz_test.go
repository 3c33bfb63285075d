package container

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/kvsp/kvsp/internal/figures"
)

// FuzzParseHeader: the parser never panics, accepts only headers that
// re-encode to the same octets, and reports truncation for every prefix of
// an accepted header.
func FuzzParseHeader(f *testing.F) {
	// Seeds (RELIABILITY B1): the spec's header vector and its truncations.
	spec := unhex(f, appendixHeader)
	for i := 0; i <= len(spec); i += 4 {
		f.Add(spec[:i])
	}
	h, _ := NewHeader(CodecFP8Head, 1, 2, small)
	f.Add(h.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, g := range []Geometry{appendixGeometry, small, {}} { // {}: a holder without the descriptor
			h, n, err := ParseHeader(b, g)
			if err != nil {
				if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnsupportedCodec) {
					t.Fatalf("error outside the package's kinds: %v", err)
				}
				continue
			}
			if !bytes.Equal(h.Append(nil), b[:n]) {
				t.Fatalf("accepted header does not re-encode to its octets")
			}
			for i := 0; i < n; i++ {
				if _, _, err := ParseHeader(b[:i], g); !errors.Is(err, ErrTruncated) {
					t.Fatalf("prefix %d of an accepted header: %v", i, err)
				}
			}
		}
	})
}

// FuzzReader: the streaming Reader and OpenBlock agree on every input: both
// accept with the same digests, or both reject; a yielded layer always has
// the header's lengths. Seeds are encoder output, so mutations of the data
// reach the digest paths while the header stays valid.
func FuzzReader(f *testing.F) {
	rng := rand.New(rand.NewPCG(41, 42))
	for n := 1; n <= 3; n++ {
		data, _ := encode(f, small, CodecRaw, uint32(3-n), randomLayers(rng, small, n))
		f.Add(data)
		// and truncations (RELIABILITY B1): inside the header, at a
		// layer's end, inside a section
		for _, i := range []int{FixedHeaderLen - 1, HeaderLen(n) + 2*int(small.RawSectionLen()), len(data) - 1} {
			f.Add(data[:i])
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		// Without a geometry (a cache server) a block is accepted on what
		// needs none; what it accepts round-trips and is no larger than
		// the input (no allocation from declared sizes).
		if ub, err := OpenBlock(data, Geometry{}); err == nil {
			if !bytes.Equal(ub.Bytes(), data) || ub.Header().Size() != uint64(len(data)) {
				t.Fatal("a block accepted without a geometry is not its octets")
			}
		} else if !errors.Is(err, ErrMalformed) {
			t.Fatalf("without a geometry: an error outside the package's kinds: %v", err)
		}
		b, berr := OpenBlock(data, small)
		r := NewReader(bytes.NewReader(data), small)
		var layers []Digest
		var rerr error
		for {
			l, err := r.Next()
			if err != nil {
				if err != io.EOF {
					rerr = err
				}
				break
			}
			if uint64(len(l.K)) != small.RawSectionLen() || uint64(len(l.V)) != small.RawSectionLen() {
				t.Fatalf("layer %d has sections of %d+%d octets", l.Index, len(l.K), len(l.V))
			}
			layers = append(layers, l.Digest)
		}
		if (berr == nil) != (rerr == nil) {
			t.Fatalf("OpenBlock: %v; Reader: %v", berr, rerr)
		}
		if berr != nil {
			return
		}
		if r.Digests().Container != b.ContainerDigest() {
			t.Fatal("container digests differ")
		}
		for i, d := range b.LayerDigests() {
			if layers[i] != d {
				t.Fatalf("layer %d digests differ", i)
			}
		}
		// With the block's own digests as expectations, the stream verifies.
		r2 := NewReader(bytes.NewReader(data), small)
		all := make([]Digest, small.Layers)
		copy(all[b.Header().FirstLayer:], b.LayerDigests())
		r2.ExpectLayerDigests(all)
		r2.ExpectContainerDigest(b.ContainerDigest())
		for {
			if _, err := r2.Next(); err == io.EOF {
				break
			} else if err != nil {
				t.Fatalf("self-verification failed: %v", err)
			}
		}
	})
}

// parsers runs every parser of the package over data for g: ParseHeader,
// OpenBlock, ReadBlock (with len(data) as the Content-Length) and the
// streaming Reader, the last also with want as the expected layer digests
// (nil: not checked). A panic anywhere fails the test with the input. It
// returns the errors of OpenBlock, ReadBlock, Reader and the verifying
// Reader, and the block OpenBlock accepted.
func parsers(t *testing.T, data []byte, g Geometry, want []Digest) (errs [4]error, blk *Block) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("panic on %d octets %x: %v", len(data), data[:min(len(data), 96)], p)
		}
	}()
	ParseHeader(data, g)
	blk, errs[0] = OpenBlock(data, g)
	_, errs[1] = ReadBlock(bytes.NewReader(data), int64(len(data)), g)
	read := func(expect []Digest) error {
		r := NewReader(bytes.NewReader(data), g)
		if expect != nil {
			r.ExpectLayerDigests(expect)
		}
		for {
			l, err := r.Next()
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return err
			}
			if expect != nil && l.Digest != expect[l.Index] {
				t.Fatalf("the Reader yielded layer %d whose digest is not the expected one", l.Index)
			}
		}
	}
	errs[2] = read(nil)
	if want != nil {
		errs[3] = read(want)
	}
	return errs, blk
}

// typed reports whether err is one of the package's error kinds, with a
// message that says it is the container's.
func typed(err error) bool {
	return (errors.Is(err, ErrMalformed) || errors.Is(err, ErrUnsupportedCodec) || errors.Is(err, ErrDigestMismatch)) &&
		strings.HasPrefix(err.Error(), "container: ")
}

// reencode writes blk's layers again under its header: an accepted
// container must come out octet for octet.
func reencode(t *testing.T, blk *Block) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := NewWriter(&buf, *blk.Header())
	for l := blk.Header().FirstLayer; l <= blk.Header().LastLayer(); l++ {
		k, v, _ := blk.Layer(l)
		if err := w.WriteLayer(k, v); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestB1_ContainerParserCorpus (RELIABILITY B1, A-9, STYLE rule 2): the
// seed corpus of FuzzParseHeader and FuzzReader run as a test, with the
// row's invariants asserted on every input: the spec's header vector
// (KVSP §Test Vectors) and a container built on it, and an encoder-made
// container, each through every truncation and every single-octet
// mutation, through every parser. No panic; every rejection is one of
// the package's error kinds, a truncation is ErrTruncated, and a data
// octet changed under the expected layer digests is ErrDigestMismatch
// (never a yielded layer); the parsers agree; what is accepted
// re-encodes to the same octets; and nothing is allocated for what a
// header declares before its sizes have been checked.
func TestB1_ContainerParserCorpus(t *testing.T) {
	specHdr := unhex(t, appendixHeader)
	spec := append(bytes.Clone(specHdr), make([]byte, 4*8192)...)
	rng := rand.New(rand.NewPCG(61, 62))
	enc, encD := encode(t, small, CodecRaw, 0, randomLayers(rng, small, 3))
	zeros := make([]Digest, appendixGeometry.Layers)
	for i := range zeros {
		zeros[i] = LayerDigest(make([]byte, 8192), make([]byte, 8192))
	}
	inputs := 0

	// The header vector alone: every prefix is ErrTruncated, and every
	// mutation of an octet is rejected with a kind, or (where the field
	// allows another valid value) accepted and re-encoded identically.
	for i := 0; i <= len(specHdr); i++ {
		h, n, err := ParseHeader(specHdr[:i], appendixGeometry)
		inputs++
		if i < len(specHdr) && (!errors.Is(err, ErrTruncated) || !typed(err)) {
			t.Fatalf("header prefix %d: %v", i, err)
		}
		if i == len(specHdr) && (err != nil || n != 52 || !bytes.Equal(h.Append(nil), specHdr)) {
			t.Fatalf("the header vector does not round-trip: %v", err)
		}
	}
	for off := range specHdr {
		for x := 1; x < 256; x++ {
			b := bytes.Clone(specHdr)
			b[off] ^= byte(x)
			inputs++
			h, n, err := func() (h Header, n int, err error) {
				defer func() {
					if p := recover(); p != nil {
						t.Fatalf("ParseHeader panicked on octet %d ^ %#x: %v", off, x, p)
					}
				}()
				return ParseHeader(b, appendixGeometry)
			}()
			if err != nil {
				if !typed(err) {
					t.Fatalf("octet %d ^ %#x: untyped error %v", off, x, err)
				}
				continue
			}
			if !bytes.Equal(h.Append(nil), b[:n]) {
				t.Fatalf("octet %d ^ %#x: accepted, but re-encodes differently", off, x)
			}
			if off < 8 || off >= 16 {
				// Magic, version, flags, codec, token count and the
				// section lengths have one valid value each here (a
				// smaller first layer or layer count is another header).
				t.Fatalf("octet %d ^ %#x (%x): accepted a header the geometry forbids", off, x, b)
			}
		}
	}

	// Whole containers: the spec's (zero layers, 32 KiB) and an
	// encoder-made one of the small geometry.
	for _, c := range []struct {
		name string
		data []byte
		g    Geometry
		want []Digest
		hl   int
		// every truncation through the streaming parsers (quadratic in
		// the size): the small one; the spec's at its boundaries only.
		allPrefixes bool
	}{
		{"spec vector", spec, appendixGeometry, zeros, 52, false},
		{"encoder", enc, small, encD.Layers, HeaderLen(3), true},
	} {
		if errs, blk := parsers(t, c.data, c.g, c.want); errs != [4]error{} || !bytes.Equal(reencode(t, blk), c.data) {
			t.Fatalf("%s: the valid container: %v", c.name, errs)
		}
		sec := int(c.g.RawSectionLen())
		for i := 0; i < len(c.data); i++ {
			inputs++
			if !c.allPrefixes && i > c.hl+1 && (i-c.hl)%sec > 1 && (i-c.hl)%sec < sec-1 {
				// Between section boundaries: OpenBlock and ReadBlock only
				// (they check the size before touching the data).
				if _, err := OpenBlock(c.data[:i], c.g); !errors.Is(err, ErrTruncated) {
					t.Fatalf("%s: prefix %d: OpenBlock: %v", c.name, i, err)
				}
				if _, err := ReadBlock(bytes.NewReader(c.data[:i]), int64(i), c.g); !errors.Is(err, ErrMalformed) {
					t.Fatalf("%s: prefix %d: ReadBlock: %v", c.name, i, err)
				}
				continue
			}
			errs, _ := parsers(t, c.data[:i], c.g, c.want)
			for j, err := range errs[:3] {
				// ReadBlock told the prefix's length is the whole body:
				// the header's sizes disagree (malformed), or the header
				// itself is cut (truncated).
				if j == 1 && i >= c.hl && errors.Is(err, ErrMalformed) {
					continue
				}
				if !errors.Is(err, ErrTruncated) || !typed(err) {
					t.Fatalf("%s: prefix %d: parser %d: %v", c.name, i, j, err)
				}
			}
		}
		// Every single-octet change: a header octet is a typed rejection
		// or an identical re-encoding; a data octet is accepted (the
		// container is well formed) but fails its layer digest, and the
		// verifying Reader never yields that layer.
		offs := make([]int, 0, len(c.data))
		for off := range c.data {
			if off < c.hl || off%97 == 0 || off-c.hl < 4 || len(c.data)-off < 4 || c.allPrefixes {
				offs = append(offs, off)
			}
		}
		for _, off := range offs {
			for _, x := range []byte{0x01, 0x80, 0xff} {
				b := bytes.Clone(c.data)
				b[off] ^= x
				inputs++
				errs, blk := parsers(t, b, c.g, c.want)
				if (errs[0] == nil) != (errs[1] == nil) || (errs[0] == nil) != (errs[2] == nil) {
					t.Fatalf("%s: octet %d ^ %#x: the parsers disagree: %v", c.name, off, x, errs)
				}
				if off < c.hl {
					for _, err := range errs {
						if err != nil && !typed(err) {
							t.Fatalf("%s: header octet %d ^ %#x: untyped error %v", c.name, off, x, err)
						}
					}
					if errs[0] == nil && !bytes.Equal(reencode(t, blk), b) {
						t.Fatalf("%s: header octet %d ^ %#x: accepted, re-encodes differently", c.name, off, x)
					}
					continue
				}
				if errs[0] != nil || !bytes.Equal(reencode(t, blk), b) {
					t.Fatalf("%s: data octet %d ^ %#x: %v", c.name, off, x, errs)
				}
				if !errors.Is(errs[3], ErrDigestMismatch) || blk.Verify(c.want) == nil {
					t.Fatalf("%s: data octet %d ^ %#x passed the layer digests: %v", c.name, off, x, errs[3])
				}
			}
		}
	}

	// No allocation for what a header declares before its sizes are
	// checked: a header declaring 2^32-1 layers, or sections of 2^63
	// octets, or a body of 1 TiB behind a 52-octet one, costs a few
	// hundred octets (the error), not the declared size.
	huge := bytes.Clone(specHdr)
	copy(huge[12:], []byte{0xff, 0xff, 0xff, 0xff})
	bigLen := bytes.Clone(specHdr)
	copy(bigLen[20:], []byte{0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	for name, f := range map[string]func() error{
		"layer count 2^32-1, ParseHeader": func() error { _, _, err := ParseHeader(huge, appendixGeometry); return err },
		"layer count 2^32-1, Reader":      func() error { _, err := NewReader(bytes.NewReader(huge), appendixGeometry).Header(); return err },
		"section 2^63, ParseHeader":       func() error { _, _, err := ParseHeader(bigLen, appendixGeometry); return err },
		"section 2^63, ReadBlock":         func() error { _, err := ReadBlock(bytes.NewReader(bigLen), 1<<62, appendixGeometry); return err },
		"1 TiB announced, ReadBlock":      func() error { _, err := ReadBlock(bytes.NewReader(specHdr), 1<<40, appendixGeometry); return err },
		"1 TiB announced, OpenBlock":      func() error { _, err := OpenBlock(specHdr, appendixGeometry); return err },
	} {
		if err := f(); !typed(err) {
			t.Fatalf("%s: %v", name, err)
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const runs = 100
		for range runs {
			f()
		}
		runtime.ReadMemStats(&after)
		if per := (after.TotalAlloc - before.TotalAlloc) / runs; per > 2048 {
			t.Errorf("%s: %d octets allocated per parse", name, per)
		}
	}
	t.Logf("%d inputs", inputs)
	figures.Report(t, figures.Row{Row: "B1", Inputs: int64(inputs),
		Held:   fmt.Sprintf("%d truncated, flipped and mutated containers: no panic, a typed error each, round trips identical, no allocation from declared sizes", inputs),
		Detail: map[string]float64{"inputs": float64(inputs)}})
}

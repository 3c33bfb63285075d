package container

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"math/rand/v2"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The appendix geometry and header (KVSP §Test Vectors; CONFORMANCE.md 2.2,
// 2.4, 2.5). These values are never edited to make code pass.
var (
	appendixGeometry = Geometry{Layers: 32, BlockTokens: 4, KVHeads: 8, HeadDim: 128, Elem: BF16}
	appendixHeader   = "4b564231" + "01" + "00" + "0001" + "00000000" + "00000002" + "00000004" +
		strings.Repeat("0000000000002000", 4)
	derivedZeroContainerSHA = "f98ae5e40d6faf140d1d041b8fc0ac0897f2813e55cb7986829af6ea73c8445f"
	derivedZeroRepr         = "sha-256=:+Yrl5A1vrxQNHQQbj8CsCJfygT5Vy3mGgpr26nPIRF8=:"
	derivedZeroLayer        = "4fe7b59af6de3b665b67788cc2f99892ab827efae3a467342b3bb4e3bc8e5bfe"
	derivedTwoZeroLayers    = "c36d0dd6a886e1fce758b6b5c531b703a1f21e8f6453785c390931cf8fa8a76d"
	derived32ZeroLayers     = "c4081f861e5348bea93d6d13087a2466118f72e397cc5deb8ca8eb3821b01e77"
)

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestAppendixHeader: the 52-octet header encodes and parses exactly
// (R-CNT-1..7, A-9).
func TestAppendixHeader(t *testing.T) {
	want := unhex(t, appendixHeader)
	h, err := NewHeader(CodecRaw, 0, 2, appendixGeometry)
	if err != nil {
		t.Fatal(err)
	}
	if got := h.Append(nil); !bytes.Equal(got, want) {
		t.Fatalf("header\n got %x\nwant %x", got, want)
	}
	p, n, err := ParseHeader(want, appendixGeometry)
	if err != nil || n != 52 || p.Codec != 1 || p.FirstLayer != 0 || p.LayerCount() != 2 || p.TokenCount != 4 || p.Layers[1] != (LayerLen{8192, 8192}) {
		t.Fatalf("parse: %+v %d %v", p, n, err)
	}
	if p.Size() != 52+4*8192 {
		t.Errorf("size %d, want 32820", p.Size())
	}
	// Every truncation of the header is ErrTruncated (STYLE rule 2).
	for i := range want {
		if _, _, err := ParseHeader(want[:i], appendixGeometry); !errors.Is(err, ErrTruncated) || !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("prefix %d: %v", i, err)
		}
	}
}

// TestDerivedDigests: CONFORMANCE.md 2.5 through the package's own paths.
func TestDerivedDigests(t *testing.T) {
	data := append(unhex(t, appendixHeader), make([]byte, 4*8192)...)
	b, err := OpenBlock(data, appendixGeometry)
	if err != nil {
		t.Fatal(err)
	}
	cd, rd := b.ContainerDigest(), b.ReplicaDigest()
	if got := hex.EncodeToString(cd[:]); got != derivedZeroContainerSHA {
		t.Errorf("container digest %s, want %s", got, derivedZeroContainerSHA)
	}
	if got := ReprDigest(b.ContainerDigest()); got != derivedZeroRepr {
		t.Errorf("Repr-Digest %s, want %s", got, derivedZeroRepr)
	}
	if got := hex.EncodeToString(b.LayerDigests()[0][:]); got != derivedZeroLayer {
		t.Errorf("layer digest %s, want %s", got, derivedZeroLayer)
	}
	if got := hex.EncodeToString(rd[:]); got != derivedTwoZeroLayers {
		t.Errorf("replica digest %s, want %s", got, derivedTwoZeroLayers)
	}
	zeros := make([]Digest, 32)
	for i := range zeros {
		zeros[i] = LayerDigest(make([]byte, 8192), make([]byte, 8192))
	}
	if got := ReplicaDigest(zeros); hex.EncodeToString(got[:]) != derived32ZeroLayers {
		t.Errorf("32-layer replica digest %x", got)
	}
	if b.PayloadSize() != 4*8192 {
		t.Errorf("payload %d (A-1)", b.PayloadSize())
	}
}

// TestHeaderRejects lists decision A-9's rejections (R-CNT-1..6, R-CNT-14,
// R-REG-4).
func TestHeaderRejects(t *testing.T) {
	base := unhex(t, appendixHeader)
	mut := func(off int, val ...byte) []byte {
		b := bytes.Clone(base)
		copy(b[off:], val)
		return b
	}
	for name, b := range map[string][]byte{
		"R-CNT-1 magic KVB2":                mut(3, '2'),
		"R-CNT-2 version 2":                 mut(4, 2),
		"R-CNT-3 flags 0x80":                mut(5, 0x80),
		"R-REG-4 codec 0":                   mut(6, 0, 0),
		"unknown codec 0x0002":              mut(6, 0, 2),
		"layer count 0":                     mut(12, 0, 0, 0, 0),
		"first+count beyond layers":         mut(8, 0, 0, 0, 31),
		"layer count beyond layers":         mut(12, 0, 0, 0, 33),
		"layer count 2^32-1, no allocation": mut(12, 0xff, 0xff, 0xff, 0xff),
		"R-CNT-14 token count != B":         mut(16, 0, 0, 0, 8),
		"R-CNT-10 K length != raw size":     mut(20, 0, 0, 0, 0, 0, 0, 0x20, 1),
		"R-CNT-10 V length huge":            mut(44, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff),
	} {
		_, _, err := ParseHeader(b, appendixGeometry)
		if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnsupportedCodec) {
			t.Errorf("%s: err = %v", name, err)
		}
	}
}

// small is a geometry for exhaustive loops: 3 layers of 2 tokens x 1 head
// x 4 dims of bf16, 16-octet sections.
var small = Geometry{Layers: 3, BlockTokens: 2, KVHeads: 1, HeadDim: 4, Elem: BF16}

// encode writes layers first..first+len(layers)-1 with a Writer.
func encode(t testing.TB, g Geometry, codec uint16, first uint32, layers [][2][]byte) ([]byte, Digests) {
	t.Helper()
	h, err := NewHeader(codec, first, uint32(len(layers)), g)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	w := NewWriter(&buf, h)
	for _, l := range layers {
		if err := w.WriteLayer(l[0], l[1]); err != nil {
			t.Fatal(err)
		}
	}
	d, err := w.Close()
	if err != nil {
		t.Fatal(err)
	}
	d.Layers = append([]Digest(nil), d.Layers...)
	return buf.Bytes(), d
}

func randomLayers(rng *rand.Rand, g Geometry, n int) [][2][]byte {
	out := make([][2][]byte, n)
	for i := range out {
		for j := range out[i] {
			b := make([]byte, g.RawSectionLen())
			for k := range b {
				b[k] = byte(rng.Uint32())
			}
			out[i][j] = b
		}
	}
	return out
}

// TestRoundTrip: Writer, Reader and OpenBlock agree on bytes and digests;
// layer ranges are byte-identical to the same layers of the full
// container (R-CNT-8, R-CNT-12, R-CNT-13, R-CNT-15).
func TestRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	g := Geometry{Layers: 8, BlockTokens: 4, KVHeads: 2, HeadDim: 8, Elem: FP16}
	layers := randomLayers(rng, g, 8)
	data, wd := encode(t, g, CodecRaw, 0, layers)
	if sha256.Sum256(data) != wd.Container {
		t.Fatal("writer container digest is not SHA-256 of the bytes")
	}
	r := NewReader(bytes.NewReader(data), g)
	for i := 0; ; i++ {
		l, err := r.Next()
		if err == io.EOF {
			if i != 8 {
				t.Fatalf("EOF after %d layers", i)
			}
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if l.Index != uint32(i) || !bytes.Equal(l.K, layers[i][0]) || !bytes.Equal(l.V, layers[i][1]) || l.Digest != wd.Layers[i] {
			t.Fatalf("layer %d differs", i)
		}
		if l.Digest != LayerDigest(layers[i][0], layers[i][1]) {
			t.Fatalf("layer %d digest is not SHA-256(K||V)", i)
		}
	}
	if rd := r.Digests(); rd.Container != wd.Container || len(rd.Layers) != 8 {
		t.Fatal("reader digests differ")
	}
	b, err := OpenBlock(data, g)
	if err != nil {
		t.Fatal(err)
	}
	if b.ContainerDigest() != wd.Container || b.ReplicaDigest() != ReplicaDigest(wd.Layers) {
		t.Fatal("block digests differ")
	}
	for first := uint32(0); first < 8; first++ {
		for last := first; last < 8; last++ {
			v, err := b.Range(first, last)
			if err != nil {
				t.Fatal(err)
			}
			var got bytes.Buffer
			n, err := v.WriteTo(&got)
			if err != nil || n != v.Len() || int64(got.Len()) != v.Len() {
				t.Fatalf("WriteTo %d-%d: %d %v", first, last, n, err)
			}
			want, wd2 := encode(t, g, CodecRaw, first, layers[first:last+1])
			if !bytes.Equal(got.Bytes(), want) {
				t.Fatalf("range %d-%d differs from an encoding of those layers", first, last)
			}
			if v.Digest() != wd2.Container || v.Digest() != sha256.Sum256(want) {
				t.Fatalf("range %d-%d digest", first, last)
			}
			// The sub-container verifies against the full layer digests.
			rr := NewReader(bytes.NewReader(want), g)
			rr.ExpectLayerDigests(wd.Layers)
			rr.ExpectContainerDigest(v.Digest())
			for {
				if _, err := rr.Next(); err == io.EOF {
					break
				} else if err != nil {
					t.Fatalf("range %d-%d: %v", first, last, err)
				}
			}
		}
	}
	if _, err := b.Range(5, 4); err == nil {
		t.Error("range 5-4 accepted")
	}
	if _, err := b.Range(0, 8); err == nil {
		t.Error("range beyond the block accepted")
	}
	if err := b.Verify(wd.Layers); err != nil {
		t.Error(err)
	}
	if got, err := VerifyParallel(data, g, wd.Layers, 4); err != nil || got[7] != wd.Layers[7] {
		t.Errorf("VerifyParallel: %v", err)
	}
}

// TestTruncationNeverPartial: every prefix of a container fails with a
// truncation error, and the Reader never yields a layer whose octets had
// not all arrived; trailing octets are refused.
func TestTruncationNeverPartial(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	layers := randomLayers(rng, small, 3)
	data, _ := encode(t, small, CodecRaw, 0, layers)
	hl := HeaderLen(3)
	sec := int(small.RawSectionLen())
	for i := 0; i < len(data); i++ {
		if _, err := OpenBlock(data[:i], small); !errors.Is(err, ErrTruncated) {
			t.Fatalf("OpenBlock prefix %d: %v", i, err)
		}
		r := NewReader(bytes.NewReader(data[:i]), small)
		yielded := 0
		var err error
		for {
			var l Layer
			l, err = r.Next()
			if err != nil {
				break
			}
			if end := hl + (int(l.Index)+1)*2*sec; end > i {
				t.Fatalf("prefix %d: layer %d yielded before its last octet (%d)", i, l.Index, end)
			}
			yielded++
		}
		if !errors.Is(err, ErrTruncated) {
			t.Fatalf("prefix %d: err = %v after %d layers", i, err, yielded)
		}
	}
	extra := append(bytes.Clone(data), 0)
	if _, err := OpenBlock(extra, small); !errors.Is(err, ErrMalformed) {
		t.Errorf("OpenBlock with a trailing octet: %v", err)
	}
	r := NewReader(bytes.NewReader(extra), small)
	var err error
	for err == nil {
		_, err = r.Next()
	}
	if !errors.Is(err, ErrMalformed) || errors.Is(err, ErrTruncated) {
		t.Errorf("Reader with a trailing octet: %v", err)
	}
}

// TestB2_ReaderDigestChecks (RELIABILITY B2, container half; formerly
// TestReaderDigestChecks): a corrupted layer stops the stream at that
// layer, after the good ones (R-BLK-9, R-ERR-12); a wrong container digest
// fails at the end (R-BLK-8). The holder half, PUT and GET of corrupted
// blocks, is holder.TestB2_CorruptedBlock.
func TestB2_ReaderDigestChecks(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	layers := randomLayers(rng, small, 3)
	data, d := encode(t, small, CodecRaw, 0, layers)
	bad := bytes.Clone(data)
	bad[HeaderLen(3)+2*int(small.RawSectionLen())+1] ^= 1 // layer 1, K
	r := NewReader(bytes.NewReader(bad), small)
	r.ExpectLayerDigests(d.Layers)
	if l, err := r.Next(); err != nil || l.Index != 0 {
		t.Fatalf("layer 0: %v", err)
	}
	if _, err := r.Next(); !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("corrupted layer 1: %v", err)
	}
	if _, err := r.Next(); !errors.Is(err, ErrDigestMismatch) {
		t.Fatal("reader continued after a digest failure")
	}
	r = NewReader(bytes.NewReader(data), small)
	r.ExpectContainerDigest(Digest{1})
	var err error
	for i := 0; err == nil; i++ {
		_, err = r.Next()
	}
	if !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("wrong container digest: %v", err)
	}
	if _, err := OpenBlock(bad, small); err != nil {
		t.Fatal(err)
	} else if b, _ := OpenBlock(bad, small); b.Verify(d.Layers) == nil {
		t.Fatal("Block.Verify passed a corrupted layer")
	}
	if _, err := VerifyParallel(bad, small, d.Layers, 2); !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("VerifyParallel: %v", err)
	}
}

// TestReaderStreams: layer 0 is available while layer 1 is still in flight
// (R-CNT-9).
func TestReaderStreams(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	layers := randomLayers(rng, small, 3)
	data, _ := encode(t, small, CodecRaw, 0, layers)
	pr, pw := io.Pipe()
	firstEnd := HeaderLen(3) + 2*int(small.RawSectionLen())
	go func() {
		pw.Write(data[:firstEnd])
		// the rest is written only after layer 0 was consumed
	}()
	r := NewReader(pr, small)
	l, err := r.Next()
	if err != nil || l.Index != 0 || !bytes.Equal(l.V, layers[0][1]) {
		t.Fatalf("layer 0 not available before the rest: %v", err)
	}
	go func() {
		pw.Write(data[firstEnd:])
		pw.Close()
	}()
	n := 1
	for {
		if _, err := r.Next(); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		n++
	}
	if n != 3 {
		t.Fatalf("%d layers", n)
	}
}

// TestWriterFromReaders: sections can come from readers; a short source
// fails the container, and a wrong section length is refused.
func TestWriterFromReaders(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	layers := randomLayers(rng, small, 3)
	want, wd := encode(t, small, CodecRaw, 0, layers)
	h, _ := NewHeader(CodecRaw, 0, 3, small)
	var buf bytes.Buffer
	w := NewWriter(&buf, h)
	for _, l := range layers {
		if err := w.WriteLayerFrom(iotest(l[0]), iotest(l[1])); err != nil {
			t.Fatal(err)
		}
	}
	d, err := w.Close()
	if err != nil || !bytes.Equal(buf.Bytes(), want) || d.Container != wd.Container {
		t.Fatalf("WriteLayerFrom: %v", err)
	}
	w.Reset(io.Discard, h)
	if err := w.WriteLayerFrom(bytes.NewReader(layers[0][0][:3]), bytes.NewReader(layers[0][1])); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("short source: %v", err)
	}
	if _, err := w.Close(); err == nil {
		t.Fatal("Close after a failed layer succeeded")
	}
	w.Reset(io.Discard, h)
	if err := w.WriteLayer(layers[0][0][:3], layers[0][1]); !errors.Is(err, ErrMalformed) {
		t.Fatalf("short section: %v", err)
	}
	w.Reset(io.Discard, h)
	w.WriteLayer(layers[0][0], layers[0][1])
	if _, err := w.Close(); !errors.Is(err, ErrMalformed) {
		t.Fatalf("Close with missing layers: %v", err)
	}
}

// iotest returns a reader that yields b a few octets at a time.
func iotest(b []byte) io.Reader { return &trickle{b} }

type trickle struct{ b []byte }

func (t *trickle) Read(p []byte) (int, error) {
	if len(t.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), 5)], t.b)
	t.b = t.b[n:]
	return n, nil
}

func TestReprDigestField(t *testing.T) {
	d := sha256.Sum256([]byte("x"))
	for _, f := range []string{ReprDigest(d), "sha-512=:AAAA:, " + ReprDigest(d), ReprDigest(d) + ";p=1", "md5=:AA==:,sha-256=" + ReprDigest(d)[8:]} {
		if got, err := ParseReprDigest(f); err != nil || got != d {
			t.Errorf("ParseReprDigest(%q) = %x, %v", f, got, err)
		}
	}
	for _, f := range []string{"", "sha-512=:AAAA:", "sha-256=abc", "sha-256=:AAAA:", "sha-256=:" + strings.Repeat("A", 43) + ":"} {
		if _, err := ParseReprDigest(f); err == nil {
			t.Errorf("ParseReprDigest(%q) accepted", f)
		}
	}
}

// TestZeroAllocs: range views, view writes, and steady-state reading and
// writing allocate nothing per layer.
func TestZeroAllocs(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	g := Geometry{Layers: 32, BlockTokens: 16, KVHeads: 2, HeadDim: 16, Elem: BF16}
	layers := randomLayers(rng, g, 32)
	data, _ := encode(t, g, CodecRaw, 0, layers)
	b, err := OpenBlock(data, g)
	if err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() { b.Range(3, 17) }); n != 0 {
		t.Errorf("Range: %v allocs", n)
	}
	v, _ := b.Range(3, 17)
	if n := testing.AllocsPerRun(100, func() { v.WriteTo(io.Discard) }); n != 0 {
		t.Errorf("View.WriteTo: %v allocs", n)
	}
	br := bytes.NewReader(data)
	r := NewReader(br, g)
	read := func() {
		br.Reset(data)
		r.Reset(br, g)
		for {
			if _, err := r.Next(); err != nil {
				break
			}
		}
	}
	read()
	if n := testing.AllocsPerRun(20, read); n > 0 {
		t.Errorf("Reader: %v allocs per container of 32 layers", n)
	}
	h, _ := NewHeader(CodecRaw, 0, 32, g)
	w := NewWriter(io.Discard, h)
	write := func() {
		w.Reset(io.Discard, h)
		for _, l := range layers {
			w.WriteLayer(l[0], l[1])
		}
		w.Close()
	}
	write()
	if n := testing.AllocsPerRun(20, write); n > 0 {
		t.Errorf("Writer: %v allocs per container of 32 layers", n)
	}
}

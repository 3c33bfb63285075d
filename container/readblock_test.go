package container

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"testing"
)

// TestReadBlockMatchesOpenBlock: streaming in with overlapped hashing gives
// the same block and digests as OpenBlock; every truncation and any
// trailing octet fail.
func TestReadBlockMatchesOpenBlock(t *testing.T) {
	rng := rand.New(rand.NewPCG(51, 52))
	g := Geometry{Layers: 8, BlockTokens: 16, KVHeads: 8, HeadDim: 128, Elem: BF16} // 32 KiB sections: several chunks
	data, _ := encode(t, g, CodecRaw, 0, randomLayers(rng, g, 8))
	want, err := OpenBlock(data, g)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadBlock(iotest(data), int64(len(data)), g)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), data) || got.ContainerDigest() != want.ContainerDigest() || got.ReplicaDigest() != want.ReplicaDigest() {
		t.Fatal("ReadBlock differs from OpenBlock")
	}
	for i, d := range want.LayerDigests() {
		if got.LayerDigests()[i] != d {
			t.Fatalf("layer %d digest differs", i)
		}
	}
	// Into a recycled buffer, larger and full of another block's octets.
	dirty := bytes.Repeat([]byte{0xa5}, len(data)+4096)
	var asked int
	got2, err := ReadBlockInto(iotest(data), int64(len(data)), g, func(n int) []byte { asked = n; return dirty })
	if err != nil || asked != len(data) || !bytes.Equal(got2.Bytes(), data) || &got2.Bytes()[0] != &dirty[0] ||
		got2.ContainerDigest() != want.ContainerDigest() || got2.ReplicaDigest() != want.ReplicaDigest() {
		t.Fatalf("ReadBlockInto differs from OpenBlock (asked %d): %v", asked, err)
	}
	for _, cut := range []int{0, 10, 100, 5000, len(data) / 2, len(data) - 1} {
		if _, err := ReadBlock(bytes.NewReader(data[:cut]), int64(len(data)), g); !errors.Is(err, ErrTruncated) {
			t.Fatalf("cut at %d: %v", cut, err)
		}
	}
	if _, err := ReadBlock(bytes.NewReader(append(bytes.Clone(data), 1)), int64(len(data)), g); !errors.Is(err, ErrMalformed) {
		t.Fatalf("trailing octet: %v", err)
	}
	if _, err := ReadBlock(bytes.NewReader(data), int64(len(data))+1, g); !errors.Is(err, ErrMalformed) {
		t.Fatalf("wrong announced size: %v", err)
	}
	if _, err := ReadBlock(io.MultiReader(bytes.NewReader(data[:7]), errReader{}), int64(len(data)), g); err == nil || errors.Is(err, ErrTruncated) {
		t.Fatalf("read error: %v", err)
	}
}

// TestReadBlockHooks: Header comes once, before any layer, with the
// validated header; Layer gets every layer's octets exactly once, in order,
// equal to the block's.
func TestReadBlockHooks(t *testing.T) {
	rng := rand.New(rand.NewPCG(53, 54))
	g := Geometry{Layers: 8, BlockTokens: 16, KVHeads: 8, HeadDim: 128, Elem: BF16}
	data, _ := encode(t, g, CodecRaw, 0, randomLayers(rng, g, 8))
	var (
		headers int
		layers  [][]byte
	)
	blk, err := ReadBlockWith(iotest(data), int64(len(data)), g, ReadOptions{
		Header: func(h *Header) {
			if len(layers) > 0 || len(h.Layers) != 8 {
				t.Errorf("header after a layer, or with %d layers", len(h.Layers))
			}
			headers++
		},
		Layer: func(i int, p []byte) {
			if i != len(layers) {
				t.Errorf("layer %d after %d", i, len(layers))
			}
			layers = append(layers, bytes.Clone(p))
		},
	})
	if err != nil || headers != 1 || len(layers) != 8 {
		t.Fatalf("hooks: %v, %d headers, %d layers", err, headers, len(layers))
	}
	for i, l := range layers {
		k, v, _ := blk.Layer(uint32(i))
		if !bytes.Equal(l, append(bytes.Clone(k), v...)) {
			t.Fatalf("layer %d octets differ", i)
		}
	}
}

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errors.New("connection reset") }

// BenchmarkReadBlock: receiving a 2 MiB block with overlapped hashing,
// against OpenBlock over the same octets.
func BenchmarkReadBlock(b *testing.B) {
	data, _, _ := benchBlock(b, 32)
	g := benchGeometry(32)
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ReadBlock(bytes.NewReader(data), int64(len(data)), g); err != nil {
			b.Fatal(err)
		}
	}
}

// TestAdoptBlock: adopting a container with its known digests gives the
// Block OpenBlock gives, and structural errors are still caught.
func TestAdoptBlock(t *testing.T) {
	rng := rand.New(rand.NewPCG(61, 62))
	g := Geometry{Layers: 4, BlockTokens: 16, KVHeads: 2, HeadDim: 64, Elem: BF16}
	data, _ := encode(t, g, CodecRaw, 0, randomLayers(rng, g, 4))
	want, err := OpenBlock(data, g)
	if err != nil {
		t.Fatal(err)
	}
	got, err := AdoptBlock(data, g, want.LayerDigests(), want.ContainerDigest())
	if err != nil || got.ContainerDigest() != want.ContainerDigest() || got.ReplicaDigest() != want.ReplicaDigest() || got.PayloadSize() != want.PayloadSize() {
		t.Fatalf("adopted block differs: %v", err)
	}
	v1, _ := got.Range(1, 2)
	v2, _ := want.Range(1, 2)
	if v1.Digest() != v2.Digest() || !bytes.Equal(v1.Data(), v2.Data()) {
		t.Fatal("range differs")
	}
	if _, err := AdoptBlock(data[:len(data)-1], g, want.LayerDigests(), want.ContainerDigest()); err == nil {
		t.Fatal("a truncated container was adopted")
	}
	if _, err := AdoptBlock(data, g, want.LayerDigests()[:3], want.ContainerDigest()); err == nil {
		t.Fatal("a digest list of the wrong length was adopted")
	}
}

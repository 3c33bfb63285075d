package container

import (
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"testing"
)

// Benchmark blocks: 16 tokens x 8 heads x 128 x bf16 per section, 32 layers
// (2 MiB of payload, the spec's example size) and 80 layers.
func benchGeometry(layers uint32) Geometry {
	return Geometry{Layers: layers, BlockTokens: 16, KVHeads: 8, HeadDim: 128, Elem: BF16}
}

func benchBlock(b *testing.B, layers uint32) ([]byte, [][2][]byte, Digests) {
	g := benchGeometry(layers)
	rng := rand.New(rand.NewPCG(uint64(layers), 1))
	ls := randomLayers(rng, g, int(layers))
	data, d := encode(b, g, CodecRaw, 0, ls)
	return data, ls, d
}

// BenchmarkBounds measures, in the same run, the bounds the container's
// figures are compared with: SHA-256 and copy over a whole block.
func BenchmarkBounds(b *testing.B) {
	for _, layers := range []uint32{32, 80} {
		data, _, _ := benchBlock(b, layers)
		b.Run(fmt.Sprintf("sha256/layers=%d", layers), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				sha256.Sum256(data)
			}
		})
		b.Run(fmt.Sprintf("copy/layers=%d", layers), func(b *testing.B) {
			dst := make([]byte, len(data))
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				copy(dst, data)
			}
		})
	}
}

// BenchmarkEncode writes a block with a Writer computing its layer digests
// and container digest: two SHA-256 passes' worth of hashing, so the bound
// is half the SHA-256 rate.
func BenchmarkEncode(b *testing.B) {
	for _, layers := range []uint32{32, 80} {
		data, ls, _ := benchBlock(b, layers)
		h, _ := NewHeader(CodecRaw, 0, layers, benchGeometry(layers))
		w := NewWriter(io.Discard, h)
		b.Run(fmt.Sprintf("layers=%d", layers), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				w.Reset(io.Discard, h)
				for _, l := range ls {
					w.WriteLayer(l[0], l[1])
				}
				if _, err := w.Close(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// sliceReader is a bytes.Reader without WriteTo tricks, resettable.
type sliceReader struct{ b []byte }

func (r *sliceReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// BenchmarkDecode reads a block with full verification (layer digests
// against expectations, container digest): two SHA-256 passes plus the copy
// out of the stream.
func BenchmarkDecode(b *testing.B) {
	for _, layers := range []uint32{32, 80} {
		data, _, d := benchBlock(b, layers)
		g := benchGeometry(layers)
		src := &sliceReader{}
		r := NewReader(src, g)
		b.Run(fmt.Sprintf("layers=%d", layers), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				src.b = data
				r.Reset(src, g)
				r.ExpectLayerDigests(d.Layers)
				r.ExpectContainerDigest(d.Container)
				for {
					if _, err := r.Next(); err == io.EOF {
						break
					} else if err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// BenchmarkOpenBlock validates a stored block and computes its digests,
// with the container digest on one core and layer digests on the others.
func BenchmarkOpenBlock(b *testing.B) {
	for _, layers := range []uint32{32, 80} {
		data, _, _ := benchBlock(b, layers)
		g := benchGeometry(layers)
		b.Run(fmt.Sprintf("layers=%d", layers), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := OpenBlock(data, g); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRange: a layer-range view is O(1) and allocation-free; writing
// it hands the stored octets over in one Write.
func BenchmarkRange(b *testing.B) {
	data, _, _ := benchBlock(b, 80)
	blk, err := OpenBlock(data, benchGeometry(80))
	if err != nil {
		b.Fatal(err)
	}
	b.Run("view", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			blk.Range(10, 49)
		}
	})
	v, _ := blk.Range(10, 49)
	b.Run("write-to-discard", func(b *testing.B) {
		b.SetBytes(v.Len())
		b.ReportAllocs()
		for b.Loop() {
			v.WriteTo(io.Discard)
		}
	})
}

package container

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"testing"
)

// FuzzParseHeader: the parser never panics, accepts only headers that
// re-encode to the same octets, and reports truncation for every prefix of
// an accepted header.
func FuzzParseHeader(f *testing.F) {
	f.Add(unhex(f, appendixHeader))
	h, _ := NewHeader(CodecFP8Head, 1, 2, small)
	f.Add(h.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, g := range []Geometry{appendixGeometry, small} {
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
	}
	f.Fuzz(func(t *testing.T, data []byte) {
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

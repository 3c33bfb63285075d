package container

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// TestElementConversions: bf16, fp16 and fp8-e4m3 codes survive a round
// trip through float32, and rounding is to nearest even.
func TestElementConversions(t *testing.T) {
	for c := 0; c < 1<<16; c++ {
		h := uint16(c)
		if f := fp16ToF32(h); f == f && f32ToFP16(f) != h {
			t.Fatalf("fp16 %04x -> %v -> %04x", h, f, f32ToFP16(f))
		}
		if f := bf16ToF32(h); f == f && f32ToBF16(f) != h {
			t.Fatalf("bf16 %04x -> %v -> %04x", h, f, f32ToBF16(f))
		}
	}
	for c := 0; c < 256; c++ {
		f := fp8e4m3ToF32(uint8(c))
		if f != f {
			if c&0x7f != 0x7f {
				t.Fatalf("e4m3 %02x is NaN", c)
			}
			continue
		}
		if got := f32ToFP8E4M3(f); got != uint8(c) {
			t.Fatalf("e4m3 %02x -> %v -> %02x", c, f, got)
		}
	}
	for _, c := range []struct {
		f    float32
		want uint8
	}{
		{448, 0x7e}, {1e9, 0x7e}, {-448, 0xfe}, {464, 0x7e}, // saturating, no infinity
		{1.0 / 64, 0x08}, {1.0 / 512, 0x01}, {1.0 / 1024, 0x00}, // smallest normal, subnormal, half a step: even
		{3.0 / 1024, 0x02}, {1.0625, 0x38}, {1.1875, 0x3a}, // ties to even
	} {
		if got := f32ToFP8E4M3(c.f); got != c.want {
			t.Errorf("e4m3(%v) = %02x, want %02x", c.f, got, c.want)
		}
	}
	if fp16ToF32(0x7bff) != 65504 || f32ToFP16(65520) != 0x7c00 || f32ToFP16(65519) != 0x7bff {
		t.Error("fp16 range edges")
	}
	if f32ToBF16(float32(math.NaN())) == 0x7f80 {
		t.Error("bf16 NaN became infinity")
	}
}

// TestFP8HeadErrorBound: the private-use fp8 codec keeps every element
// within its documented bound, for each 16- and 32-bit element type, and
// shrinks sections as stated.
func TestFP8HeadErrorBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	for _, elem := range []ElemType{BF16, FP16, FP32} {
		g := Geometry{Layers: 1, BlockTokens: 16, KVHeads: 4, HeadDim: 64, Elem: elem}
		raw := make([]byte, g.RawSectionLen())
		n := int(g.Elements())
		for i := 0; i < n; i++ {
			h := (i / int(g.HeadDim)) % int(g.KVHeads)
			mag := []float64{1e-3, 1, 30, 0}[h] // head 3 is all zero
			x := float32(rng.NormFloat64() * mag)
			if i%97 == 0 {
				x *= 1e-4 // some tiny values: the subnormal path
			}
			storeElem(elem, raw, i, x)
		}
		c := FP8Head{}
		enc := make([]byte, c.SectionLen(g))
		if err := c.FromRaw(enc, raw, g); err != nil {
			t.Fatal(err)
		}
		if want := 4*4 + n; len(enc) != want {
			t.Fatalf("%s: section %d octets, want %d", elem, len(enc), want)
		}
		dec := make([]byte, len(raw))
		if err := c.ToRaw(dec, enc, g); err != nil {
			t.Fatal(err)
		}
		rel := map[ElemType]float64{BF16: 1.0 / 512, FP16: 1.0 / 2048, FP32: 1e-7}[elem]
		for i := 0; i < n; i++ {
			h := (i / int(g.HeadDim)) % int(g.KVHeads)
			s := float64(math.Float32frombits(binary.LittleEndian.Uint32(enc[4*h:])))
			x := float64(loadElem(elem, raw, i))
			y := float64(loadElem(elem, dec, i))
			bound := math.Abs(x)/16 + s/1024
			bound += rel*(math.Abs(x)+bound) + 6e-8 // rounding of the output type (fp16 subnormal step 2^-24)
			if math.Abs(y-x) > bound {
				t.Fatalf("%s element %d (head %d, scale %g): %g decoded as %g, error %g > bound %g", elem, i, h, s, x, y, math.Abs(y-x), bound)
			}
		}
	}
	g := Geometry{Layers: 1, BlockTokens: 1, KVHeads: 1, HeadDim: 2, Elem: BF16}
	raw := make([]byte, 4)
	binary.LittleEndian.PutUint16(raw, 0x7f80) // +Inf
	if err := (FP8Head{}).FromRaw(make([]byte, 6), raw, g); !errors.Is(err, ErrMalformed) {
		t.Errorf("non-finite input: %v", err)
	}
	g.Elem = FP8E4M3
	if err := (FP8Head{}).FromRaw(make([]byte, 6), make([]byte, 2), g); !errors.Is(err, ErrUnsupportedCodec) {
		t.Errorf("fp8 input: %v", err)
	}
}

// TestTranscodedContainer: a container in the fp8 codec parses with its own
// section lengths (R-CNT-11) and decodes to raw within the bound.
func TestTranscodedContainer(t *testing.T) {
	g := Geometry{Layers: 2, BlockTokens: 4, KVHeads: 2, HeadDim: 8, Elem: BF16}
	c := LookupCodec(CodecFP8Head)
	h, err := NewHeader(CodecFP8Head, 0, 2, g)
	if err != nil || h.Layers[0].K != c.SectionLen(g) {
		t.Fatalf("header: %+v %v", h, err)
	}
	sec := make([]byte, c.SectionLen(g))
	var buf bytes.Buffer
	w := NewWriter(&buf, h)
	for i := 0; i < 2; i++ {
		if err := w.WriteLayer(sec, sec); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenBlock(buf.Bytes(), g); err != nil {
		t.Fatalf("fp8 container: %v", err)
	}
	if (Raw{}).ID() != 1 || LookupCodec(0) != nil || RegisterCodec(Raw{}) == nil {
		t.Error("registry: raw is fixed and 0 is reserved")
	}
}

// TestPagedLayout: gathering a sequence out of a paged pool and scattering
// it back are inverse, for page sizes smaller, equal and larger than the
// range, and any block table.
func TestPagedLayout(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 32))
	for _, pageTokens := range []int{1, 3, 16, 64} {
		p := Paged{PageTokens: pageTokens, KVHeads: 2, HeadDim: 8, ElemSize: 2}
		const pages = 40
		pool := make([]byte, pages*pageTokens*p.rowLen())
		for i := range pool {
			pool[i] = byte(rng.Uint32())
		}
		table := make([]int32, pages)
		for i, v := range rng.Perm(pages) {
			table[i] = int32(v)
		}
		start, n := 5, 32
		if start+n > pages*pageTokens {
			start, n = 0, pages*pageTokens
		}
		sec := make([]byte, n*p.rowLen())
		if err := GatherPaged(sec, pool, p, table, start, n); err != nil {
			t.Fatal(err)
		}
		for tok := 0; tok < n; tok++ { // token tok is row (start+tok) of the sequence
			pos := start + tok
			off := (int(table[pos/pageTokens])*pageTokens + pos%pageTokens) * p.rowLen()
			if !bytes.Equal(sec[tok*p.rowLen():(tok+1)*p.rowLen()], pool[off:off+p.rowLen()]) {
				t.Fatalf("page %d: token %d gathered wrong", pageTokens, tok)
			}
		}
		pool2 := make([]byte, len(pool))
		if err := ScatterPaged(pool2, sec, p, table, start, n); err != nil {
			t.Fatal(err)
		}
		back := make([]byte, len(sec))
		GatherPaged(back, pool2, p, table, start, n)
		if !bytes.Equal(back, sec) {
			t.Fatalf("page %d: scatter then gather differs", pageTokens)
		}
		if err := GatherPaged(sec, pool, p, table[:1], start, n); err == nil && pageTokens < 64 {
			t.Fatalf("page %d: short block table accepted", pageTokens)
		}
		bad := append([]int32(nil), table...)
		bad[start/pageTokens] = pages
		if err := GatherPaged(sec, pool, p, bad, start, n); err == nil {
			t.Fatalf("page %d: table entry outside the pool accepted", pageTokens)
		}
	}
}

package gpu

import (
	"bytes"
	"testing"
)

// TestPagedGatherScatter: the gather/scatter kernels (the stand-in's host
// loops under nogpu) against the layout computed here: tokens spanning
// pages out of order, rows that are 16-aligned and rows that are not; a
// scatter of the gathered sections into an empty pool puts back exactly
// those rows; tables and pools too small are refused.
func TestPagedGatherScatter(t *testing.T) {
	d := openDevice(t)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, row := range []int{64, 20} {
		const layers, pageTokens, pages = 3, 4, 5
		p := Paged{Layers: layers, PageTokens: pageTokens, RowBytes: row, PageStride: int64(pageTokens * row)}
		p.VOffset = pages * p.PageStride
		p.LayerStride = 2 * p.VOffset
		size := int64(layers) * p.LayerStride
		host := random(int(size), uint64(row))
		pool, err := d.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Free()
		if err := pool.CopyIn(0, host); err != nil {
			t.Fatal(err)
		}
		table := []int32{3, 0, 4}
		const first, tokens = 2, 7 // tokens 2..8: pages 3, 0, 4
		var want []byte
		for l := range layers {
			for kv := range 2 {
				for x := range tokens {
					tok := first + x
					off := int64(l)*p.LayerStride + int64(kv)*p.VOffset + int64(table[tok/pageTokens])*p.PageStride + int64(tok%pageTokens*row)
					want = append(want, host[off:off+int64(row)]...)
				}
			}
		}
		sec, err := d.Alloc(p.SectionsLen(tokens))
		if err != nil {
			t.Fatal(err)
		}
		defer sec.Free()
		if err := d.Gather(sec, pool, p, table, first, tokens, s); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(want))
		if err := sec.CopyOut(got, 0); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("row %d: gathered sections differ: %v", row, err)
		}
		empty, err := d.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		defer empty.Free()
		if err := empty.CopyIn(0, make([]byte, size)); err != nil {
			t.Fatal(err)
		}
		if err := d.Scatter(empty, sec, p, table, first, tokens, s); err != nil {
			t.Fatal(err)
		}
		back := make([]byte, size)
		if err := empty.CopyOut(back, 0); err != nil {
			t.Fatal(err)
		}
		expect := make([]byte, size)
		i := 0
		for l := range layers {
			for kv := range 2 {
				for x := range tokens {
					tok := first + x
					off := int64(l)*p.LayerStride + int64(kv)*p.VOffset + int64(table[tok/pageTokens])*p.PageStride + int64(tok%pageTokens*row)
					copy(expect[off:off+int64(row)], want[i*row:(i+1)*row])
					i++
				}
			}
		}
		if !bytes.Equal(back, expect) {
			t.Fatalf("row %d: the scatter wrote other octets than the rows", row)
		}
		if d.Gather(sec, pool, p, table[:2], first, tokens, s) == nil {
			t.Fatal("a table that does not cover the tokens was accepted")
		}
		if d.Gather(sec, pool, p, []int32{3, 0, pages}, first, tokens, s) == nil {
			t.Fatal("a page outside the pool was accepted")
		}
		huge := p
		huge.PageTokens = 1 << 61
		if d.Gather(sec, pool, huge, table, first, tokens, s) == nil {
			t.Fatal("pages of 2^61 tokens were accepted")
		}
		if d.Gather(sec, pool, p, table, 1<<60, tokens, s) == nil {
			t.Fatal("a first token of 2^60 was accepted")
		}
		deep := p
		deep.Layers, deep.LayerStride = maxPagedLayers+1, 0
		if d.Gather(sec, pool, deep, table, first, tokens, s) == nil {
			t.Fatal("more layers than a launch grid takes were accepted")
		}
	}
}

package container

import "fmt"

// Paged describes one layer's K (or V) cache in the paged layout of
// vLLM-style engines: a tensor [num_blocks, page_tokens, kv_heads,
// head_dim] of ElemSize-octet elements, where a sequence's pages are listed
// in a block table. A token's row (kv_heads x head_dim elements) is
// contiguous in both this layout and kvsp-layout-1, so conversion copies
// runs of whole rows.
type Paged struct {
	PageTokens int // tokens per page (the engine's block size)
	KVHeads    int
	HeadDim    int
	ElemSize   int
}

func (p Paged) rowLen() int { return p.KVHeads * p.HeadDim * p.ElemSize }

func (p Paged) check(pool, sec []byte, table []int32, start, n int) error {
	if p.PageTokens <= 0 || p.KVHeads <= 0 || p.HeadDim <= 0 || p.ElemSize <= 0 {
		return fmt.Errorf("container: paged layout has a zero dimension")
	}
	if start < 0 || n < 0 || len(sec) != n*p.rowLen() {
		return fmt.Errorf("container: section of %d octets for %d tokens of %d", len(sec), n, p.rowLen())
	}
	if last := (start + n + p.PageTokens - 1) / p.PageTokens; last > len(table) {
		return fmt.Errorf("container: tokens %d..%d need %d pages, block table has %d", start, start+n, last, len(table))
	}
	pageLen := p.PageTokens * p.rowLen()
	for i := start / p.PageTokens; i < (start+n+p.PageTokens-1)/p.PageTokens; i++ {
		if table[i] < 0 || (int(table[i])+1)*pageLen > len(pool) {
			return fmt.Errorf("container: block table entry %d (page %d) outside the pool", i, table[i])
		}
	}
	return nil
}

// copyPaged walks tokens [start, start+n) of the sequence; fn gets each run
// of contiguous rows as (pool offset, section offset, octets).
func (p Paged) walk(table []int32, start, n int, fn func(poolOff, secOff, length int)) {
	row := p.rowLen()
	for t := 0; t < n; {
		tok := start + t
		page, in := tok/p.PageTokens, tok%p.PageTokens
		run := min(p.PageTokens-in, n-t)
		fn((int(table[page])*p.PageTokens+in)*row, t*row, run*row)
		t += run
	}
}

// GatherPaged copies tokens [start, start+n) of a sequence from the paged
// pool into sec, one section in kvsp-layout-1 (n rows).
func GatherPaged(sec, pool []byte, p Paged, table []int32, start, n int) error {
	if err := p.check(pool, sec, table, start, n); err != nil {
		return err
	}
	p.walk(table, start, n, func(po, so, l int) { copy(sec[so:so+l], pool[po:po+l]) })
	return nil
}

// ScatterPaged copies one kvsp-layout-1 section (n rows) into tokens
// [start, start+n) of a sequence in the paged pool.
func ScatterPaged(pool, sec []byte, p Paged, table []int32, start, n int) error {
	if err := p.check(pool, sec, table, start, n); err != nil {
		return err
	}
	p.walk(table, start, n, func(po, so, l int) { copy(pool[po:po+l], sec[so:so+l]) })
	return nil
}

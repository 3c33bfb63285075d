package gpu

import "fmt"

// Paged describes an engine's paged KV pool (docs/engine-attach.md): the
// row of (layer l, K or V, page p, row r), RowBytes octets (kv_heads x
// head_dim elements), is at l*LayerStride + kv*VOffset + p*PageStride +
// r*RowBytes. A sequence's token t is row t%PageTokens of page
// table[t/PageTokens].
type Paged struct {
	Layers, PageTokens, RowBytes     int
	LayerStride, VOffset, PageStride int64
}

// SectionsLen is the octets of tokens rows of every layer's K and V in
// kvsp-layout-1 (a block's payload when tokens is block_tokens).
func (p Paged) SectionsLen(tokens int) int64 {
	return int64(p.Layers) * 2 * int64(tokens) * int64(p.RowBytes)
}

// check validates a gather or scatter of tokens [first, first+tokens)
// between a pool of poolLen octets and sections of secLen octets.
// Every count is bounded so that the kernels' 32-bit indices and 64-bit
// offsets cannot overflow once check passed.
const maxPagedCount = 1 << 24

// maxPagedLayers bounds Layers: the kernels run one block row per layer
// and K or V (grid y = 2 x layers), and a grid's y is at most 65535.
const maxPagedLayers = 65535 / 2

func (p Paged) check(poolLen, secLen int64, table []int32, first, tokens int) error {
	if p.Layers <= 0 || p.PageTokens <= 0 || p.RowBytes <= 0 || first < 0 || tokens <= 0 ||
		p.Layers > maxPagedLayers || p.PageTokens > maxPagedCount || p.RowBytes > maxPagedCount || first > maxPagedCount || tokens > maxPagedCount ||
		p.LayerStride < 0 || p.VOffset < 0 || p.PageStride < 0 || p.LayerStride > poolLen || p.VOffset > poolLen || p.PageStride > poolLen {
		return fmt.Errorf("gpu: paged copy of %d tokens from %d: bad geometry %+v for a %d-octet pool", tokens, first, p, poolLen)
	}
	if secLen < p.SectionsLen(tokens) {
		return fmt.Errorf("gpu: %d octets of sections for %d", secLen, p.SectionsLen(tokens))
	}
	last := (first + tokens - 1) / p.PageTokens
	if last >= len(table) {
		return fmt.Errorf("gpu: the table lists %d pages, token %d needs %d", len(table), first+tokens-1, last+1)
	}
	// Each term is at most poolLen (< 2^63) times a count below 2^24: the
	// products are bounded by checking them against poolLen one by one.
	rows := int64(p.PageTokens) * int64(p.RowBytes) // < 2^48
	for _, page := range table[first/p.PageTokens : last+1] {
		if page < 0 || int64(page) > poolLen/max(1, p.PageStride) || int64(p.Layers-1) > poolLen/max(1, p.LayerStride) {
			return fmt.Errorf("gpu: page %d is outside a %d-octet pool", page, poolLen)
		}
		end := int64(p.Layers-1)*p.LayerStride + p.VOffset // each product at most poolLen
		if end > poolLen || end+int64(page)*p.PageStride > poolLen || end+int64(page)*p.PageStride+rows > poolLen {
			return fmt.Errorf("gpu: page %d reaches past a %d-octet pool", page, poolLen)
		}
	}
	return nil
}

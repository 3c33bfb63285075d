package attach

import (
	"encoding/json"
	"testing"
)

// FuzzHelloAndPlacement: whatever a local peer sends as a hello and a
// placement, checking them never panics, and what passes keeps every row
// the holder will read inside the pool.
func FuzzHelloAndPlacement(f *testing.F) {
	f.Add([]byte(`{"type":"hello","version":1,"pool":{"memory":"memfd","size":4096,"pages":4,"page_tokens":16,"layer_stride":2048,"v_offset":1024,"page_stride":256}}`),
		[]byte(`{"block_key":"00","pages":[1,2],"offset":3}`), uint8(2), uint8(16), uint16(16))
	f.Add([]byte(`{"pool":{"memory":"memfd","size":4096,"pages":4,"page_tokens":1,"layer_stride":1,"v_offset":1,"page_stride":4611686018427387904}}`),
		[]byte(`{"pages":[3]}`), uint8(1), uint8(1), uint16(1))
	f.Fuzz(func(t *testing.T, hello, place []byte, layers, blockTokens uint8, row uint16) {
		var h Hello
		var p Placement
		if json.Unmarshal(hello, &h) != nil || json.Unmarshal(place, &p) != nil || layers == 0 || blockTokens == 0 || row == 0 {
			return
		}
		pool := h.Pool
		if pool.Check(int(layers), int64(row)) != nil {
			return
		}
		table, first, err := p.Table(pool.Pages, pool.PageTokens, int(blockTokens))
		if err != nil {
			return
		}
		for x := range int(blockTokens) {
			tok := first + x
			page := table[tok/pool.PageTokens]
			for l := range int(layers) {
				k, v := pool.Section(l, int(page))
				end := v + int64(tok%pool.PageTokens+1)*int64(row)
				if k < 0 || end > pool.Size || page < 0 || int(page) >= pool.Pages {
					t.Fatalf("row of token %d, layer %d reaches %d of %d (page %d)", x, l, end, pool.Size, page)
				}
			}
		}
	})
}

package llamacpp

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// The per-sequence state of llama_state_seq_get_data in llama.cpp v0.4.0
// (llama_context::state_seq_get_data and llama_kv_cache::state_write),
// all integers little-endian:
//
//	u32 magic 0xaf143cd8, i32 seq_id, u32 n_stream
//	per stream: u32 cell_count; when it is not 0:
//	  per cell: i32 pos, u32 n_seq_id (1), i32 seq_id
//	  u32 v_trans, u32 n_layer
//	  per layer: i32 k_type, u64 k_row, cell_count rows of k_row octets
//	  v_trans 0, per layer: i32 v_type, u64 v_row, cell_count rows
//	  v_trans 1, per layer: i32 v_type, u32 v_elem, u32 n_embd_v, then for
//	    each of the n_embd_v elements of a row, cell_count elements
//
// The format carries no version: it is parsed against the layout a probe
// of the running context gave (see probeLayout), and anything else is an
// error, never a guess.
const stateMagic = 0xaf143cd8

// ggml element types of a KV cache (ggml.h).
const (
	ggmlF32  = 0
	ggmlF16  = 1
	ggmlBF16 = 30
)

// errState is the error of a state the parser does not know.
var errState = errors.New("llamacpp: sequence state")

// layout is the shape of the context's per-sequence state.
type layout struct {
	streams      uint32
	vTrans       bool
	layers       int
	kType, vType int32
	kRow, vRow   int // octets of one cell's row of one layer
	vElem        int // octets of one V element (transposed layout)
}

// cellMeta is the octets of one cell's metadata.
const cellMeta = 12

// seqState is a parsed sequence state: the cells' positions and, per
// layer, its K and V octets, slices of the parsed buffer.
type seqState struct {
	pos  []int32
	k, v [][]byte
}

type reader struct {
	b   []byte
	off int
	err error
}

func (r *reader) take(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b)-r.off {
		r.err = fmt.Errorf("%w: truncated at offset %d reading %s", errState, r.off, what)
		return nil
	}
	s := r.b[r.off : r.off+n]
	r.off += n
	return s
}

func (r *reader) u32(what string) uint32 {
	if s := r.take(4, what); s != nil {
		return binary.LittleEndian.Uint32(s)
	}
	return 0
}

func (r *reader) u64(what string) uint64 {
	if s := r.take(8, what); s != nil {
		return binary.LittleEndian.Uint64(s)
	}
	return 0
}

// parseState parses one sequence's state. With want nil it learns the
// layout (the probe); otherwise every field must be want's.
func parseState(b []byte, want *layout) (*seqState, layout, error) {
	r := &reader{b: b}
	var l layout
	if m := r.u32("magic"); r.err == nil && m != stateMagic {
		return nil, l, fmt.Errorf("%w: magic %#x, not %#x of llama.cpp %s", errState, m, stateMagic, Release)
	}
	r.u32("seq_id")
	l.streams = r.u32("n_stream")
	if r.err == nil && (l.streams == 0 || l.streams > 1<<16) {
		return nil, l, fmt.Errorf("%w: %d streams", errState, l.streams)
	}
	if want != nil && r.err == nil && l.streams != want.streams {
		return nil, l, fmt.Errorf("%w: %d streams, the context has %d", errState, l.streams, want.streams)
	}
	st := &seqState{}
	found := false
	for s := uint32(0); s < l.streams && r.err == nil; s++ {
		cells := int(r.u32("cell_count"))
		if r.err != nil || cells == 0 {
			continue
		}
		if found {
			return nil, l, fmt.Errorf("%w: cells in two streams", errState)
		}
		found = true
		if cells > (len(b)-r.off)/cellMeta {
			return nil, l, fmt.Errorf("%w: %d cells in %d octets", errState, cells, len(b))
		}
		st.pos = make([]int32, cells)
		for i := range st.pos {
			st.pos[i] = int32(r.u32("pos"))
			if n := r.u32("n_seq_id"); r.err == nil && n != 1 {
				return nil, l, fmt.Errorf("%w: cell %d belongs to %d sequences", errState, i, n)
			}
			r.u32("seq_id")
		}
		vt := r.u32("v_trans")
		nl := r.u32("n_layer")
		if r.err != nil {
			break
		}
		if vt > 1 || nl == 0 || nl > 1<<12 {
			return nil, l, fmt.Errorf("%w: v_trans %d, %d layers", errState, vt, nl)
		}
		l.vTrans, l.layers = vt == 1, int(nl)
		st.k, st.v = make([][]byte, nl), make([][]byte, nl)
		for i := range st.k {
			kt := int32(r.u32("k_type"))
			row := r.u64("k_row")
			if r.err != nil {
				break
			}
			if i == 0 {
				l.kType, l.kRow = kt, int(row)
			}
			if kt != l.kType || int(row) != l.kRow || row == 0 || row > 1<<24 {
				return nil, l, fmt.Errorf("%w: layer %d K of type %d, rows of %d octets (layer 0: type %d, %d)", errState, i, kt, row, l.kType, l.kRow)
			}
			st.k[i] = r.take(cells*l.kRow, "K")
		}
		for i := range st.v {
			vt := int32(r.u32("v_type"))
			var n int
			if !l.vTrans {
				row := r.u64("v_row")
				if i == 0 {
					l.vRow = int(row)
				}
				if int(row) != l.vRow || row == 0 || row > 1<<24 {
					return nil, l, fmt.Errorf("%w: layer %d V rows of %d octets (layer 0: %d)", errState, i, row, l.vRow)
				}
				n = cells * l.vRow
			} else {
				el, embd := int(r.u32("v_elem")), int(r.u32("n_embd_v"))
				if i == 0 {
					l.vElem, l.vRow = el, el*embd
				}
				if el != l.vElem || el*embd != l.vRow || el == 0 || el > 8 || embd == 0 || embd > 1<<22 {
					return nil, l, fmt.Errorf("%w: layer %d V of %d elements of %d octets", errState, i, embd, el)
				}
				n = cells * l.vRow
			}
			if i == 0 {
				l.vType = vt
			}
			if vt != l.vType {
				return nil, l, fmt.Errorf("%w: layer %d V of type %d (layer 0: %d)", errState, i, vt, l.vType)
			}
			st.v[i] = r.take(n, "V")
		}
	}
	if r.err != nil {
		return nil, l, r.err
	}
	if r.off != len(b) {
		return nil, l, fmt.Errorf("%w: %d octets after the state", errState, len(b)-r.off)
	}
	if !found {
		return nil, l, fmt.Errorf("%w: the sequence holds no cells", errState)
	}
	if want != nil && l != *want {
		return nil, l, fmt.Errorf("%w: layout %+v, the context's is %+v", errState, l, *want)
	}
	return st, l, nil
}

// cellsByPos maps positions [p0, p0+n) to cell indexes; each must be held
// exactly once.
func (st *seqState) cellsByPos(p0, n int) ([]int32, error) {
	idx := make([]int32, n)
	for i := range idx {
		idx[i] = -1
	}
	for c, p := range st.pos {
		if q := int(p) - p0; q >= 0 && q < n {
			if idx[q] >= 0 {
				return nil, fmt.Errorf("%w: position %d held twice", errState, p)
			}
			idx[q] = int32(c)
		}
	}
	for q, c := range idx {
		if c < 0 {
			return nil, fmt.Errorf("%w: position %d missing", errState, p0+q)
		}
	}
	return idx, nil
}

// gatherRows copies rows idx[t] of src (rows of row octets) to dst in
// order: runs of consecutive cells are one copy.
func gatherRows(dst, src []byte, idx []int32, row int) {
	for t := 0; t < len(idx); {
		n := 1
		for t+n < len(idx) && idx[t+n] == idx[t]+int32(n) {
			n++
		}
		copy(dst[t*row:(t+n)*row], src[int(idx[t])*row:])
		t += n
	}
}

// kSection writes layer's K of the cells idx (a block's tokens in order)
// in kvsp-layout-1: token-major, then head, then dimension, which is
// llama.cpp's K row.
func (l *layout) kSection(dst []byte, st *seqState, layer int, idx []int32) {
	gatherRows(dst, st.k[layer], idx, l.kRow)
}

// vSection writes layer's V of the cells idx in kvsp-layout-1: rows as
// they are, or gathered back from the transposed layout.
func (l *layout) vSection(dst []byte, st *seqState, layer int, idx []int32) {
	if !l.vTrans {
		gatherRows(dst, st.v[layer], idx, l.vRow)
		return
	}
	cells, el := len(st.pos), l.vElem
	embd := l.vRow / el
	src := st.v[layer]
	if el == 2 {
		// Runs of consecutive cells are one transposed tile: dst[t][j] =
		// src[j][c0+t].
		for t := 0; t < len(idx); {
			n := 1
			for t+n < len(idx) && idx[t+n] == idx[t]+int32(n) {
				n++
			}
			transpose16(dst[t*l.vRow:], embd, src[2*int(idx[t]):], cells, embd, n)
			t += n
		}
		return
	}
	for t, c := range idx {
		for j := 0; j < embd; j++ {
			copy(dst[t*l.vRow+j*el:t*l.vRow+(j+1)*el], src[(j*cells+int(c))*el:])
		}
	}
}

// stateLen is the octets of a state of cells cells.
func (l *layout) stateLen(cells int) int {
	n := 12 + 4*int(l.streams) + cells*cellMeta + 8
	n += l.layers * (12 + cells*l.kRow) // type, row size, rows
	n += l.layers * (12 + cells*l.vRow) // type and row size, or type, element size and width; the data
	return n
}

// stateWriter builds a sequence state of cells cells at positions p0..
// into one buffer: the header and metadata at once, then K and V of each
// layer through the section methods, block by block.
type stateWriter struct {
	l      *layout
	b      []byte
	cells  int
	kOff   []int // per layer, offset of its K rows
	vOff   []int // per layer, offset of its V data
	blockT int
}

func newStateWriter(l *layout, p0, cells, blockTokens int, buf []byte) *stateWriter {
	n := l.stateLen(cells)
	if cap(buf) < n {
		buf = make([]byte, n)
	}
	b := buf[:n]
	le := binary.LittleEndian
	le.PutUint32(b[0:], stateMagic)
	le.PutUint32(b[4:], 0)
	le.PutUint32(b[8:], l.streams)
	o := 12
	le.PutUint32(b[o:], uint32(cells)) // the first stream holds them
	o += 4
	for c := 0; c < cells; c++ {
		le.PutUint32(b[o:], uint32(p0+c))
		le.PutUint32(b[o+4:], 1)
		le.PutUint32(b[o+8:], 0)
		o += cellMeta
	}
	vt := uint32(0)
	if l.vTrans {
		vt = 1
	}
	le.PutUint32(b[o:], vt)
	le.PutUint32(b[o+4:], uint32(l.layers))
	o += 8
	w := &stateWriter{l: l, b: b, cells: cells, blockT: blockTokens, kOff: make([]int, l.layers), vOff: make([]int, l.layers)}
	for i := 0; i < l.layers; i++ {
		le.PutUint32(b[o:], uint32(l.kType))
		le.PutUint64(b[o+4:], uint64(l.kRow))
		w.kOff[i] = o + 12
		o += 12 + cells*l.kRow
	}
	for i := 0; i < l.layers; i++ {
		le.PutUint32(b[o:], uint32(l.vType))
		if l.vTrans {
			le.PutUint32(b[o+4:], uint32(l.vElem))
			le.PutUint32(b[o+8:], uint32(l.vRow/l.vElem))
		} else {
			le.PutUint64(b[o+4:], uint64(l.vRow))
		}
		w.vOff[i] = o + 12
		o += 12 + cells*l.vRow
	}
	for s := uint32(1); s < l.streams; s++ { // the other streams: no cells
		le.PutUint32(b[o:], 0)
		o += 4
	}
	return w
}

// put writes block blk's layer from its kvsp-layout-1 K and V sections.
func (w *stateWriter) put(blk, layer int, k, v []byte) {
	l := w.l
	t0 := blk * w.blockT
	copy(w.b[w.kOff[layer]+t0*l.kRow:], k[:w.blockT*l.kRow])
	if !l.vTrans {
		copy(w.b[w.vOff[layer]+t0*l.vRow:], v[:w.blockT*l.vRow])
		return
	}
	el := l.vElem
	embd := l.vRow / el
	dst := w.b[w.vOff[layer]:]
	if el == 2 { // dst[j][t0+t] = v[t][j]
		transpose16(dst[2*t0:], w.cells, v, embd, w.blockT, embd)
		return
	}
	for t := 0; t < w.blockT; t++ {
		for j := 0; j < embd; j++ {
			copy(dst[(j*w.cells+t0+t)*el:(j*w.cells+t0+t+1)*el], v[t*l.vRow+j*el:])
		}
	}
}

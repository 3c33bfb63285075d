package gguf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"unicode/utf8"
)

// WriterAlignment is the data alignment of files the Writer writes; they
// carry no general.alignment key.
const WriterAlignment = DefaultAlignment

// Writer writes a GGUF version 3 file in one pass, streaming tensor data:
//
//	w := gguf.NewWriter(out)
//	w.AddString("general.architecture", "llama")
//	w.AddTensor("output_norm.weight", gguf.GGMLTypeF32, 64)
//	err := w.WriteHeader()      // KVs, tensor infos, padding
//	_, err = w.Write(data)      // the tensors' data, concatenated in AddTensor order
//	err = w.Close()             // checks every tensor is complete
//
// The Writer pads each tensor's data with zeros to WriterAlignment, as
// ggml's gguf writer does. The Add methods record the first error (a
// duplicate key or tensor name, an invalid name, type or shape), which
// WriteHeader returns. The Writer does not buffer: wrap out in a
// bufio.Writer for many small writes.
type Writer struct {
	out     io.Writer
	err     error
	kv      []byte
	nKV     uint64
	keys    map[string]bool
	tensors []wtensor
	names   map[string]bool
	dataLen uint64 // padded data section size so far

	started bool
	cur     int    // tensor whose data is being written
	curN    uint64 // octets of it written
}

type wtensor struct {
	name   string
	typ    uint32
	dims   []uint64
	size   uint64
	offset uint64 // relative to the data section
}

// NewWriter returns a Writer writing to out.
func NewWriter(out io.Writer) *Writer {
	return &Writer{out: out, keys: map[string]bool{}, names: map[string]bool{}}
}

func (w *Writer) setErr(format string, args ...any) {
	if w.err == nil {
		w.err = fmt.Errorf("gguf: "+format, args...)
	}
}

func (w *Writer) key(key string, t ValueType) bool {
	switch {
	case w.err != nil:
		return false
	case w.started:
		w.setErr("key %q added after WriteHeader", key)
	case key == "" || len(key) > MaxKeyLen || !utf8.ValidString(key):
		w.setErr("invalid key %q", key)
	case w.keys[key]:
		w.setErr("duplicate key %q", key)
	case key == "general.alignment":
		w.setErr("general.alignment: the writer always aligns to %d", WriterAlignment)
	default:
		w.keys[key] = true
		w.nKV++
		w.kv = appendString(w.kv, key)
		w.kv = binary.LittleEndian.AppendUint32(w.kv, uint32(t))
		return true
	}
	return false
}

func appendString(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

// AddString adds a string value.
func (w *Writer) AddString(key, v string) {
	if w.key(key, TypeString) {
		w.kv = appendString(w.kv, v)
	}
}

// AddStrings adds an array of strings.
func (w *Writer) AddStrings(key string, v []string) {
	if w.key(key, TypeArray) {
		w.kv = binary.LittleEndian.AppendUint32(w.kv, uint32(TypeString))
		w.kv = binary.LittleEndian.AppendUint64(w.kv, uint64(len(v)))
		for _, s := range v {
			w.kv = appendString(w.kv, s)
		}
	}
}

// AddUint32 adds a uint32 value.
func (w *Writer) AddUint32(key string, v uint32) {
	if w.key(key, TypeUint32) {
		w.kv = binary.LittleEndian.AppendUint32(w.kv, v)
	}
}

// AddInt32 adds an int32 value.
func (w *Writer) AddInt32(key string, v int32) {
	if w.key(key, TypeInt32) {
		w.kv = binary.LittleEndian.AppendUint32(w.kv, uint32(v))
	}
}

// AddUint64 adds a uint64 value.
func (w *Writer) AddUint64(key string, v uint64) {
	if w.key(key, TypeUint64) {
		w.kv = binary.LittleEndian.AppendUint64(w.kv, v)
	}
}

// AddFloat32 adds a float32 value.
func (w *Writer) AddFloat32(key string, v float32) {
	if w.key(key, TypeFloat32) {
		w.kv = binary.LittleEndian.AppendUint32(w.kv, math.Float32bits(v))
	}
}

// AddFloat64 adds a float64 value.
func (w *Writer) AddFloat64(key string, v float64) {
	if w.key(key, TypeFloat64) {
		w.kv = binary.LittleEndian.AppendUint64(w.kv, math.Float64bits(v))
	}
}

// AddBool adds a bool value.
func (w *Writer) AddBool(key string, v bool) {
	if w.key(key, TypeBool) {
		var b byte
		if v {
			b = 1
		}
		w.kv = append(w.kv, b)
	}
}

// AddTensor declares a tensor of ggml type typ and dims (ne0 first). Its
// data is written, after WriteHeader, in declaration order.
func (w *Writer) AddTensor(name string, typ uint32, dims ...uint64) {
	switch {
	case w.err != nil:
		return
	case w.started:
		w.setErr("tensor %q added after WriteHeader", name)
		return
	case name == "" || len(name) > MaxNameLen || !utf8.ValidString(name):
		w.setErr("invalid tensor name %q (1..%d octets of UTF-8)", name, MaxNameLen)
		return
	case w.names[name]:
		w.setErr("duplicate tensor name %q", name)
		return
	}
	size, err := TensorBytes(typ, dims)
	if err != nil {
		w.setErr("tensor %q: %v", name, err)
		return
	}
	padded := alignUp(size, WriterAlignment)
	if padded < size || w.dataLen+padded < w.dataLen {
		w.setErr("tensor %q: data section size overflows", name)
		return
	}
	w.names[name] = true
	w.tensors = append(w.tensors, wtensor{name: name, typ: typ, dims: append([]uint64(nil), dims...), size: size, offset: w.dataLen})
	w.dataLen += padded
}

// WriteHeader writes the header, the KV entries, the tensor infos and the
// padding before the data section, or returns the first Add error.
func (w *Writer) WriteHeader() error {
	if w.err != nil {
		return w.err
	}
	if w.started {
		return errors.New("gguf: WriteHeader called twice")
	}
	w.started = true
	le := binary.LittleEndian
	b := make([]byte, 0, 24+len(w.kv)+len(w.tensors)*64+WriterAlignment)
	b = append(b, "GGUF"...)
	b = le.AppendUint32(b, 3)
	b = le.AppendUint64(b, uint64(len(w.tensors)))
	b = le.AppendUint64(b, w.nKV)
	b = append(b, w.kv...)
	for _, t := range w.tensors {
		b = appendString(b, t.name)
		b = le.AppendUint32(b, uint32(len(t.dims)))
		for _, d := range t.dims {
			b = le.AppendUint64(b, d)
		}
		b = le.AppendUint32(b, t.typ)
		b = le.AppendUint64(b, t.offset)
	}
	b = append(b, make([]byte, alignUp(uint64(len(b)), WriterAlignment)-uint64(len(b)))...)
	w.skipEmpty()
	return w.write(b)
}

func (w *Writer) write(p []byte) error {
	if w.err != nil {
		return w.err
	}
	if _, err := w.out.Write(p); err != nil {
		w.err = err
	}
	return w.err
}

// skipEmpty moves past tensors with no data.
func (w *Writer) skipEmpty() {
	for w.cur < len(w.tensors) && w.tensors[w.cur].size == 0 {
		w.cur++
	}
}

var zeros [WriterAlignment]byte

// Write writes tensor data: the tensors' octets concatenated in
// declaration order, in pieces of any size. The Writer inserts the
// padding between tensors.
func (w *Writer) Write(p []byte) (int, error) {
	if !w.started {
		return 0, errors.New("gguf: Write before WriteHeader")
	}
	n := 0
	for len(p) > 0 {
		if w.err != nil {
			return n, w.err
		}
		if w.cur >= len(w.tensors) {
			return n, errors.New("gguf: more tensor data than the tensors declared")
		}
		t := w.tensors[w.cur]
		k := min(uint64(len(p)), t.size-w.curN)
		if err := w.write(p[:k]); err != nil {
			return n, err
		}
		n += int(k)
		p = p[k:]
		w.curN += k
		if w.curN == t.size {
			if err := w.write(zeros[:alignUp(t.size, WriterAlignment)-t.size]); err != nil {
				return n, err
			}
			w.cur++
			w.curN = 0
			w.skipEmpty()
		}
	}
	return n, nil
}

// Close checks that every declared tensor's data was written. It does not
// close the underlying writer.
func (w *Writer) Close() error {
	if w.err != nil {
		return w.err
	}
	if !w.started {
		return errors.New("gguf: Close before WriteHeader")
	}
	if w.cur < len(w.tensors) {
		t := w.tensors[w.cur]
		return fmt.Errorf("gguf: tensor %q: %d of %d data octets written", t.name, w.curN, t.size)
	}
	return nil
}

// Float16Bits converts f to IEEE 754 binary16 bits, rounding to nearest
// even; out-of-range values become infinities, NaNs a quiet NaN.
func Float16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23) & 0xff
	mant := b & 0x7fffff
	if exp == 0xff {
		if mant != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return sign | 0x7c00
	}
	if e <= 0 { // subnormal half (or zero): m × 2^-24
		if e < -10 {
			return sign
		}
		m24 := mant | 0x800000
		shift := uint(14 - e)
		m := m24 >> shift
		rem := m24 & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rem > half || (rem == half && m&1 == 1) {
			m++ // may carry into the smallest normal, which encodes the same way
		}
		return sign | uint16(m)
	}
	m := mant >> 13
	rem := mant & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && m&1 == 1) {
		m++
		if m == 0x400 {
			m = 0
			e++
			if e >= 0x1f {
				return sign | 0x7c00
			}
		}
	}
	return sign | uint16(e)<<10 | uint16(m)
}

// Float16Value converts binary16 bits to a float32 (exactly).
func Float16Value(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	}
	v := float32(mant) / (1 << 24)
	if sign != 0 {
		v = -v
	}
	return v
}

// Package gguf reads and writes GGUF, the model file format of ggml and
// llama.cpp, and writes a tiny random-weight llama model for tests.
//
// A GGUF file is little-endian throughout (ggml/src/gguf.cpp, and
// docs/gguf.md of the ggml repository):
//
//	"GGUF" | u32 version (3; 2 has the same layout) | u64 n_tensors | u64 n_kv
//	n_kv      × KV entry:    key | u32 value type | value
//	n_tensors × tensor info: name | u32 n_dims (≤ 4) | n_dims × u64 ne | u32 ggml type | u64 offset
//	zero padding to the alignment (general.alignment, u32, default 32)
//	data section: tensor i at data start + offset_i, each offset a multiple of the alignment
//
//	string := u64 length | length octets (UTF-8, no terminator)
//	value  := scalar | string | array
//	array  := u32 element type | u64 count | count × value (arrays may nest)
//
// Parse reads everything before the data section, checking every count and
// length against the octets the file has left before it allocates, and
// checks that every tensor's data lies inside the file. It does not read
// tensor data. Usage:
//
//	f, err := gguf.Open("model.gguf")
//	if err != nil { ... } // errors.Is(err, gguf.ErrFormat) for a malformed file
//	arch, _ := f.String("general.architecture")
//	layers, _ := f.Uint(arch + ".block_count")
//	tok := f.RawEntries("tokenizer.") // exact octets, for a tokenizer digest
package gguf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"unicode/utf8"
)

// ErrFormat is wrapped by every error about a malformed file: a
// truncation, a count or length the file cannot hold, an invalid type, a
// duplicate, or tensor data outside the file. I/O errors of the underlying
// reader do not wrap it.
var ErrFormat = errors.New("gguf: invalid file")

// Limits of Parse. MaxStringLen and MaxArrayLen are llama.cpp's
// (GGUF_MAX_STRING_LENGTH, GGUF_MAX_ARRAY_ELEMENTS), MaxKeyLen is the GGUF
// spec's, MaxNameLen is GGML_MAX_NAME less its terminator. MaxHeaderSize
// bounds the memory Parse uses whatever the file's size: it caps the octets
// before the data section (real models need a few tens of MiB, nearly all
// of it tokenizer vocabulary).
const (
	MaxKeyLen     = 1<<16 - 1
	MaxStringLen  = 1 << 30
	MaxArrayLen   = 1 << 30
	MaxNameLen    = 63
	MaxDims       = 4
	MaxArrayDepth = 8
	MaxHeaderSize = 256 << 20
)

// DefaultAlignment is the data alignment of a file without general.alignment.
const DefaultAlignment = 32

// ValueType is the type of a KV value (GGUF gguf_type).
type ValueType uint32

// The value types, numbered as on the wire.
const (
	TypeUint8 ValueType = iota
	TypeInt8
	TypeUint16
	TypeInt16
	TypeUint32
	TypeInt32
	TypeFloat32
	TypeBool
	TypeString
	TypeArray
	TypeUint64
	TypeInt64
	TypeFloat64
	numValueTypes
)

var valueTypeNames = [...]string{"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array", "uint64", "int64", "float64"}

func (t ValueType) String() string {
	if t < numValueTypes {
		return valueTypeNames[t]
	}
	return fmt.Sprintf("type(%d)", uint32(t))
}

// fixedSize is the encoded size of a scalar type other than string and
// array; 0 for those two and for invalid types.
func (t ValueType) fixedSize() uint64 {
	switch t {
	case TypeUint8, TypeInt8, TypeBool:
		return 1
	case TypeUint16, TypeInt16:
		return 2
	case TypeUint32, TypeInt32, TypeFloat32:
		return 4
	case TypeUint64, TypeInt64, TypeFloat64:
		return 8
	}
	return 0
}

// minSize is the fewest octets a value of type t takes.
func (t ValueType) minSize() uint64 {
	switch t {
	case TypeString:
		return 8
	case TypeArray:
		return 12
	}
	return t.fixedSize()
}

// FormatError describes a malformed file; it wraps ErrFormat.
type FormatError struct {
	Offset  int64  // file offset of the offending field
	Context string // what was being read: "header", "key 3 (general.name)", "tensor info 7 (blk.0.attn_q.weight)"
	Msg     string // the cause: "truncated", "duplicate key", ...
}

func (e *FormatError) Error() string {
	s := fmt.Sprintf("gguf: %s at offset %d", e.Msg, e.Offset)
	if e.Context != "" {
		s += " reading " + e.Context
	}
	return s
}

func (e *FormatError) Unwrap() error { return ErrFormat }

// TensorInfo describes one tensor. Dims are in ggml order (ne0, the
// contiguous dimension, first); Offset is absolute in the file and Size is
// the tensor's data octets, without padding.
type TensorInfo struct {
	Name   string
	Dims   []uint64
	Type   uint32
	Offset uint64
	Size   uint64
}

// Elements is the product of Dims (1 for no dims).
func (t TensorInfo) Elements() uint64 {
	n := uint64(1)
	for _, d := range t.Dims {
		n *= d
	}
	return n
}

type entry struct {
	key  string
	typ  ValueType
	elem ValueType // arrays
	n    uint64    // arrays: element count
	bits uint64    // integers (signed ones sign-extended), bools, floats as float64 bits
	str  string
	raw  []byte // the whole entry as encoded: key, type, value
}

// File is the parsed metadata and tensor table of a GGUF file. It is
// immutable and safe for concurrent use.
type File struct {
	version    uint32
	alignment  uint64
	dataOffset uint64
	entries    []entry // file order
	byKey      map[string]int
	sorted     []int // entries in ascending bytewise key order
	tensors    []TensorInfo
	byName     map[string]int
}

// Open parses the named file.
func Open(name string) (*File, error) {
	fh, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	fi, err := fh.Stat()
	if err != nil {
		return nil, err
	}
	return Parse(fh, fi.Size())
}

// Parse parses a GGUF file of size octets read through r. It reads the
// header, the KV entries and the tensor infos, not the tensor data.
//
// Beyond the layout it checks: version 2 or 3; keys non-empty UTF-8 of at
// most MaxKeyLen octets and unique; value types 0..12; bools 0 or 1;
// general.alignment, when present, a uint32 power of two; tensor names
// non-empty UTF-8 of at most MaxNameLen octets and unique; at most 4 dims;
// a known ggml type (an unknown one is refused, naming its number: without
// its block size the tensor's extent, and so the bounds check, is
// unknown); ne0 a multiple of the type's block; offsets multiples of the
// alignment; every tensor's data inside the file. The octets after the
// last tensor's data (its padding, which writers emit) are not required.
func Parse(r io.ReaderAt, size int64) (*File, error) {
	if size < 0 {
		return nil, fmt.Errorf("gguf: negative size %d", size)
	}
	d := &decoder{r: r, size: size, ctx: "header"}
	f := &File{alignment: DefaultAlignment}
	if err := f.parse(d); err != nil {
		return nil, err
	}
	return f, nil
}

func (f *File) parse(d *decoder) error {
	magic, err := d.take(4)
	if err != nil {
		return err
	}
	if string(magic) != "GGUF" {
		return d.fail(0, "bad magic %q (want \"GGUF\")", magic)
	}
	if f.version, err = d.u32(); err != nil {
		return err
	}
	if f.version != 2 && f.version != 3 {
		if f.version&0xffff == 0 {
			return d.fail(4, "unsupported version %#x (a big-endian file?)", f.version)
		}
		return d.fail(4, "unsupported version %d (want 2 or 3)", f.version)
	}
	nTensors, err := d.u64()
	if err != nil {
		return err
	}
	nKV, err := d.u64()
	if err != nil {
		return err
	}
	// A KV entry takes at least 14 octets (8+1 key, 4 type, 1 value), a
	// tensor info at least 25 (8+1 name, 4 n_dims, 4 type, 8 offset).
	if left := d.left(); nKV > left/14 || nTensors > (left-nKV*14)/25 {
		return d.fail(8, "%d tensors and %d keys cannot fit in the %d octets left", nTensors, nKV, left)
	}

	f.byKey = make(map[string]int, min(nKV, 1024))
	for i := range nKV {
		if err := f.parseEntry(d, i); err != nil {
			return err
		}
	}
	f.sorted = make([]int, len(f.entries))
	for i := range f.sorted {
		f.sorted[i] = i
	}
	slices.SortFunc(f.sorted, func(a, b int) int { return strings.Compare(f.entries[a].key, f.entries[b].key) })

	if i, ok := f.byKey["general.alignment"]; ok {
		e := &f.entries[i]
		if e.typ != TypeUint32 {
			return d.fail(-1, "general.alignment is %s, want uint32", e.typ)
		}
		if e.bits == 0 || e.bits&(e.bits-1) != 0 {
			return d.fail(-1, "general.alignment %d is not a power of two", e.bits)
		}
		f.alignment = e.bits
	}

	f.byName = make(map[string]int, min(nTensors, 1024))
	for i := range nTensors {
		if err := f.parseTensorInfo(d, i); err != nil {
			return err
		}
	}

	d.ctx = "data section"
	f.dataOffset = alignUp(uint64(d.off), f.alignment)
	if len(f.tensors) > 0 && f.dataOffset > uint64(d.size) {
		return d.fail(d.off, "data section at %d is past the end of the file (%d octets)", f.dataOffset, d.size)
	}
	for i := range f.tensors {
		t := &f.tensors[i]
		d.ctx = fmt.Sprintf("tensor %d (%s)", i, t.Name)
		rel := t.Offset
		if rel%f.alignment != 0 {
			return d.fail(-1, "tensor offset %d is not a multiple of the alignment %d", rel, f.alignment)
		}
		if rel > uint64(d.size) || t.Size > uint64(d.size)-rel || f.dataOffset > uint64(d.size)-rel-t.Size {
			return d.fail(-1, "tensor data (%d octets at data offset %d) extends past the end of the file (%d octets)", t.Size, rel, d.size)
		}
		t.Offset = f.dataOffset + rel
	}
	return nil
}

func (f *File) parseEntry(d *decoder, i uint64) error {
	start := d.off
	d.ctx = fmt.Sprintf("key %d", i)
	d.rec, d.recording = nil, true
	defer func() { d.recording = false }()
	key, err := d.str(MaxKeyLen)
	if err != nil {
		return err
	}
	if key == "" || !utf8.ValidString(key) {
		return d.fail(start, "key is empty or not UTF-8")
	}
	d.ctx = fmt.Sprintf("key %d (%s)", i, key)
	if _, dup := f.byKey[key]; dup {
		return d.fail(start, "duplicate key")
	}
	e := entry{key: key}
	t, err := d.u32()
	if err != nil {
		return err
	}
	e.typ = ValueType(t)
	switch {
	case e.typ == TypeArray:
		if e.elem, e.n, err = d.array(0); err != nil {
			return err
		}
	case e.typ == TypeString:
		if e.str, err = d.str(MaxStringLen); err != nil {
			return err
		}
	case e.typ.fixedSize() != 0:
		if e.bits, err = d.scalar(e.typ); err != nil {
			return err
		}
	default:
		return d.fail(d.off-4, "invalid value type %d", t)
	}
	e.raw = d.rec
	f.byKey[key] = len(f.entries)
	f.entries = append(f.entries, e)
	return nil
}

func (f *File) parseTensorInfo(d *decoder, i uint64) error {
	start := d.off
	d.ctx = fmt.Sprintf("tensor info %d", i)
	name, err := d.str(MaxNameLen)
	if err != nil {
		return err
	}
	if name == "" || !utf8.ValidString(name) {
		return d.fail(start, "tensor name is empty or not UTF-8")
	}
	d.ctx = fmt.Sprintf("tensor info %d (%s)", i, name)
	if _, dup := f.byName[name]; dup {
		return d.fail(start, "duplicate tensor name")
	}
	nd, err := d.u32()
	if err != nil {
		return err
	}
	if nd > MaxDims {
		return d.fail(d.off-4, "%d dimensions (at most %d)", nd, MaxDims)
	}
	t := TensorInfo{Name: name, Dims: make([]uint64, nd)}
	for j := range t.Dims {
		if t.Dims[j], err = d.u64(); err != nil {
			return err
		}
	}
	typeOff := d.off
	if t.Type, err = d.u32(); err != nil {
		return err
	}
	if t.Size, err = TensorBytes(t.Type, t.Dims); err != nil {
		return d.fail(typeOff, "%v", err)
	}
	if t.Offset, err = d.u64(); err != nil {
		return err
	}
	f.byName[name] = len(f.tensors)
	f.tensors = append(f.tensors, t)
	return nil
}

func alignUp(n, a uint64) uint64 { return (n + a - 1) &^ (a - 1) }

// Version is the file's GGUF version (2 or 3).
func (f *File) Version() uint32 { return f.version }

// Alignment is the data alignment: general.alignment or 32.
func (f *File) Alignment() uint64 { return f.alignment }

// DataOffset is the absolute offset of the data section.
func (f *File) DataOffset() uint64 { return f.dataOffset }

// Keys returns the keys in file order.
func (f *File) Keys() []string {
	keys := make([]string, len(f.entries))
	for i, e := range f.entries {
		keys[i] = e.key
	}
	return keys
}

// Type returns the value type of key.
func (f *File) Type(key string) (ValueType, bool) {
	e, ok := f.entry(key)
	if !ok {
		return 0, false
	}
	return e.typ, true
}

// ArrayLen returns the element type and count of an array value.
func (f *File) ArrayLen(key string) (elem ValueType, n uint64, ok bool) {
	e, ok := f.entry(key)
	if !ok || e.typ != TypeArray {
		return 0, 0, false
	}
	return e.elem, e.n, true
}

// String returns a string value.
func (f *File) String(key string) (string, bool) {
	e, ok := f.entry(key)
	if !ok || e.typ != TypeString {
		return "", false
	}
	return e.str, true
}

// Uint returns a value of any unsigned integer type, or of a signed one
// when it is not negative.
func (f *File) Uint(key string) (uint64, bool) {
	e, ok := f.entry(key)
	if !ok {
		return 0, false
	}
	switch e.typ {
	case TypeUint8, TypeUint16, TypeUint32, TypeUint64:
		return e.bits, true
	case TypeInt8, TypeInt16, TypeInt32, TypeInt64:
		if int64(e.bits) >= 0 {
			return e.bits, true
		}
	}
	return 0, false
}

// Float returns a float32 or float64 value.
func (f *File) Float(key string) (float64, bool) {
	e, ok := f.entry(key)
	if !ok || (e.typ != TypeFloat32 && e.typ != TypeFloat64) {
		return 0, false
	}
	return math.Float64frombits(e.bits), true
}

// Bool returns a bool value.
func (f *File) Bool(key string) (bool, bool) {
	e, ok := f.entry(key)
	if !ok || e.typ != TypeBool {
		return false, false
	}
	return e.bits != 0, true
}

func (f *File) entry(key string) (*entry, bool) {
	i, ok := f.byKey[key]
	if !ok {
		return nil, false
	}
	return &f.entries[i], true
}

// RawEntries returns the exact octets, as encoded in the file (key
// length, key, value type, value), of every KV entry whose key starts
// with prefix, concatenated in ascending bytewise key order. It is the
// input of a digest over, say, the "tokenizer." entries: independent of
// the entries' order in the file and of everything else in it.
func (f *File) RawEntries(prefix string) []byte {
	var n int
	for _, i := range f.sorted {
		if strings.HasPrefix(f.entries[i].key, prefix) {
			n += len(f.entries[i].raw)
		}
	}
	out := make([]byte, 0, n)
	for _, i := range f.sorted {
		if strings.HasPrefix(f.entries[i].key, prefix) {
			out = append(out, f.entries[i].raw...)
		}
	}
	return out
}

// Tensor returns the named tensor's info.
func (f *File) Tensor(name string) (TensorInfo, bool) {
	i, ok := f.byName[name]
	if !ok {
		return TensorInfo{}, false
	}
	return cloneTensor(f.tensors[i]), true
}

// Tensors returns the tensor infos in file order.
func (f *File) Tensors() []TensorInfo {
	out := make([]TensorInfo, len(f.tensors))
	for i, t := range f.tensors {
		out[i] = cloneTensor(t)
	}
	return out
}

func cloneTensor(t TensorInfo) TensorInfo {
	t.Dims = slices.Clone(t.Dims)
	return t
}

// decoder reads the metadata sequentially through a window over r. Every
// take is checked against the octets left in the file before anything is
// allocated, so a hostile count or length costs nothing.
type decoder struct {
	r      io.ReaderAt
	size   int64
	off    int64 // next octet
	win    []byte
	bufOff int64 // file offset of win[0]
	ctx    string

	recording bool
	rec       []byte // octets taken while recording
}

const windowSize = 64 << 10

func (d *decoder) left() uint64 { return uint64(d.size - d.off) }

// fail returns a FormatError at off (the current offset when off < 0).
func (d *decoder) fail(off int64, format string, args ...any) error {
	if off < 0 {
		off = d.off
	}
	return &FormatError{Offset: off, Context: d.ctx, Msg: fmt.Sprintf(format, args...)}
}

// take consumes n octets. The slice is valid until the next take.
func (d *decoder) take(n uint64) ([]byte, error) {
	if n > d.left() {
		return nil, d.fail(-1, "truncated")
	}
	if uint64(d.off)+n > MaxHeaderSize {
		return nil, d.fail(-1, "metadata exceeds %d octets", MaxHeaderSize)
	}
	var p []byte
	if n <= windowSize {
		end := d.off + int64(n)
		if d.off < d.bufOff || end > d.bufOff+int64(len(d.win)) {
			if err := d.fill(); err != nil {
				return nil, err
			}
		}
		p = d.win[d.off-d.bufOff : end-d.bufOff]
	} else {
		p = make([]byte, n)
		if err := d.readAt(p, d.off); err != nil {
			return nil, err
		}
	}
	d.off += int64(n)
	if d.recording {
		d.rec = append(d.rec, p...)
	}
	return p, nil
}

func (d *decoder) fill() error {
	if d.win == nil {
		d.win = make([]byte, windowSize)
	}
	m := min(int64(windowSize), d.size-d.off)
	d.win = d.win[:cap(d.win)][:m]
	d.bufOff = d.off
	return d.readAt(d.win, d.off)
}

func (d *decoder) readAt(p []byte, off int64) error {
	n, err := d.r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		return d.fail(off+int64(n), "truncated (the reader ended before the file size)")
	}
	return fmt.Errorf("gguf: read at offset %d: %w", off, err)
}

func (d *decoder) u32() (uint32, error) {
	p, err := d.take(4)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint32(p), nil
}

func (d *decoder) u64() (uint64, error) {
	p, err := d.take(8)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(p), nil
}

// str reads a string of at most limit octets.
func (d *decoder) str(limit uint64) (string, error) {
	start := d.off
	n, err := d.u64()
	if err != nil {
		return "", err
	}
	if n > limit {
		return "", d.fail(start, "string length %d exceeds %d", n, limit)
	}
	if n > d.left() {
		return "", d.fail(start, "string length %d exceeds the %d octets left", n, d.left())
	}
	p, err := d.take(n)
	if err != nil {
		return "", err
	}
	return string(p), nil
}

// scalar reads a fixed-size value: its bits, signed integers sign-extended
// and float32 widened to float64 bits.
func (d *decoder) scalar(t ValueType) (uint64, error) {
	p, err := d.take(t.fixedSize())
	if err != nil {
		return 0, err
	}
	return scalarBits(t, p, d, d.off-int64(len(p)))
}

func scalarBits(t ValueType, p []byte, d *decoder, off int64) (uint64, error) {
	le := binary.LittleEndian
	switch t {
	case TypeUint8:
		return uint64(p[0]), nil
	case TypeInt8:
		return uint64(int64(int8(p[0]))), nil
	case TypeBool:
		if p[0] > 1 {
			return 0, d.fail(off, "bool value %d (want 0 or 1)", p[0])
		}
		return uint64(p[0]), nil
	case TypeUint16:
		return uint64(le.Uint16(p)), nil
	case TypeInt16:
		return uint64(int64(int16(le.Uint16(p)))), nil
	case TypeUint32:
		return uint64(le.Uint32(p)), nil
	case TypeInt32:
		return uint64(int64(int32(le.Uint32(p)))), nil
	case TypeFloat32:
		return math.Float64bits(float64(math.Float32frombits(le.Uint32(p)))), nil
	case TypeUint64, TypeInt64, TypeFloat64:
		return le.Uint64(p), nil
	}
	return 0, d.fail(off, "invalid value type %d", uint32(t))
}

// array reads (and discards) an array value after its type: element type,
// count, elements.
func (d *decoder) array(depth int) (ValueType, uint64, error) {
	start := d.off
	t, err := d.u32()
	if err != nil {
		return 0, 0, err
	}
	et := ValueType(t)
	n, err := d.u64()
	if err != nil {
		return 0, 0, err
	}
	least := et.minSize()
	switch {
	case least == 0:
		return 0, 0, d.fail(start, "invalid array element type %d", t)
	case n > MaxArrayLen:
		return 0, 0, d.fail(start, "array of %d elements exceeds %d", n, MaxArrayLen)
	case n > d.left()/least:
		return 0, 0, d.fail(start, "array of %d %s elements exceeds the %d octets left", n, et, d.left())
	}
	switch et {
	case TypeString:
		for range n {
			if _, err := d.str(MaxStringLen); err != nil {
				return 0, 0, err
			}
		}
	case TypeArray:
		if depth+1 >= MaxArrayDepth {
			return 0, 0, d.fail(start, "arrays nested deeper than %d", MaxArrayDepth)
		}
		for range n {
			if _, _, err := d.array(depth + 1); err != nil {
				return 0, 0, err
			}
		}
	case TypeBool:
		p, err := d.take(n)
		if err != nil {
			return 0, 0, err
		}
		for i, b := range p {
			if b > 1 {
				return 0, 0, d.fail(d.off-int64(n)+int64(i), "bool value %d (want 0 or 1)", b)
			}
		}
	default:
		// Fixed-size elements are taken in bounded chunks so that a long
		// array does not need one allocation of its whole size.
		sz := et.fixedSize()
		for rest := n * sz; rest > 0; {
			k := min(rest, windowSize)
			if _, err := d.take(k); err != nil {
				return 0, 0, err
			}
			rest -= k
		}
	}
	return et, n, nil
}

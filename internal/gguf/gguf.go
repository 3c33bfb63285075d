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
// tensor data. What it keeps is a small multiple of those octets, however
// they are spent: one copy of them, 8 octets of index per KV entry and
// per tensor, and nothing per array element (the accessors decode values
// from the copy when asked). Usage:
//
//	f, err := gguf.Open("model.gguf")
//	if err != nil { ... } // errors.Is(err, gguf.ErrFormat) for a malformed file
//	arch, _ := f.String("general.architecture")
//	layers, _ := f.Uint(arch + ".block_count")
//	tok := f.RawEntries("tokenizer.") // exact octets, for a tokenizer digest
package gguf

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
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
//
// MaxKeys, MaxTensors and MaxArrayElements cap what the header may hold.
// Real models have under a hundred keys, at most a few thousand tensors
// (1,100 in a 126-layer llama) and about a million array elements
// (vocabulary, scores, token types, merges), well under the caps. Parse's
// own memory does not need them (see Parse); an instance's start does.
// llama.cpp parses the file again when it loads the model, keeping more
// per key and per tensor than the file spends (measured with v0.4.0:
// about 200 and 650 octets of RSS for a 19-octet key and a 40-octet
// tensor info), and it checks keys and tensor names for duplicates pair by
// pair: 16,000 of either cost it 0.4 s, 65,000 cost 5 to 7 s.
const (
	MaxKeyLen        = 1<<16 - 1
	MaxStringLen     = 1 << 30
	MaxArrayLen      = 1 << 30
	MaxNameLen       = 63
	MaxDims          = 4
	MaxArrayDepth    = 8
	MaxHeaderSize    = 256 << 20
	MaxKeys          = 1 << 14
	MaxTensors       = 1 << 14
	MaxArrayElements = 1 << 24 // all the file's arrays together, nested ones included
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

// File is the parsed metadata and tensor table of a GGUF file. It is
// immutable and safe for concurrent use.
//
// It keeps the file's octets before the data section (hdr) and indexes
// them: a Go value per entry (a map entry, a key string, a boxed value, a
// copy of its octets) had cost about 20 times the octets a tiny entry
// takes in the file (D6). The accessors decode what they are asked for
// from hdr, which Parse has checked entirely.
type File struct {
	version    uint32
	alignment  uint64
	dataOffset uint64
	hdr        []byte   // at most MaxHeaderSize octets, so offsets in it fit a uint32
	kv         []uint32 // kv[i]: hdr offset of entry i; kv[len(kv)-1]: the end of the last
	kvSorted   []uint32 // entry numbers in ascending bytewise key order
	tensors    []uint32 // hdr offset of tensor info i
	tSorted    []uint32 // tensor numbers in ascending bytewise name order
}

// errChanged is the error of a file whose header differs between Parse's
// two reads of it.
var errChanged = errors.New("gguf: the file changed while it was being read")

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
// Beyond the layout it checks: version 2 or 3; at most MaxKeys entries,
// MaxTensors tensors and MaxArrayElements array elements; keys non-empty
// UTF-8 of at most MaxKeyLen octets and unique; value types 0..12; bools
// 0 or 1; general.alignment, when present, a uint32 power of two; tensor
// names non-empty UTF-8 of at most MaxNameLen octets and unique; at most
// 4 dims; a known ggml type (an unknown one is refused, naming its
// number: without its block size the tensor's extent, and so the bounds
// check, is unknown); ne0 a multiple of the type's block; offsets
// multiples of the alignment; every tensor's data inside the file. The
// octets after the last tensor's data (its padding, which writers emit)
// are not required.
//
// It reads the metadata twice. The first pass goes through a 64 KiB
// window and keeps nothing: it checks the layout and finds where the
// tensor infos end, so that a malformed file costs no memory and the
// second pass knows the size of what it keeps. The second reads those
// octets into one buffer of exactly that size and parses it again,
// recording where each entry and tensor info starts, so the File holds
// what was checked even if the file changed between the reads. The File
// then holds the header octets and 8 octets per entry and per tensor
// (an entry takes at least 14 in the file, a tensor info 25): at most
// 1.6 times the header. Beyond it Parse allocates the window and a copy
// of the longest key. Its time is linear in the header, but for sorting
// the keys and names (at most MaxKeys and MaxTensors of them).
func Parse(r io.ReaderAt, size int64) (*File, error) {
	if size < 0 {
		return nil, fmt.Errorf("gguf: negative size %d", size)
	}
	scan := &decoder{r: r, size: size}
	if err := (&File{alignment: DefaultAlignment}).parse(scan, false); err != nil {
		return nil, err
	}
	end := scan.off
	hdr := make([]byte, end)
	if err := scan.readAt(hdr, 0); err != nil {
		return nil, err
	}
	d := &decoder{size: size, win: hdr, mem: true}
	f := &File{alignment: DefaultAlignment, hdr: hdr}
	if err := f.parse(d, true); err != nil {
		return nil, err
	}
	if d.off != end {
		return nil, errChanged
	}
	return f, nil
}

// parse reads the metadata through d. With keep it records the entries'
// and tensor infos' offsets (d then reads hdr itself, so they are offsets
// in it) and checks what needs them: unique keys and names, and the
// tensors' data.
func (f *File) parse(d *decoder, keep bool) error {
	d.at("header", -1, nil)
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
	if nTensors > MaxTensors {
		return d.fail(8, "%d tensors exceed the cap of %d", nTensors, MaxTensors)
	}
	if nKV > MaxKeys {
		return d.fail(16, "%d keys exceed the cap of %d", nKV, MaxKeys)
	}

	if keep {
		f.kv = make([]uint32, 0, nKV+1)
		f.tensors = make([]uint32, 0, nTensors)
	}
	for i := range nKV {
		start := d.off
		if err := f.parseEntry(d, i); err != nil {
			return err
		}
		if keep {
			f.kv = append(f.kv, uint32(start))
		}
	}
	if keep {
		f.kv = append(f.kv, uint32(d.off))
		var dup int
		if f.kvSorted, dup = f.sortNames(f.kv[:nKV]); dup >= 0 {
			d.at("key", int64(dup), f.name(f.kv[dup]))
			return d.fail(int64(f.kv[dup]), "duplicate key")
		}
	}

	for i := range nTensors {
		start := d.off
		if err := d.tensorInfo(i); err != nil {
			return err
		}
		if keep {
			f.tensors = append(f.tensors, uint32(start))
		}
	}
	if !keep {
		return nil
	}
	var dup int
	if f.tSorted, dup = f.sortNames(f.tensors); dup >= 0 {
		d.at("tensor info", int64(dup), f.name(f.tensors[dup]))
		return d.fail(int64(f.tensors[dup]), "duplicate tensor name")
	}

	d.at("data section", -1, nil)
	f.dataOffset = alignUp(uint64(d.off), f.alignment)
	if len(f.tensors) > 0 && f.dataOffset > uint64(d.size) {
		return d.fail(d.off, "data section at %d is past the end of the file (%d octets)", f.dataOffset, d.size)
	}
	for i, off := range f.tensors {
		name, dims, typ, rel := f.tensorAt(off, &d.dims)
		d.at("tensor", int64(i), name)
		if rel%f.alignment != 0 {
			return d.fail(-1, "tensor offset %d is not a multiple of the alignment %d", rel, f.alignment)
		}
		size, _ := TensorBytes(typ, dims) // checked by tensorInfo
		if rel > uint64(d.size) || size > uint64(d.size)-rel || f.dataOffset > uint64(d.size)-rel-size {
			return d.fail(-1, "tensor data (%d octets at data offset %d) extends past the end of the file (%d octets)", size, rel, d.size)
		}
	}
	return nil
}

// parseEntry reads KV entry i, and takes general.alignment's value.
func (f *File) parseEntry(d *decoder, i uint64) error {
	start := d.off
	d.at("key", int64(i), nil)
	key, err := d.str(MaxKeyLen)
	if err != nil {
		return err
	}
	if len(key) == 0 || !utf8.Valid(key) {
		return d.fail(start, "key is empty or not UTF-8")
	}
	d.named(key)
	t, err := d.u32()
	if err != nil {
		return err
	}
	typ := ValueType(t)
	var bits uint64
	switch {
	case typ == TypeArray:
		_, _, err = d.array(0)
	case typ == TypeString:
		err = d.skipStr(MaxStringLen)
	case typ.fixedSize() != 0:
		bits, err = d.scalar(typ)
	default:
		return d.fail(d.off-4, "invalid value type %d", t)
	}
	if err != nil {
		return err
	}
	if string(d.name) == "general.alignment" {
		if typ != TypeUint32 {
			return d.fail(start, "general.alignment is %s, want uint32", typ)
		}
		if bits == 0 || bits&(bits-1) != 0 {
			return d.fail(start, "general.alignment %d is not a power of two", bits)
		}
		f.alignment = bits
	}
	return nil
}

// tensorInfo reads tensor info i.
func (d *decoder) tensorInfo(i uint64) error {
	start := d.off
	d.at("tensor info", int64(i), nil)
	name, err := d.str(MaxNameLen)
	if err != nil {
		return err
	}
	if len(name) == 0 || !utf8.Valid(name) {
		return d.fail(start, "tensor name is empty or not UTF-8")
	}
	d.named(name)
	nd, err := d.u32()
	if err != nil {
		return err
	}
	if nd > MaxDims {
		return d.fail(d.off-4, "%d dimensions (at most %d)", nd, MaxDims)
	}
	dims := d.dims[:nd]
	for j := range dims {
		if dims[j], err = d.u64(); err != nil {
			return err
		}
	}
	typeOff := d.off
	typ, err := d.u32()
	if err != nil {
		return err
	}
	if _, err := TensorBytes(typ, dims); err != nil {
		return d.fail(typeOff, "%v", err)
	}
	_, err = d.u64() // the offset, checked with the data section
	return err
}

// sortNames returns the entries or tensor infos at starts (each begins
// with its key or name) in ascending bytewise order of those, and the
// first in file order whose name an earlier one has, or -1.
func (f *File) sortNames(starts []uint32) (sorted []uint32, dup int) {
	sorted = make([]uint32, len(starts))
	for i := range sorted {
		sorted[i] = uint32(i)
	}
	slices.SortFunc(sorted, func(a, b uint32) int {
		if c := bytes.Compare(f.name(starts[a]), f.name(starts[b])); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	dup = -1
	for j := 1; j < len(sorted); j++ {
		a, b := sorted[j-1], sorted[j]
		if (dup < 0 || int(b) < dup) && bytes.Equal(f.name(starts[a]), f.name(starts[b])) {
			dup = int(b)
		}
	}
	return sorted, dup
}

// name is the key or tensor name of the entry or tensor info at off.
func (f *File) name(off uint32) []byte {
	n := binary.LittleEndian.Uint64(f.hdr[off:])
	return f.hdr[off+8 : uint64(off)+8+n]
}

// value is entry i's type and value octets.
func (f *File) value(i int) (ValueType, []byte) {
	off := uint64(f.kv[i])
	p := off + 8 + binary.LittleEndian.Uint64(f.hdr[off:])
	return ValueType(binary.LittleEndian.Uint32(f.hdr[p:])), f.hdr[p+4 : f.kv[i+1]]
}

// tensorAt decodes the tensor info at off; dims is a slice of buf.
func (f *File) tensorAt(off uint32, buf *[MaxDims]uint64) (name []byte, dims []uint64, typ uint32, rel uint64) {
	le := binary.LittleEndian
	name = f.name(off)
	p := f.hdr[uint64(off)+8+uint64(len(name)):]
	dims = buf[:le.Uint32(p)]
	p = p[4:]
	for j := range dims {
		dims[j] = le.Uint64(p[8*j:])
	}
	p = p[8*len(dims):]
	return name, dims, le.Uint32(p), le.Uint64(p[4:])
}

// find returns the number of the entry or tensor named name: sorted and
// starts are kvSorted and kv, or tSorted and tensors.
func (f *File) find(sorted, starts []uint32, name string) (int, bool) {
	j, ok := slices.BinarySearchFunc(sorted, name, func(i uint32, name string) int { return compareString(f.name(starts[i]), name) })
	if !ok {
		return 0, false
	}
	return int(sorted[j]), true
}

// compareString is bytes.Compare(b, []byte(s)) without the conversion.
func compareString(b []byte, s string) int {
	for i := range min(len(b), len(s)) {
		if b[i] != s[i] {
			return cmp.Compare(b[i], s[i])
		}
	}
	return cmp.Compare(len(b), len(s))
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
	keys := make([]string, len(f.kv)-1)
	for i := range keys {
		keys[i] = string(f.name(f.kv[i]))
	}
	return keys
}

// Type returns the value type of key.
func (f *File) Type(key string) (ValueType, bool) {
	i, ok := f.find(f.kvSorted, f.kv, key)
	if !ok {
		return 0, false
	}
	t, _ := f.value(i)
	return t, true
}

// ArrayLen returns the element type and count of an array value.
func (f *File) ArrayLen(key string) (elem ValueType, n uint64, ok bool) {
	t, v, ok := f.lookup(key)
	if !ok || t != TypeArray {
		return 0, 0, false
	}
	return ValueType(binary.LittleEndian.Uint32(v)), binary.LittleEndian.Uint64(v[4:]), true
}

// String returns a string value.
func (f *File) String(key string) (string, bool) {
	t, v, ok := f.lookup(key)
	if !ok || t != TypeString {
		return "", false
	}
	return string(v[8:]), true
}

// Uint returns a value of any unsigned integer type, or of a signed one
// when it is not negative.
func (f *File) Uint(key string) (uint64, bool) {
	t, v, ok := f.lookup(key)
	if !ok {
		return 0, false
	}
	bits := scalarBits(t, v)
	switch t {
	case TypeUint8, TypeUint16, TypeUint32, TypeUint64:
		return bits, true
	case TypeInt8, TypeInt16, TypeInt32, TypeInt64:
		if int64(bits) >= 0 {
			return bits, true
		}
	}
	return 0, false
}

// Float returns a float32 or float64 value.
func (f *File) Float(key string) (float64, bool) {
	t, v, ok := f.lookup(key)
	if !ok || (t != TypeFloat32 && t != TypeFloat64) {
		return 0, false
	}
	return math.Float64frombits(scalarBits(t, v)), true
}

// Bool returns a bool value.
func (f *File) Bool(key string) (bool, bool) {
	t, v, ok := f.lookup(key)
	if !ok || t != TypeBool {
		return false, false
	}
	return v[0] != 0, true
}

// lookup is key's type and value octets.
func (f *File) lookup(key string) (ValueType, []byte, bool) {
	i, ok := f.find(f.kvSorted, f.kv, key)
	if !ok {
		return 0, nil, false
	}
	t, v := f.value(i)
	return t, v, true
}

// RawEntries returns the exact octets, as encoded in the file (key
// length, key, value type, value), of every KV entry whose key starts
// with prefix, concatenated in ascending bytewise key order. It is the
// input of a digest over, say, the "tokenizer." entries: independent of
// the entries' order in the file and of everything else in it.
// WriteRawEntries writes the same octets without gathering them.
func (f *File) RawEntries(prefix string) []byte {
	lo, hi := f.prefixed(prefix)
	var n int
	for _, i := range f.kvSorted[lo:hi] {
		n += int(f.kv[i+1] - f.kv[i])
	}
	out := make([]byte, 0, n)
	for _, i := range f.kvSorted[lo:hi] {
		out = append(out, f.hdr[f.kv[i]:f.kv[i+1]]...)
	}
	return out
}

// WriteRawEntries writes RawEntries(prefix) to w, entry by entry, and
// returns the octets written: a digest of them needs no copy of the
// entries, which may be most of the header.
func (f *File) WriteRawEntries(w io.Writer, prefix string) (int64, error) {
	lo, hi := f.prefixed(prefix)
	var n int64
	for _, i := range f.kvSorted[lo:hi] {
		m, err := w.Write(f.hdr[f.kv[i]:f.kv[i+1]])
		n += int64(m)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// prefixed is the range of kvSorted whose keys start with prefix: they
// are adjacent in bytewise order.
func (f *File) prefixed(prefix string) (lo, hi int) {
	lo, _ = slices.BinarySearchFunc(f.kvSorted, prefix, func(i uint32, p string) int { return compareString(f.name(f.kv[i]), p) })
	for hi = lo; hi < len(f.kvSorted); hi++ {
		if k := f.name(f.kv[f.kvSorted[hi]]); len(k) < len(prefix) || string(k[:len(prefix)]) != prefix {
			break
		}
	}
	return lo, hi
}

// Tensor returns the named tensor's info.
func (f *File) Tensor(name string) (TensorInfo, bool) {
	i, ok := f.find(f.tSorted, f.tensors, name)
	if !ok {
		return TensorInfo{}, false
	}
	return f.tensor(i), true
}

// Tensors returns the tensor infos in file order.
func (f *File) Tensors() []TensorInfo {
	out := make([]TensorInfo, len(f.tensors))
	for i := range out {
		out[i] = f.tensor(i)
	}
	return out
}

// tensor decodes tensor i into a TensorInfo of its own.
func (f *File) tensor(i int) TensorInfo {
	var buf [MaxDims]uint64
	name, dims, typ, rel := f.tensorAt(f.tensors[i], &buf)
	size, _ := TensorBytes(typ, dims)
	return TensorInfo{Name: string(name), Dims: slices.Clone(dims), Type: typ, Offset: f.dataOffset + rel, Size: size}
}

// decoder reads the metadata sequentially: through a window over r (the
// first pass), or from the header octets themselves, win, with mem set
// (the second). Every take is checked against the octets left in the file
// before anything is allocated, so a hostile count or length costs
// nothing, and nothing is allocated per entry: an error's context is
// formatted only when the error is.
type decoder struct {
	r      io.ReaderAt
	size   int64
	off    int64 // next octet
	win    []byte
	bufOff int64 // file offset of win[0]
	mem    bool  // win is the header from offset 0; r is not read

	what    string // being read: "header", "key", "tensor info", "data section", "tensor"
	idx     int64  // its number, or -1
	name    []byte // its key or name, once read
	nameBuf []byte

	elems uint64          // array elements so far, nested ones included
	dims  [MaxDims]uint64 // a tensor info's, here so they are not allocated per info
}

const windowSize = 64 << 10

func (d *decoder) left() uint64 { return uint64(d.size - d.off) }

// at says what is being read, for errors.
func (d *decoder) at(what string, idx int64, name []byte) {
	d.what, d.idx, d.name = what, idx, name
}

// named records the name of the key or tensor being read: a copy through
// the window, which moves; itself from the header, which does not.
func (d *decoder) named(name []byte) {
	if d.mem {
		d.name = name
		return
	}
	d.nameBuf = append(d.nameBuf[:0], name...)
	d.name = d.nameBuf
}

// fail returns a FormatError at off (the current offset when off < 0).
func (d *decoder) fail(off int64, format string, args ...any) error {
	if off < 0 {
		off = d.off
	}
	ctx := d.what
	if d.idx >= 0 {
		ctx += " " + strconv.FormatInt(d.idx, 10)
		if d.name != nil {
			ctx += " (" + string(d.name) + ")"
		}
	}
	return &FormatError{Offset: off, Context: ctx, Msg: fmt.Sprintf(format, args...)}
}

// check is the bounds check of a take or skip of n octets.
func (d *decoder) check(n uint64) error {
	if n > d.left() {
		return d.fail(-1, "truncated")
	}
	if uint64(d.off)+n > MaxHeaderSize {
		return d.fail(-1, "metadata exceeds %d octets", MaxHeaderSize)
	}
	if d.mem && uint64(d.off)+n > uint64(len(d.win)) {
		return errChanged
	}
	return nil
}

// take consumes n octets. The slice is valid until the next take (for
// good with mem).
func (d *decoder) take(n uint64) ([]byte, error) {
	if err := d.check(n); err != nil {
		return nil, err
	}
	end := d.off + int64(n)
	var p []byte
	switch {
	case d.mem:
		p = d.win[d.off:end]
	case n <= windowSize:
		if d.off < d.bufOff || end > d.bufOff+int64(len(d.win)) {
			if err := d.fill(); err != nil {
				return nil, err
			}
		}
		p = d.win[d.off-d.bufOff : end-d.bufOff]
	default: // no longer than a key, the parse never takes this: it skips long values
		p = make([]byte, n)
		if err := d.readAt(p, d.off); err != nil {
			return nil, err
		}
	}
	d.off = end
	return p, nil
}

// skip consumes n octets without reading them: the first pass needs only
// their length, and the second has them in hdr.
func (d *decoder) skip(n uint64) error {
	if err := d.check(n); err != nil {
		return err
	}
	d.off += int64(n)
	return nil
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

// strLen reads a string's length, at most limit.
func (d *decoder) strLen(limit uint64) (uint64, error) {
	start := d.off
	n, err := d.u64()
	if err != nil {
		return 0, err
	}
	if n > limit {
		return 0, d.fail(start, "string length %d exceeds %d", n, limit)
	}
	if n > d.left() {
		return 0, d.fail(start, "string length %d exceeds the %d octets left", n, d.left())
	}
	return n, nil
}

// str reads a string of at most limit octets (a key or a name: limit is
// at most the window's size).
func (d *decoder) str(limit uint64) ([]byte, error) {
	n, err := d.strLen(limit)
	if err != nil {
		return nil, err
	}
	return d.take(n)
}

// skipStr consumes a string value of at most limit octets.
func (d *decoder) skipStr(limit uint64) error {
	n, err := d.strLen(limit)
	if err != nil {
		return err
	}
	return d.skip(n)
}

// scalar reads a fixed-size value: its bits, signed integers sign-extended
// and float32 widened to float64 bits.
func (d *decoder) scalar(t ValueType) (uint64, error) {
	p, err := d.take(t.fixedSize())
	if err != nil {
		return 0, err
	}
	if t == TypeBool && p[0] > 1 {
		return 0, d.fail(d.off-1, "bool value %d (want 0 or 1)", p[0])
	}
	return scalarBits(t, p), nil
}

// scalarBits decodes a fixed-size value of type t, as scalar returns it.
func scalarBits(t ValueType, p []byte) uint64 {
	le := binary.LittleEndian
	switch t {
	case TypeUint8, TypeBool:
		return uint64(p[0])
	case TypeInt8:
		return uint64(int64(int8(p[0])))
	case TypeUint16:
		return uint64(le.Uint16(p))
	case TypeInt16:
		return uint64(int64(int16(le.Uint16(p))))
	case TypeUint32:
		return uint64(le.Uint32(p))
	case TypeInt32:
		return uint64(int64(int32(le.Uint32(p))))
	case TypeFloat32:
		return math.Float64bits(float64(math.Float32frombits(le.Uint32(p))))
	case TypeUint64, TypeInt64, TypeFloat64:
		return le.Uint64(p)
	}
	return 0
}

// array reads (and discards) an array value after its type: element type,
// count, elements. Its elements count against MaxArrayElements.
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
	case n > MaxArrayElements-d.elems:
		return 0, 0, d.fail(start, "array of %d elements makes the file's arrays %d elements, past the cap of %d", n, d.elems+n, MaxArrayElements)
	}
	d.elems += n
	switch et {
	case TypeString:
		for range n {
			if err := d.skipStr(MaxStringLen); err != nil {
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
		// Taken in bounded chunks, as the window holds them.
		for rest := n; rest > 0; {
			k := min(rest, windowSize)
			p, err := d.take(k)
			if err != nil {
				return 0, 0, err
			}
			for i, b := range p {
				if b > 1 {
					return 0, 0, d.fail(d.off-int64(k)+int64(i), "bool value %d (want 0 or 1)", b)
				}
			}
			rest -= k
		}
	default:
		if err := d.skip(n * et.fixedSize()); err != nil {
			return 0, 0, err
		}
	}
	return et, n, nil
}

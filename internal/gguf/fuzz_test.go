package gguf

import (
	"bytes"
	"errors"
	"runtime"
	"testing"
)

// FuzzParse: Parse never panics; a bytes.Reader cannot fail, so every
// error is ErrFormat; it allocates at most twice the input plus a
// constant (B13: the window, and a key's copy and error context, each at
// most MaxKeyLen); an accepted file's tensors lie inside it, its raw
// entries are no larger than it, and parsing is a function of the octets.
func FuzzParse(f *testing.F) {
	f.Add(sampleFile(f))
	f.Add(tinyBytes(f, smallTiny()))
	f.Add(nested(3))
	f.Add(header(0, 1).str("general.alignment").u32(uint32(TypeUint32)).u32(64).b)
	f.Add(header(1, 0).str("t").u32(2).u64(32).u64(1).u32(GGMLTypeQ8_0).u64(0).pad(32).raw(make([]byte, 34)...).b)
	f.Fuzz(func(t *testing.T, b []byte) {
		var file *File
		var err error
		if alloc := allocatedNoGC(func() { file, err = parse(b) }); alloc > 2*uint64(len(b))+512<<10 {
			t.Fatalf("parsing %d octets allocated %d (%v)", len(b), alloc, err)
		}
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("error %v does not wrap ErrFormat", err)
			}
			return
		}
		size := uint64(len(b))
		if file.DataOffset()%file.Alignment() != 0 {
			t.Fatalf("data offset %d, alignment %d", file.DataOffset(), file.Alignment())
		}
		for _, ti := range file.Tensors() {
			if ti.Offset < file.DataOffset() || ti.Offset > size || ti.Size > size-ti.Offset {
				t.Fatalf("tensor %+v outside the file of %d octets", ti, size)
			}
			if got, ok := file.Tensor(ti.Name); !ok || got.Offset != ti.Offset {
				t.Fatalf("Tensor(%q) = %+v, %v", ti.Name, got, ok)
			}
		}
		all := file.RawEntries("")
		if uint64(len(all)) > size {
			t.Fatalf("raw entries of %d octets in a file of %d", len(all), size)
		}
		for _, k := range file.Keys() {
			if _, ok := file.Type(k); !ok {
				t.Fatalf("key %q has no type", k)
			}
		}
		again, err := parse(b)
		if err != nil || !bytes.Equal(again.RawEntries(""), all) || len(again.Tensors()) != len(file.Tensors()) {
			t.Fatalf("second parse differs: %v", err)
		}
	})
}

// allocatedNoGC is the octets fn allocates, without allocated's
// collection first (TotalAlloc does not need one), which would slow
// fuzzing.
func allocatedNoGC(fn func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	fn()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

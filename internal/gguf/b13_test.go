package gguf

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvsp/kvsp/internal/figures"
)

// tinyKeys appends n KV entries of 19 octets: a 6-octet key, uint8 0.
func (e *enc) tinyKeys(n int) *enc {
	e.b = slices.Grow(e.b, 19*n)
	for i := range n {
		e.u64(6).raw(hex6(i)...).u32(uint32(TypeUint8)).raw(byte(i))
	}
	return e
}

// tinyTensors appends n tensor infos of 32 octets: an 8-octet name, no
// dimensions (one F32 element), data offset 0.
func (e *enc) tinyTensors(n int) *enc {
	e.b = slices.Grow(e.b, 32*n)
	for i := range n {
		e.u64(8).raw('t', 'n').raw(hex6(i)...).u32(0).u32(GGMLTypeF32).u64(0)
	}
	return e
}

// emptyStrings appends an array value of n empty strings (8 octets each).
func (e *enc) emptyStrings(n int) *enc {
	e.u32(uint32(TypeString)).u64(uint64(n))
	e.b = append(e.b, make([]byte, 8*n)...)
	return e
}

func hex6(i int) []byte {
	const digits = "0123456789abcdef"
	var p [6]byte
	for j := 5; j >= 0; j-- {
		p[j] = digits[i&15]
		i >>= 4
	}
	return p[:]
}

// TestB13_GGUFMetadataAmplification (RELIABILITY B13): what Parse
// allocates for a header is a small multiple of the header, however its
// octets are spent, and counts past the caps are refused at once, naming
// the cap, the count and the offset.
//   - Headers at the caps (MaxKeys 19-octet keys; MaxTensors 32-octet
//     tensor infos; those and 2 million empty strings) allocate at most
//     twice their octets plus the 64 KiB window; 8 octets of index per
//     key or tensor beyond the copy of the header. Before (D6), 4 million
//     tiny keys took 1.3 GiB for 74 MiB.
//   - The red team's shape, 2 million tiny keys (38 MB), is refused at
//     the key count (offset 16) with under 1 MiB allocated; so are
//     MaxTensors+1 tensor infos (offset 8) and arrays whose elements pass
//     MaxArrayElements (at the array that passes it).
func TestB13_GGUFMetadataAmplification(t *testing.T) {
	const strs = 2 << 20
	keys := header(0, MaxKeys).tinyKeys(MaxKeys).b
	tensors := header(MaxTensors, 0).tinyTensors(MaxTensors).pad(32).raw(0, 0, 0, 0).b
	all := header(MaxTensors, MaxKeys).tinyKeys(MaxKeys-1).str("b13.strings").u32(uint32(TypeArray)).emptyStrings(strs).
		tinyTensors(MaxTensors).pad(32).raw(0, 0, 0, 0).b
	detail := map[string]float64{}
	worst := 0.0
	for _, tc := range []struct {
		name          string
		b             []byte
		keys, tensors int
	}{
		{"keys", keys, MaxKeys, 0},
		{"tensors", tensors, 0, MaxTensors},
		{"mixed", all, MaxKeys, MaxTensors},
	} {
		var f *File
		var err error
		start := time.Now()
		alloc := allocated(func() { f, err = parse(tc.b) })
		took := time.Since(start)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if len(f.Keys()) != tc.keys || len(f.Tensors()) != tc.tensors {
			t.Fatalf("%s: %d keys and %d tensors", tc.name, len(f.Keys()), len(f.Tensors()))
		}
		size := uint64(len(tc.b))
		ratio := float64(alloc) / float64(size)
		perEntry := (float64(alloc) - float64(size) - windowSize) / float64(tc.keys+tc.tensors)
		t.Logf("%s: %d octets, %d keys, %d tensors: %d allocated, %.2f times the file (%.1f octets per key or tensor beyond the file's and the window) in %v",
			tc.name, size, tc.keys, tc.tensors, alloc, ratio, perEntry, took.Round(time.Millisecond))
		if alloc > 2*size+windowSize+16<<10 {
			t.Errorf("%s: %d allocated for %d octets (%.2f times), want at most twice plus the window", tc.name, alloc, size, ratio)
		}
		worst = max(worst, ratio)
		detail[tc.name+"_octets"] = float64(size)
		detail[tc.name+"_alloc_ratio"] = ratio
		detail[tc.name+"_octets_per_entry"] = perEntry
	}
	if f, _ := parse(all); f != nil {
		if et, n, ok := f.ArrayLen("b13.strings"); !ok || et != TypeString || n != strs {
			t.Errorf("b13.strings: %v %d %v", et, n, ok)
		}
		if v, ok := f.Uint("002bcd"); !ok || v != 0xcd {
			t.Errorf("key 002bcd: %d %v", v, ok)
		}
		if ti, ok := f.Tensor("tn003fff"); !ok || ti.Size != 4 || ti.Offset != f.DataOffset() {
			t.Errorf("tensor tn003fff: %+v %v", ti, ok)
		}
	}

	const millions = 2_000_000
	var elems bytes.Buffer // MaxArrayElements uint8s, then one more
	elems.Write(header(0, 2).str("a").u32(uint32(TypeArray)).u32(uint32(TypeUint8)).u64(MaxArrayElements).b)
	elems.Write(make([]byte, MaxArrayElements))
	aEnd := elems.Len()
	elems.Write((&enc{}).str("b").u32(uint32(TypeArray)).u32(uint32(TypeUint8)).u64(1).raw(0).b)
	for _, tc := range []struct {
		name string
		b    []byte
		want string
	}{
		{"2 million tiny keys", header(0, millions).tinyKeys(millions).b,
			fmt.Sprintf("gguf: %d keys exceed the cap of %d at offset 16 reading header", millions, MaxKeys)},
		{"MaxTensors+1 tensors", header(MaxTensors+1, 0).tinyTensors(MaxTensors+1).pad(32).raw(0, 0, 0, 0).b,
			fmt.Sprintf("gguf: %d tensors exceed the cap of %d at offset 8 reading header", MaxTensors+1, MaxTensors)},
		{"MaxArrayElements+1 elements", elems.Bytes(),
			fmt.Sprintf("gguf: array of 1 elements makes the file's arrays %d elements, past the cap of %d at offset %d reading key 1 (b)", MaxArrayElements+1, MaxArrayElements, aEnd+13)},
	} {
		var err error
		start := time.Now()
		alloc := allocated(func() { _, err = parse(tc.b) })
		took := time.Since(start)
		var fe *FormatError
		if !errors.As(err, &fe) || err.Error() != tc.want {
			t.Errorf("%s: got %v\nwant %s", tc.name, err, tc.want)
		}
		t.Logf("%s (%d octets): %v in %v, %d allocated", tc.name, len(tc.b), err, took.Round(time.Microsecond), alloc)
		if alloc > 1<<20 {
			t.Errorf("%s: %d allocated to refuse %d octets", tc.name, alloc, len(tc.b))
		}
	}
	figures.Report(t, figures.Row{Row: "B13", Inputs: 6,
		Held: fmt.Sprintf("headers at the caps (%d keys, %d tensors, %d empty strings) allocate at most %.2f times their octets; %d tiny keys, %d tensors, %d array elements refused at their counts with under 1 MiB",
			MaxKeys, MaxTensors, strs, worst, millions, MaxTensors+1, MaxArrayElements+1),
		Detail: detail})
}

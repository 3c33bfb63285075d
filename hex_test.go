package kvsp

import (
	"encoding/hex"
	"math/rand/v2"
	"testing"
)

// TestAppendHex agrees with encoding/hex on every octet value in every
// position and on every length up to 70, appending after a prefix.
func TestAppendHex(t *testing.T) {
	var all [256]byte
	for i := range all {
		all[i] = byte(i)
	}
	for off := range 4 {
		if got, want := string(appendHex([]byte("x"), all[off:])), "x"+hex.EncodeToString(all[off:]); got != want {
			t.Fatalf("offset %d:\n%s\n%s", off, got, want)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for n := range 71 {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		if got, want := string(appendHex(nil, b)), hex.EncodeToString(b); got != want {
			t.Fatalf("length %d:\n%s\n%s", n, got, want)
		}
	}
}

func FuzzAppendHex(f *testing.F) {
	f.Add([]byte{0x00, 0x9f, 0xa0, 0xff, 0x5a})
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := string(appendHex(nil, b)), hex.EncodeToString(b); got != want {
			t.Fatalf("%x: %s", b, got)
		}
	})
}

// BenchmarkAppendHex: the SWAR encoder against encoding/hex on a layer
// digest (the bound: the standard library in the same run).
func BenchmarkAppendHex(b *testing.B) {
	var d [32]byte
	for i := range d {
		d[i] = byte(i * 37)
	}
	buf := make([]byte, 0, 64)
	b.Run("kvsp", func(b *testing.B) {
		b.SetBytes(32)
		b.ReportAllocs()
		for b.Loop() {
			buf = appendHex(buf[:0], d[:])
		}
	})
	b.Run("encoding-hex", func(b *testing.B) {
		b.SetBytes(32)
		b.ReportAllocs()
		for b.Loop() {
			buf = hex.AppendEncode(buf[:0], d[:])
		}
	})
}

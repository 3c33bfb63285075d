package kvsp

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/go-json-experiment/json"
)

// reflectDecode is the reflective path tokenJSON replaces.
func reflectDecode(b []byte) ([]uint32, error) {
	var v struct {
		T []uint32 `json:"t"`
	}
	err := json.Unmarshal(append(append([]byte(`{"t":`), b...), '}'), &v, decodeOptions, json.WithUnmarshalers(nil))
	return v.T, err
}

func fastDecode(b []byte) ([]uint32, error) {
	var v struct {
		T []uint32 `json:"t"`
	}
	err := json.Unmarshal(append(append([]byte(`{"t":`), b...), '}'), &v, decodeOptions)
	return v.T, err
}

// checkTokenJSON: the fast path accepts exactly what the reflective one
// does, with the same value (nil for null, empty for []).
func checkTokenJSON(t *testing.T, in []byte) {
	t.Helper()
	want, werr := reflectDecode(in)
	got, gerr := fastDecode(in)
	if werr == nil && gerr != nil && len(bytes.TrimSpace(in)) > 4 && bytes.Contains(in, []byte("null")) {
		// A null element: refused here, token 0 there (the one difference).
		got, gerr = fastDecode(bytes.ReplaceAll(in, []byte("null"), []byte("0")))
	}
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("%q: reflective error %v, fast error %v", in, werr, gerr)
	}
	if werr == nil && (!slices.Equal(got, want) || (got == nil) != (want == nil)) {
		t.Fatalf("%q: fast %v, reflective %v", in, got, want)
	}
}

var tokenJSONCases = []string{
	`[]`, `null`, `[0]`, `[1,2,3]`, ` [ 1 , 2 ,3 ] `, "[\n7\t,\r8]", `[4294967295]`, `[4294967296]`, `[99999999999999999999]`,
	`[-1]`, `[1.5]`, `[1e3]`, `[1.0]`, `[-0]`, `["1"]`, `[[1]]`, `[{}]`, `[null]`, `[true]`, `{}`, `"x"`, `1`, `[1,]`, `[01]`, `[1 2]`,
}

func TestTokenJSONMatchesReflect(t *testing.T) {
	for _, c := range tokenJSONCases {
		checkTokenJSON(t, []byte(c))
	}
	// And a place request decodes through kvsp.Decode with its errors
	// (400, naming the member and the token, never the value).
	var q PlaceRequest
	err := Decode([]byte(`{"scope_id":"`+strings.Repeat("cd", 16)+`","compat_id":"`+strings.Repeat("ab", 32)+`","tokens":[1,2,-3],"max_tokens":1}`), &q)
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("/tokens: token 2")) || bytes.Contains([]byte(err.Error()), []byte("-3")) {
		t.Fatalf("bad token: %v", err)
	}
}

func FuzzTokenJSON(f *testing.F) {
	for _, c := range tokenJSONCases {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, in []byte) { checkTokenJSON(t, in) })
}

// BenchmarkTokenJSON: a 15,000-token prompt (the embedded trace's mean)
// decoded, fast against the reflective path in the same run (and the
// reflective encoder, which is used).
func BenchmarkTokenJSON(b *testing.B) {
	r := rand.New(rand.NewPCG(3, 4))
	ts := make([]uint32, 15000)
	for i := range ts {
		ts[i] = r.Uint32N(128000)
	}
	enc, _ := json.Marshal(ts)
	for _, c := range []struct {
		name string
		opts json.Options
	}{{"fast", tokenJSON}, {"reflect", json.WithMarshalers(nil)}} {
		if c.name == "reflect" {
			b.Run("encode/"+c.name, func(b *testing.B) {
				b.SetBytes(int64(len(enc)))
				b.ReportAllocs()
				for b.Loop() {
					json.Marshal(ts, c.opts)
				}
			})
		}
		b.Run("decode/"+c.name, func(b *testing.B) {
			b.SetBytes(int64(len(enc)))
			b.ReportAllocs()
			dopts := json.JoinOptions(decodeOptions, json.WithUnmarshalers(nil))
			if c.name == "fast" {
				dopts = decodeOptions
			}
			for b.Loop() {
				var out []uint32
				json.Unmarshal(enc, &out, dopts)
			}
		})
	}
}

package kvsp

import (
	"bytes"
	"errors"
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

// TestTokensLE32: a prompt sent as tokens_le32 decodes to the same place
// and generate requests as one sent as tokens; a body with both, or with
// octets not a multiple of 4, is refused (400); client-side, the client
// sends tokens_le32 (client tests).
func TestTokensLE32(t *testing.T) {
	ts := []uint32{0, 1, 255, 256, 65536, 4294967295, 7}
	scope, compat := strings.Repeat("cd", 16), strings.Repeat("ab", 32)
	le, _ := json.Marshal(TokensLE32(ts))
	arr, _ := json.Marshal(ts)
	for _, body := range []string{
		`{"scope_id":"` + scope + `","compat_id":"` + compat + `","tokens_le32":` + string(le) + `,"max_tokens":1}`,
		`{"scope_id":"` + scope + `","compat_id":"` + compat + `","tokens":` + string(arr) + `,"max_tokens":1}`,
	} {
		var q PlaceRequest
		if err := Decode([]byte(body), &q); err != nil || !slices.Equal(q.Tokens, ts) || q.TokensLE32 != nil {
			t.Fatalf("place %s: %v %v", body, q.Tokens, err)
		}
		g := GenerateRequest{}
		gb := strings.Replace(body, `{`, `{"session":"`+NewUUID().String()+`","epoch":1,`, 1)
		if err := Decode([]byte(gb), &g); err != nil || !slices.Equal(g.Tokens, ts) || g.TokensLE32 != nil {
			t.Fatalf("generate %s: %v %v", gb, g.Tokens, err)
		}
	}
	for _, c := range []struct{ body, want string }{
		{`"tokens":[1],"tokens_le32":"AQAAAA=="`, "one or the other"},
		{`"tokens_le32":"AQAA"`, "not a multiple of 4"},
		{`"tokens_le32":"AQAAAA"`, "tokens_le32"}, // unpadded: not RFC 4648 base64
		{`"tokens_le32":""`, "tokens: required"},  // no token
	} {
		var q PlaceRequest
		err := Decode([]byte(`{"scope_id":"`+scope+`","compat_id":"`+compat+`",`+c.body+`,"max_tokens":1}`), &q)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want a 400 naming %q", c.body, err, c.want)
		}
	}
}

// BenchmarkTokensLE32: the same 15,000-token prompt as BenchmarkTokenJSON,
// as a tokens_le32 member, encoded and decoded (the base64 string, then
// the fold into ids), against the decimal array in the same run.
func BenchmarkTokensLE32(b *testing.B) {
	r := rand.New(rand.NewPCG(3, 4))
	ts := make([]uint32, 15000)
	for i := range ts {
		ts[i] = r.Uint32N(128000)
	}
	type body struct {
		T  []uint32 `json:"tokens,omitempty"`
		LE []byte   `json:"tokens_le32,omitempty"`
	}
	for _, c := range []struct {
		name string
		v    body
	}{{"le32", body{LE: TokensLE32(ts)}}, {"array", body{T: ts}}} {
		enc, _ := json.Marshal(&c.v)
		b.Run("encode/"+c.name, func(b *testing.B) {
			b.SetBytes(int64(len(ts)) * 4)
			b.ReportAllocs()
			for b.Loop() {
				v := c.v
				if v.LE != nil {
					v.LE = TokensLE32(ts)
				}
				json.Marshal(&v, tokenJSON)
			}
		})
		b.Run("decode/"+c.name, func(b *testing.B) {
			b.SetBytes(int64(len(ts)) * 4)
			b.ReportAllocs()
			for b.Loop() {
				var v body
				json.Unmarshal(enc, &v, decodeOptions)
				if err := foldTokensLE32("bench", &v.T, &v.LE); err != nil || len(v.T) != len(ts) {
					b.Fatal(err)
				}
			}
		})
	}
}

package kvsp_test

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/go-json-experiment/json"
	"github.com/gowebpki/jcs"

	"github.com/kvsp/kvsp"
)

// FuzzDescriptor: any accepted descriptor has a stable canonical form:
// JCS(JCS(x)) == JCS(x), and re-parsing the canonical form gives the same
// Compatibility ID. Rejections are ErrInvalid, never panics.
func FuzzDescriptor(f *testing.F) {
	f.Add([]byte(vecJCS.value))
	f.Add([]byte(prettyDescriptor))
	f.Add([]byte(addMember(`"adapters":["sha-256:` + hx32 + `"]`)))
	f.Add([]byte(replaceMember("positional", `"rope;scaling=yarn,theta=500000"`)))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := kvsp.ParseDescriptor(data)
		if err != nil {
			if !errors.Is(err, kvsp.ErrInvalid) {
				t.Fatalf("rejection is not ErrInvalid: %v", err)
			}
			return
		}
		j, err := d.JCS()
		if err != nil {
			t.Fatalf("valid descriptor has no JCS: %v", err)
		}
		again, err := jcs.Transform(j)
		if err != nil || !bytes.Equal(again, j) {
			t.Fatalf("JCS not idempotent: %s vs %s", j, again)
		}
		d2, err := kvsp.ParseDescriptor(j)
		if err != nil {
			t.Fatalf("canonical form rejected: %v\n%s", err, j)
		}
		c1, _ := d.CompatID()
		c2, _ := d2.CompatID()
		if c1 != c2 {
			t.Fatalf("compat_id changed through the canonical form")
		}
	})
}

// FuzzRecords: for every record type, an accepted body re-encodes to a body
// that is accepted and decodes to the same value.
func FuzzRecords(f *testing.F) {
	for i, c := range recordCases {
		f.Add(uint8(i), []byte(c.example))
	}
	f.Add(uint8(6), []byte(`{"map":"m","commit":5}`))
	f.Add(uint8(6), []byte(`{"map":"m","from":1,"to":2,"deadline_ms":5,"retain":[],"release":[],"scope_id":"`+hx16+`","compat_id":"`+hx32+
		`","fetch":[{"tokens":[0,16],"from":"https://a/","holder":"https://h/","block_keys":["`+hx32+`"]}]}`))
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		c := recordCases[int(which)%len(recordCases)]
		v := c.new()
		if err := kvsp.Decode(data, v); err != nil {
			if !errors.Is(err, kvsp.ErrInvalid) && !errors.Is(err, kvsp.ErrStaleEpoch) {
				t.Fatalf("%s: rejection is not ErrInvalid: %v", c.name, err)
			}
			return
		}
		b, err := kvsp.Marshal(v)
		if err != nil {
			t.Fatalf("%s: accepted record does not marshal: %v", c.name, err)
		}
		w := c.new()
		if err := kvsp.Decode(b, w); err != nil {
			t.Fatalf("%s: re-encoded record rejected: %v\n%s", c.name, err, b)
		}
		if !reflect.DeepEqual(v, w) {
			t.Fatalf("%s: round trip changed the record\n%s", c.name, b)
		}
	})
}

// FuzzIdentifiers: a parsed identifier prints back to exactly its input.
func FuzzIdentifiers(f *testing.F) {
	f.Add(vecK0.value)
	f.Add(vecScopeID.value)
	f.Add("sha-256:" + vecK1.value)
	f.Add("6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11")
	f.Fuzz(func(t *testing.T, s string) {
		if k, err := kvsp.ParseBlockKey(s); err == nil && k.String() != s {
			t.Fatalf("BlockKey %q -> %s", s, k)
		}
		if k, err := kvsp.ParseScopeID(s); err == nil && k.String() != s {
			t.Fatalf("ScopeID %q -> %s", s, k)
		}
		if d, err := kvsp.ParseDigest(s); err == nil && d.String() != s {
			t.Fatalf("Digest %q -> %s", s, d)
		}
		if u, err := kvsp.ParseUUID(s); err == nil && u.String() != s {
			t.Fatalf("UUID %q -> %s", s, u)
		}
	})
}

// FuzzPositional: the canonical form parses to the same value and is a
// fixed point.
func FuzzPositional(f *testing.F) {
	for _, s := range []string{"rope", "none", "rope;theta=500000", "rope;scaling=yarn,theta=10000", "rope;scaling=linear"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := kvsp.ParsePositional(s)
		if err != nil {
			return
		}
		q, err := kvsp.ParsePositional(p.String())
		if err != nil || q != p || q.String() != p.String() {
			t.Fatalf("%q -> %q -> %v, %v", s, p.String(), q, err)
		}
	})
}

// FuzzBaseURI: normalisation is idempotent and its output validates.
func FuzzBaseURI(f *testing.F) {
	for _, s := range []string{"https://h1.example/kvsp/", "HTTPS://H1.example:443/a/../kvsp/", "https://[::1]:9443/%7e/", "moqt://r.example/n/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := kvsp.NormalizeBaseURI(s)
		if err != nil {
			return
		}
		m, err := kvsp.NormalizeBaseURI(n)
		if err != nil || m != n {
			t.Fatalf("%q -> %q -> %q, %v", s, n, m, err)
		}
		if err := kvsp.ValidateBaseURI("uri", n); err != nil && strings.HasPrefix(n, "https://") {
			t.Fatalf("normalised %q does not validate: %v", n, err)
		}
	})
}

// FuzzProblem: a parsed problem re-encodes and parses to the same sentinel.
func FuzzProblem(f *testing.F) {
	f.Add([]byte(`{"type":"https://iana.org/assignments/kvsp#kvsp-stale-epoch","title":"x","status":409,"epoch":3}`), 409)
	f.Add([]byte(`{"type":"about:blank","status":413,"max_block_keys":1024}`), 413)
	f.Fuzz(func(t *testing.T, body []byte, status int) {
		p, err := kvsp.ParseProblem(body, status)
		if err != nil {
			return
		}
		b, err := kvsp.MarshalProblem(p)
		if err != nil {
			t.Fatalf("problem does not re-encode: %v", err)
		}
		q, err := kvsp.ParseProblem(b, p.Status)
		if err != nil {
			t.Fatalf("re-encoded problem rejected: %v\n%s", err, b)
		}
		if !errors.Is(q, errors.Unwrap(p)) && errors.Unwrap(p) != nil {
			t.Fatalf("sentinel changed: %v vs %v", p, q)
		}
	})
}

// lookupRef is LookupRequest without its hand-written decoder: the
// reference the token decoder must agree with.
type lookupRef struct {
	ScopeID   kvsp.ScopeID    `json:"scope_id"`
	CompatID  kvsp.CompatID   `json:"compat_id"`
	BlockKeys []kvsp.BlockKey `json:"block_keys"`
	Targets   []string        `json:"targets,omitempty"`
}

// FuzzLookupRequestDecode: the IS's token-by-token lookup decoder accepts
// exactly what reflective decoding (with the library's default options,
// which are A-29's) accepts, and decodes it to the same request.
func FuzzLookupRequestDecode(f *testing.F) {
	s, k := strings.Repeat("cd", 16), strings.Repeat("ab", 32)
	for _, seed := range []string{
		`{"scope_id":"` + s + `","compat_id":"` + k + `","block_keys":["` + k + `","` + k + `"],"targets":["https://i.example/"]}`,
		`{"scope_id":"\u0063d` + s[2:] + `","compat_id":"` + k + `","block_keys":[]}`,
		`{"sc\u006fpe_id":"` + s + `","compat_id":"` + k + `","block_keys":["` + k + `"],"x":{"y":[1,null]}}`,
		`{"scope_id":"` + s + `","compat_id":"` + k + `","block_keys":null,"targets":null}`,
		`{"scope_id":"` + s + `","scope_id":"` + s + `"}`, `null`, `[]`, `{"block_keys":[5]}`, `{"targets":"x"}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var got kvsp.LookupRequest
		gotErr := kvsp.Decode(data, &got)
		var ref lookupRef
		refErr := json.Unmarshal(data, &ref)
		if refErr == nil {
			want := kvsp.LookupRequest(ref)
			refErr = want.Validate()
		}
		if (gotErr == nil) != (refErr == nil) {
			t.Fatalf("%q: token decoder %v, reflection %v", data, gotErr, refErr)
		}
		if gotErr != nil {
			if !errors.Is(gotErr, kvsp.ErrInvalid) {
				t.Fatalf("rejection is not ErrInvalid: %v", gotErr)
			}
			return
		}
		if want := kvsp.LookupRequest(ref); !reflect.DeepEqual(got, want) {
			t.Fatalf("%q:\n%+v\n%+v", data, got, want)
		}
	})
}

package kvsp_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
)

// The helpers of TestB3_RecordJSONBadInput (RELIABILITY.md row B3), which
// sits in records_test.go.

// b3Invalid asserts that a rejection is ErrInvalid and goes on the wire as
// a 400 problem (R-ERR-10, A-29).
func b3Invalid(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, kvsp.ErrInvalid) {
		t.Errorf("%s: err = %v, want ErrInvalid", what, err)
		return
	}
	if p := kvsp.ProblemFor(err); p.Status != 400 {
		t.Errorf("%s: problem status %d, want 400", what, p.Status)
	}
}

func b3Decode(c recordCase, text string) (kvsp.Validator, error) {
	v := c.new()
	return v, kvsp.Decode([]byte(text), v)
}

// hexRun matches the hex32/hex16 values of the examples, bare or as a
// sha-256 digest.
var hexRun = regexp.MustCompile(`"(sha-256:)?([0-9a-f]{64}|[0-9a-f]{32})"`)

// b3EveryRecord runs the malformed-input table over every record type.
func b3EveryRecord(t *testing.T) {
	hexChecked := 0
	defer func() {
		if hexChecked < 20 {
			t.Errorf("only %d hex values mutated", hexChecked)
		}
	}()
	for _, c := range recordCases {
		t.Run(c.name, func(t *testing.T) {
			v0, err := b3Decode(c, c.example)
			if err != nil {
				t.Fatalf("example rejected: %v", err)
			}
			var top map[string]json.RawMessage
			if err := json.Unmarshal([]byte(c.example), &top); err != nil {
				t.Fatal(err)
			}

			// Unknown members anywhere at the top level: same value.
			for _, u := range []string{`"x_test":{"a":[1]}`, `"X_TEST":null`, `"scope":"` + strings.Repeat("ee", 16) + `"`, `"__proto__":{"scope_id":"x"}`} {
				for _, text := range []string{
					strings.Replace(c.example, "{", "{"+u+",", 1),
					c.example[:strings.LastIndex(c.example, "}")] + "," + u + "}",
				} {
					v, err := b3Decode(c, text)
					if err != nil || !reflect.DeepEqual(v, v0) {
						t.Errorf("unknown member %s: %v, value changed: %v", u, err, !reflect.DeepEqual(v, v0))
					}
				}
			}

			// Every hex value: wrong case, length, prefix, alphabet.
			locs := hexRun.FindAllStringSubmatchIndex(c.example, -1)
			hexChecked += len(locs)
			for _, l := range locs {
				h0, h1 := l[4], l[5] // the hex run
				hx := c.example[h0:h1]
				for name, repl := range map[string]string{
					"uppercase":    strings.ToUpper(hx[:2]) + hx[2:],
					"all upper":    strings.ToUpper(hx),
					"short":        hx[2:],
					"long":         hx + "ab",
					"odd length":   hx[1:],
					"0x prefix":    "0x" + hx[2:],
					"non-hex":      "g" + hx[1:],
					"space inside": hx[:10] + " " + hx[11:],
				} {
					if repl == hx { // an all-digit prefix does not uppercase
						continue
					}
					_, err := b3Decode(c, c.example[:h0]+repl+c.example[h1:])
					b3Invalid(t, fmt.Sprintf("hex at %d %s", h0, name), err)
				}
			}

			// Duplicate members, plain and spelled with an escape: refused
			// even with the same value.
			for name, val := range top {
				dup := strings.Replace(c.example, "{", `{"`+name+`":`+string(val)+",", 1)
				_, err := b3Decode(c, dup)
				b3Invalid(t, "duplicate "+name, err)
				esc := fmt.Sprintf(`\u%04x`, name[0]) + name[1:]
				_, err = b3Decode(c, strings.Replace(c.example, "{", `{"`+esc+`":`+string(val)+",", 1))
				b3Invalid(t, "duplicate escaped "+esc, err)
			}

			// Durations and deadlines: negative, fractional, out of I-JSON,
			// strings, null.
			for _, m := range []string{"ttl_ms", "deadline_ms", "lease_ms"} {
				if _, ok := top[m]; !ok {
					continue
				}
				bads := []string{"-1", "1.5", "1e3", "9007199254740992", "18446744073709551616", "1e400", `"1000"`, "true", "[]", "{}"}
				if slices.Contains(c.required, m) {
					bads = append(bads, "null", "0") // absent or zero where required
				}
				for _, bad := range bads {
					text := strings.Replace(c.example, `"`+m+`"`, `"`+m+`":`+bad+`,"x_`+m+`"`, 1)
					_, err := b3Decode(c, text)
					b3Invalid(t, m+"="+bad, err)
				}
			}

			// Every truncation of the body.
			for i := range len(c.example) - 1 {
				if _, err := b3Decode(c, c.example[:i]); !errors.Is(err, kvsp.ErrInvalid) {
					t.Fatalf("truncated at %d: err = %v, want ErrInvalid", i, err)
				}
			}
		})
	}
}

// b3Replica: the replica record's own invariants.
func b3Replica(t *testing.T) {
	c := recordCases[0]
	res := `"residency": [ { "tier": "device", "layers": [0, 15] }, { "tier": "host", "layers": [16, 31], "read_mbit_per_s": 400000 } ]`
	if !strings.Contains(c.example, res) {
		t.Fatal("replica example changed")
	}
	for name, r := range map[string]string{
		"overlapping ranges":     `"residency": [ { "tier": "device", "layers": [0, 16] }, { "tier": "host", "layers": [16, 31] } ]`,
		"same range twice":       `"residency": [ { "tier": "device", "layers": [0, 31] }, { "tier": "host", "layers": [0, 31] } ]`,
		"overlap out of order":   `"residency": [ { "tier": "host", "layers": [10, 31] }, { "tier": "device", "layers": [0, 10] } ]`,
		"first after last":       `"residency": [ { "tier": "device", "layers": [15, 0] } ]`,
		"layer past the layers":  `"residency": [ { "tier": "device", "layers": [0, 32] } ]`,
		"layer 2^32":             `"residency": [ { "tier": "device", "layers": [0, 4294967296] } ]`,
		"negative layer":         `"residency": [ { "tier": "device", "layers": [-1, 3] } ]`,
		"three-element range":    `"residency": [ { "tier": "device", "layers": [0, 1, 2] } ]`,
		"unregistered tier":      `"residency": [ { "tier": "tape", "layers": [0, 31] } ]`,
		"tier case variant":      `"residency": [ { "tier": "Device", "layers": [0, 31] } ]`,
		"empty residency":        `"residency": []`,
		"duplicate nested layer": `"residency": [ { "tier": "device", "layers": [0, 15], "layers": [0, 31] } ]`,
		"huge read rate":         `"residency": [ { "tier": "device", "layers": [0, 31], "read_mbit_per_s": 9007199254740992 } ]`,
	} {
		_, err := b3Decode(c, strings.Replace(c.example, res, r, 1))
		b3Invalid(t, name, err)
	}
	for name, repl := range map[string][2]string{
		"size 0":           {`"size": 2097152`, `"size": 0`},
		"size 2^53":        {`"size": 2097152`, `"size": 9007199254740992`},
		"codec 0":          {`"codec": 1`, `"codec": 0`},
		"codec 2^16":       {`"codec": 1`, `"codec": 65536`},
		"ttl 0":            {`"ttl_ms": 600000`, `"ttl_ms": 0`},
		"holder http":      {`"https://h1.example/kvsp/"`, `"http://h1.example/kvsp/"`},
		"holder unnormal":  {`"https://h1.example/kvsp/"`, `"https://H1.example:443/kvsp/"`},
		"holder no slash":  {`"https://h1.example/kvsp/"`, `"https://h1.example/kvsp"`},
		"holder query":     {`"https://h1.example/kvsp/"`, `"https://h1.example/kvsp/?a=1"`},
		"digest sha-512":   {`"digest": "sha-256:`, `"digest": "sha-512:`},
		"digest bare hex":  {`"digest": "sha-256:`, `"digest": "`},
		"no layer digests": {`"layer_digests": [`, `"layer_digests": [], "x": [`},
	} {
		text := strings.Replace(c.example, repl[0], repl[1], 1)
		if text == c.example {
			t.Fatalf("%s: %q not in the example", name, repl[0])
		}
		_, err := b3Decode(c, text)
		b3Invalid(t, name, err)
	}
}

// b3AuthorizationMembers: the members that authorization reads (scope_id
// everywhere, holder in a replica, instance in a status) cannot be changed
// by a second spelling. An exact or escaped duplicate is refused; a case
// variant or look-alike (U+017F LATIN SMALL LETTER LONG S folds to "s" under
// Unicode case folding, as encoding/json v1 would match it; U+212A KELVIN
// SIGN to "k") is an unknown member, before or after the real one, and the
// decoded value keeps the real one.
func b3AuthorizationMembers(t *testing.T) {
	other := map[string]string{
		"scope_id": `"` + strings.Repeat("ee", 16) + `"`,
		"holder":   `"https://evil.example/kvsp/"`,
		"instance": `"https://evil.example/kvsp/"`,
	}
	variants := func(m string) []string {
		up := strings.ToUpper(m[:1]) + m[1:]
		out := []string{up, strings.ToUpper(m), m + " ", " " + m, m + `\u0000`, m + "\u200b"}
		if strings.Contains(m, "_") {
			out = append(out, strings.Replace(m, "_", "-", 1))
		}
		if strings.Contains(m, "s") {
			out = append(out, strings.Replace(m, "s", "\u017f", 1))
		}
		if strings.Contains(m, "k") {
			out = append(out, strings.Replace(m, "k", "\u212a", 1))
		}
		return out
	}
	get := func(v kvsp.Validator, m string) string {
		f := reflect.ValueOf(v).Elem()
		for i := range f.NumField() {
			tag, _, _ := strings.Cut(f.Type().Field(i).Tag.Get("json"), ",")
			if tag == m {
				return fmt.Sprint(f.Field(i).Interface())
			}
		}
		return ""
	}
	checked := 0
	for _, c := range recordCases {
		var top map[string]json.RawMessage
		if err := json.Unmarshal([]byte(c.example), &top); err != nil {
			t.Fatal(err)
		}
		v0, err := b3Decode(c, c.example)
		if err != nil {
			t.Fatal(err)
		}
		for m, val := range other {
			if _, ok := top[m]; !ok {
				continue
			}
			want := get(v0, m)
			if want == "" {
				t.Fatalf("%s: no field for %s", c.name, m)
			}
			checked++
			for _, name := range variants(m) {
				for _, text := range []string{
					strings.Replace(c.example, "{", `{"`+name+`":`+val+",", 1),
					c.example[:strings.LastIndex(c.example, "}")] + `,"` + name + `":` + val + "}",
				} {
					v, err := b3Decode(c, text)
					if err != nil {
						t.Errorf("%s: %q variant: %v (an unknown member must be ignored)", c.name, name, err)
						continue
					}
					if got := get(v, m); got != want {
						t.Errorf("%s: %q changed %s from %s to %s", c.name, name, m, want, got)
					}
				}
			}
			for _, text := range []string{
				strings.Replace(c.example, "{", `{"`+m+`":`+val+",", 1),
				c.example[:strings.LastIndex(c.example, "}")] + `,"` + m + `":` + val + "}",
				c.example[:strings.LastIndex(c.example, "}")] + `,"` + fmt.Sprintf(`\u%04x`, m[0]) + m[1:] + `":` + val + "}",
			} {
				_, err := b3Decode(c, text)
				b3Invalid(t, c.name+": second "+m, err)
			}
		}
	}
	if checked < 8 {
		t.Fatalf("only %d authorization members checked", checked)
	}
}

// b3HugeArrays: 10^6-element arrays are decoded without a panic, and
// refused where an element or an invariant is wrong; one in an unknown
// member is ignored.
func b3HugeArrays(t *testing.T) {
	const n = 1_000_000
	many := func(elem string) string { return "[" + strings.TrimSuffix(strings.Repeat(elem+",", n), ",") + "]" }
	lookup, checkpoint, replica := recordCases[4], recordCases[2], recordCases[0]
	for _, x := range []struct {
		name string
		c    recordCase
		old  string
		repl string
	}{
		{"lookup block_keys of bad hex", lookup, `"block_keys": [`, `"block_keys": ` + many(`"00"`) + `, "x": [`},
		{"checkpoint generated, offset wrong", checkpoint, `"generated": [1296, 315, 279]`, `"generated": ` + many("1")},
		{"replica residency of nulls", replica, `"residency": [`, `"residency": ` + many("null") + `, "x": [`},
	} {
		text := strings.Replace(x.c.example, x.old, x.repl, 1)
		if text == x.c.example {
			t.Fatalf("%s: %q not in the example", x.name, x.old)
		}
		_, err := b3Decode(x.c, text)
		b3Invalid(t, x.name, err)
	}
	// Accepted, unchanged, with a 10^6-element unknown member.
	v0, _ := b3Decode(lookup, lookup.example)
	v, err := b3Decode(lookup, strings.Replace(lookup.example, "{", `{"x_big":`+many("0")+",", 1))
	if err != nil || !reflect.DeepEqual(v, v0) {
		t.Errorf("10^6-element unknown member: %v", err)
	}
}

package kvsp

import (
	"strings"
	"testing"
)

// TestRDMARecords: the extension records decode and validate.
func TestRDMARecords(t *testing.T) {
	ok := `{"scope_id":"` + strings.Repeat("ab", 16) + `","compat_id":"` + strings.Repeat("cd", 32) + `","block_key":"` + strings.Repeat("ef", 32) + `","layers":[2,5],"endpoint":"v1.0001.000002.000003.` + strings.Repeat("00", 16) + `"}`
	var q RDMAReadRequest
	if err := Decode([]byte(ok), &q); err != nil || q.Layers[1] != 5 {
		t.Fatalf("%v %+v", err, q)
	}
	for name, bad := range map[string]string{
		"no endpoint":    strings.Replace(ok, `"endpoint"`, `"x_endpoint"`, 1),
		"layers swapped": strings.Replace(ok, `[2,5]`, `[5,2]`, 1),
	} {
		var q RDMAReadRequest
		if err := Decode([]byte(bad), &q); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	r := RDMAReadResponse{ID: "1", Endpoint: "e", Addr: "7f00dead0000", RKey: 9, Length: 10, Header: "00", ReprDigest: "sha-256=:x:", TTLMs: 10}
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	r.More = []RDMASegment{{Addr: "7f00beef0000", RKey: 3, Length: 4}}
	if err := r.Validate(); err != nil {
		t.Fatalf("two segments: %v", err)
	}
	for name, mut := range map[string]func(*RDMAReadResponse){
		"addr not hex":          func(r *RDMAReadResponse) { r.Addr = "0x7f" },
		"segment addr not hex":  func(r *RDMAReadResponse) { r.More[0].Addr = "zz" },
		"empty segment":         func(r *RDMAReadResponse) { r.More[0].Length = 0 },
		"too many segments":     func(r *RDMAReadResponse) { r.More = append(r.More, r.More[0], r.More[0], r.More[0]) },
		"segment past 2^53 - 1": func(r *RDMAReadResponse) { r.More[0].Length = 1 << 53 },
	} {
		bad := r
		bad.More = append([]RDMASegment(nil), r.More...)
		mut(&bad)
		if err := bad.Validate(); err == nil {
			t.Errorf("%s: validated", name)
		}
	}
}

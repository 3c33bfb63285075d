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
	r.Addr = "0x7f"
	if err := r.Validate(); err == nil {
		t.Fatal("a non-hex addr validated")
	}
}

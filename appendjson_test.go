package kvsp_test

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
)

// TestAppendJSONMatchesMarshal: the hand-written encoders produce exactly
// the bytes of the reflective encoder, for the spec's example and for
// records with awkward strings.
func TestAppendJSONMatchesMarshal(t *testing.T) {
	var rec kvsp.ReplicaRecord
	if err := kvsp.Decode([]byte(replicaExample), &rec); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	cases := []kvsp.ReplicaRecord{rec}
	for i := 0; i < 200; i++ {
		r := rec
		r.Holder = "https://h\"\\\x01\u2028é" + strings.Repeat("x", rng.IntN(5)) + "/"
		r.TTLMs = rng.Uint64N(1 << 53)
		if i%3 == 0 {
			r.LayerDigests = nil
		}
		if i%4 == 0 {
			r.MOQTNamespace = "AWEBYgFjAWQBZQ"
		}
		if i%5 == 0 {
			r.Residency = nil
		}
		cases = append(cases, r)
	}
	for _, r := range cases {
		want, err := kvsp.Marshal(&r)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.AppendJSON(nil); string(got) != string(want) {
			t.Fatalf("AppendJSON:\n got %s\nwant %s", got, want)
		}
	}
	resp := kvsp.LookupResponse{Matched: 2, Replicas: [][]kvsp.ReplicaRecord{{cases[0], cases[1]}, {cases[2]}},
		Targets: []kvsp.TargetEstimate{{Instance: "https://ii7.example/kvsp/", FetchUs: 96, RecomputeUs: 381}}}
	want, _ := kvsp.Marshal(&resp)
	if got := resp.AppendJSON(nil); string(got) != string(want) {
		t.Fatalf("LookupResponse.AppendJSON:\n got %s\nwant %s", got, want)
	}
	empty := kvsp.LookupResponse{Replicas: [][]kvsp.ReplicaRecord{}}
	want, _ = kvsp.Marshal(&empty)
	if got := empty.AppendJSON(nil); string(got) != string(want) {
		t.Fatalf("empty: %s vs %s", got, want)
	}
}

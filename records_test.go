package kvsp_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
)

var (
	hx32 = strings.Repeat("ab", 32)
	hx16 = strings.Repeat("cd", 16)
)

// The spec's example records, with its placeholders filled in.
var (
	replicaExample = `{ "block_key": "` + hx32 + `", "compat_id": "` + vecCompatID.value + `", "scope_id": "` + vecScopeID.value + `",
  "holder": "https://h1.example/kvsp/", "codec": 1, "size": 2097152, "digest": "sha-256:` + hx32 + `",
  "layer_digests": [` + strings.TrimSuffix(strings.Repeat(`"`+hx32+`",`, 32), ",") + `],
  "residency": [ { "tier": "device", "layers": [0, 15] }, { "tier": "host", "layers": [16, 31], "read_mbit_per_s": 400000 } ],
  "ttl_ms": 600000 }`
	statusExample = `{ "instance": "https://ii7.example/kvsp/", "epoch": 12, "state": "active", "running": 18, "queued": 3,
  "batch_size": 32, "kv_utilization": 0.71, "prefill_tokens_per_s": 42000, "decode_tokens_per_s": 3100,
  "links": [ { "holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12 } ],
  "requested_state": null, "ttl_ms": 3000 }`
	checkpointExample = `{ "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11", "epoch": 1, "compat_id": "` + vecCompatID.value + `",
  "scope_id": "` + vecScopeID.value + `", "prompt_blocks": ["` + vecK0.value + `", "` + vecK1.value + `"], "prompt_tail": [374, 264],
  "generated": [1296, 315, 279], "output_offset": 3,
  "sampler": { "method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": 3, "deterministic": false } }`
	shardMapExample = `{ "map": "c3f8e1", "version": 4, "shards": [ { "tokens": [0, 32768], "instance": "https://ii1.example/kvsp/" },
  { "tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/" }, { "tokens": [65536, 98304], "instance": "https://ii3.example/kvsp/" } ] }`
	lookupExample = `{ "scope_id": "` + hx16 + `", "compat_id": "` + hx32 + `", "block_keys": ["` + vecK0.value + `", "` + vecK1.value + `"],
  "targets": ["https://ii7.example/kvsp/", "https://ii9.example/kvsp/"] }`
	prefetchExample = `{ "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10", "request_ref": "opaque-value-from-PC", "scope_id": "` + hx16 + `",
  "compat_id": "` + hx32 + `", "blocks": [ { "block_key": "` + hx32 + `", "sources": ["https://h1.example/kvsp/"] } ],
  "layer_order": "ascending", "deadline_ms": 50, "lease_ms": 2000 }`
	planExample = `{ "map": "c3f8e1", "from": 4, "to": 5, "deadline_ms": 200, "retain": [[0, 32768]],
  "fetch": [{ "tokens": [32768, 49152], "from": "https://ii2.example/kvsp/" }], "release": [] }`
	leaseExample = `{"scope_id":"` + hx16 + `","compat_id":"` + hx32 + `","block_keys":["` + hx32 + `"],"ttl_ms":2000}`
)

type recordCase struct {
	name    string
	new     func() kvsp.Validator
	example string
	// required lists members whose absence must be rejected.
	required []string
}

var recordCases = []recordCase{
	{"replica", func() kvsp.Validator { return new(kvsp.ReplicaRecord) }, replicaExample,
		[]string{"block_key", "compat_id", "scope_id", "holder", "codec", "size", "digest", "residency", "ttl_ms"}},
	{"status", func() kvsp.Validator { return new(kvsp.InstanceStatus) }, statusExample,
		[]string{"instance", "epoch", "state", "running", "queued", "batch_size", "kv_utilization", "prefill_tokens_per_s", "decode_tokens_per_s", "links", "ttl_ms"}},
	{"checkpoint", func() kvsp.Validator { return new(kvsp.Checkpoint) }, checkpointExample,
		[]string{"session", "epoch", "compat_id", "scope_id", "prompt_blocks", "prompt_tail", "generated", "output_offset", "sampler", "method", "params", "seed", "step", "deterministic"}},
	{"shard map", func() kvsp.Validator { return new(kvsp.ShardMap) }, shardMapExample,
		[]string{"map", "version", "shards", "tokens", "instance"}},
	{"lookup", func() kvsp.Validator { return new(kvsp.LookupRequest) }, lookupExample,
		[]string{"scope_id", "compat_id", "block_keys"}},
	{"prefetch", func() kvsp.Validator { return new(kvsp.PrefetchDirective) }, prefetchExample,
		[]string{"directive", "scope_id", "compat_id", "blocks", "block_key", "sources", "deadline_ms", "lease_ms"}},
	{"reshard plan", func() kvsp.Validator { return new(kvsp.Reshard) }, planExample,
		[]string{"map", "from", "to", "deadline_ms"}},
	{"lease", func() kvsp.Validator { return new(kvsp.LeaseRequest) }, leaseExample,
		[]string{"scope_id", "compat_id", "block_keys", "ttl_ms"}},
	{"map update", func() kvsp.Validator { return new(kvsp.MapUpdate) }, `{"map":` + shardMapExample + `,"scope_id":"` + hx16 + `","compat_id":"` + hx32 + `","tokens":[1,2,3],"deadline_ms":200}`,
		[]string{"map", "scope_id", "compat_id"}},
	{"producer statement", func() kvsp.Validator { return new(kvsp.ProducerRecord) },
		`{"block_key":"` + hx32 + `","compat_id":"` + hx32 + `","scope_id":"` + hx16 + `","producer":"https://ii7.example/kvsp/","digest":"sha-256:` + hx32 + `","ttl_ms":600000}`,
		[]string{"block_key", "compat_id", "scope_id", "producer", "digest", "ttl_ms"}},
	{"rdma read", func() kvsp.Validator { return new(kvsp.RDMAReadRequest) },
		`{"scope_id":"` + hx16 + `","compat_id":"` + hx32 + `","block_key":"` + hx32 + `","layers":[0,3],"endpoint":"v1.0001.000abc.000def.fe800000000000000000000000000001","ttl_ms":5000}`,
		[]string{"scope_id", "compat_id", "block_key", "endpoint"}},
	{"rdma read answer", func() kvsp.Validator { return new(kvsp.RDMAReadResponse) },
		`{"id":"r1","endpoint":"v1.0002.000123.000456.fe800000000000000000000000000002","addr":"7f00dead0000","rkey":77,"length":4096,` +
			`"more":[{"addr":"7f00beef0000","rkey":78,"length":2048}],"header":"4b564231","repr_digest":"sha-256=:AAAA:","ttl_ms":10000}`,
		[]string{"id", "endpoint", "addr", "length", "header", "repr_digest"}},
}

// dropMember removes the first member called name (any value) from a JSON
// text, by a small scanner that tracks nesting and strings.
func dropMember(text, name string) string {
	i := strings.Index(text, `"`+name+`"`)
	if i < 0 {
		return text
	}
	j := strings.Index(text[i:], ":") + i + 1
	depth, inStr := 0, false
	end := j
	for ; end < len(text); end++ {
		c := text[end]
		if inStr {
			if c == '\\' {
				end++
			} else if c == '"' {
				inStr = false
			}
			continue
		}
		switch c {
		case '"':
			inStr = true
		case '[', '{':
			depth++
		case ']', '}':
			if depth == 0 {
				// last member: remove the preceding comma
				k := strings.LastIndex(text[:i], ",")
				return text[:k] + text[end:]
			}
			depth--
		case ',':
			if depth == 0 {
				return text[:i] + text[end+1:]
			}
		}
	}
	return text
}

// TestRecordExamples: the spec's examples decode, and re-encode to a form
// that decodes to the same value (R-REC-5, R-REC-14, R-REC-16, R-RSH-1,
// R-IS-12, R-PF-1, R-RSH-4, A-2).
func TestRecordExamples(t *testing.T) {
	for _, c := range recordCases {
		t.Run(c.name, func(t *testing.T) {
			v := c.new()
			if err := kvsp.Decode([]byte(c.example), v); err != nil {
				t.Fatalf("example rejected: %v", err)
			}
			b, err := kvsp.Marshal(v)
			if err != nil {
				t.Fatal(err)
			}
			w := c.new()
			if err := kvsp.Decode(b, w); err != nil {
				t.Fatalf("re-encoded example rejected: %v\n%s", err, b)
			}
			if !reflect.DeepEqual(v, w) {
				t.Fatalf("round trip changed the record:\n%+v\n%+v", v, w)
			}
		})
	}
}

// TestRecordRequiredMembers drops each required member in turn: 400
// (R-REC-5, R-REC-16, R-IS-12, R-PF-1, R-RSH-4).
func TestRecordRequiredMembers(t *testing.T) {
	for _, c := range recordCases {
		for _, m := range c.required {
			text := dropMember(c.example, m)
			if text == c.example {
				t.Fatalf("%s: member %s not found", c.name, m)
			}
			if err := kvsp.Decode([]byte(text), c.new()); !errors.Is(err, kvsp.ErrInvalid) {
				t.Errorf("%s without %s: err = %v, want ErrInvalid\n%s", c.name, m, err, text)
			}
			// null is not a value for a required member either.
			nulled := strings.Replace(c.example, `"`+m+`"`, `"`+m+`":null,"x_`+m+`"`, 1)
			if err := kvsp.Decode([]byte(nulled), c.new()); !errors.Is(err, kvsp.ErrInvalid) {
				t.Errorf("%s with %s null: err = %v, want ErrInvalid", c.name, m, err)
			}
		}
	}
}

// TestB3_RecordJSONBadInput is row B3 of RELIABILITY.md (the table part;
// FuzzRecords is its fuzz part). Unknown members are ignored (R-REC-1),
// names are case-sensitive (R-REC-2), hex is exact (R-REC-3), durations are
// integers (R-REC-4), duplicates and invalid UTF-8 are refused,
// integers stay within I-JSON. Then, over every record type
// (replica, lookup, prefetch, checkpoint, reshard plan, lease, status):
// every malformed input is ErrInvalid, which the wire maps to 400; unknown
// members leave the decoded value unchanged; a duplicate of a member is
// refused, and case-variant or look-alike spellings of scope_id and holder
// are ignored, so they never change the scope or holder that authorization
// uses; 10^6-element arrays neither panic nor get past validation where
// they break an invariant.
func TestB3_RecordJSONBadInput(t *testing.T) {
	lease := func(s string) error { return kvsp.Decode([]byte(s), new(kvsp.LeaseRequest)) }
	withTTL := func(v string) string { return strings.Replace(leaseExample, `"ttl_ms":2000`, `"ttl_ms":`+v, 1) }
	for _, c := range []struct {
		name string
		text string
		ok   bool
	}{
		{"R-REC-1 unknown member", strings.Replace(leaseExample, `{`, `{"x_test":{"a":[1]},`, 1), true},
		{"R-REC-2 Scope_ID is unknown, scope_id missing", strings.Replace(leaseExample, `"scope_id"`, `"Scope_ID"`, 1), false},
		{"R-REC-2 both spellings", strings.Replace(leaseExample, `{`, `{"SCOPE_ID":"zz",`, 1), true},
		{"R-REC-3 uppercase hex", strings.Replace(leaseExample, hx16, strings.ToUpper(hx16), 1), false},
		{"R-REC-3 0x prefix", strings.Replace(leaseExample, `"`+hx16, `"0x`+hx16[2:], 1), false},
		{"R-REC-3 short", strings.Replace(leaseExample, hx16, hx16[2:], 1), false},
		{"R-REC-4 ttl 1.5", withTTL("1.5"), false},
		{"R-REC-4 ttl string", withTTL(`"600000"`), false},
		{"R-REC-4 ttl negative", withTTL("-1"), false},
		{"R-REC-4 ttl 2000.0", withTTL("2000.0"), false},
		{"R-REC-4 ttl 2e3", withTTL("2e3"), false},
		{"A-33 ttl 2^53-1", withTTL("9007199254740991"), true},
		{"A-33 ttl 2^53", withTTL("9007199254740992"), false},
		{"A-33 ttl 2^64", withTTL("18446744073709551616"), false},
		{"A-29 duplicate member", strings.Replace(leaseExample, `{`, `{"ttl_ms":1,`, 1), false},
		{"A-29 invalid UTF-8", strings.Replace(leaseExample, `{`, "{\"x\":\"\xff\",", 1), false},
		{"UTF-16 body (R-REG-12)", "\xff\xfe{\x00}\x00", false},
		{"empty body", "", false},
		{"array body", "[]", false},
	} {
		err := lease(c.text)
		if c.ok && err != nil {
			t.Errorf("%s: rejected: %v", c.name, err)
		}
		if !c.ok && !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", c.name, err)
		}
	}
	t.Run("B3 every record type", b3EveryRecord)
	t.Run("B3 replica invariants", b3Replica)
	t.Run("B3 authorization members", b3AuthorizationMembers)
	t.Run("B3 10^6-element arrays", b3HugeArrays)
}

// TestRecordErrorsCarryNoValues: a decoding error names the member, never
// the value (no tokens or KV bytes in errors).
func TestRecordErrorsCarryNoValues(t *testing.T) {
	bad := strings.Replace(checkpointExample, `"prompt_tail": [374, 264]`, `"prompt_tail": [374, 4294967296]`, 1)
	err := kvsp.Decode([]byte(bad), new(kvsp.Checkpoint))
	if !errors.Is(err, kvsp.ErrInvalid) {
		t.Fatalf("token 2^32 accepted: %v (A-33)", err)
	}
	if strings.Contains(err.Error(), "4294967296") || strings.Contains(err.Error(), "374") {
		t.Errorf("error echoes token values: %v", err)
	}
	if !strings.Contains(err.Error(), "prompt_tail") {
		t.Errorf("error does not name the member: %v", err)
	}
}

func TestReplicaValidation(t *testing.T) {
	rep := func(old, repl string) error {
		return kvsp.Decode([]byte(strings.Replace(replicaExample, old, repl, 1)), new0())
	}
	for _, c := range []struct {
		name, old, new string
		ok             bool
	}{
		{"R-REC-9 overlapping ranges", `[16, 31]`, `[15, 31]`, false},
		{"R-REC-9 reversed range", `[16, 31]`, `[31, 16]`, false},
		{"R-REC-9 three-element range", `[16, 31]`, `[16, 31, 32]`, false},
		{"R-REG-9 unknown tier", `"host"`, `"ssd"`, false},
		{"R-REG-9 storage tier", `"host"`, `"local-storage"`, true},
		{"R-REC-6 bare digest", `"sha-256:` + hx32 + `"`, `"` + hx32 + `"`, false},
		{"R-REG-4 codec 0", `"codec": 1`, `"codec": 0`, false},
		{"R-REG-6 codec 65536", `"codec": 1`, `"codec": 65536`, false},
		{"R-REG-5 private codec", `"codec": 1`, `"codec": 65280`, true},
		{"A-6 holder not normalised", `https://h1.example/kvsp/`, `https://H1.example:443/kvsp/`, false},
		{"A-6 holder without slash", `https://h1.example/kvsp/`, `https://h1.example/kvsp`, false},
		{"holder http", `https://h1.example/kvsp/`, `http://h1.example/kvsp/`, false},
		{"A-8 too few layer digests", `"layer_digests": [`, `"layer_digests": ["` + hx32 + `"], "x": [`, false},
		{"R-REC-10 without read rate", `, "read_mbit_per_s": 400000`, ``, true},
		{"R-REC-12 moqt record", `"holder": "https://h1.example/kvsp/"`, `"holder": "moqt://relay.example/kvsp/", "moqt_namespace": "AWEBYgFjAWQBZQ"`, true},
		{"R-REC-12 moqt four fields", `"holder": "https://h1.example/kvsp/"`, `"holder": "moqt://relay.example/kvsp/", "moqt_namespace": "AWEBYgFjAWQ"`, false},
		{"R-REC-12 moqt trailing octets", `"holder": "https://h1.example/kvsp/"`, `"holder": "moqt://relay.example/kvsp/", "moqt_namespace": "AWEBYgFjAWQBZQE"`, false},
		{"R-REC-12 moqt padded", `"holder": "https://h1.example/kvsp/"`, `"holder": "moqt://relay.example/kvsp/", "moqt_namespace": "AWEBYgFjAWQBZQ=="`, false},
		{"R-REC-12 moqt with https holder", `"holder": "https://h1.example/kvsp/"`, `"holder": "https://h1.example/kvsp/", "moqt_namespace": "AWEBYgFjAWQBZQ"`, false},
	} {
		err := rep(c.old, c.new)
		if c.ok != (err == nil) {
			t.Errorf("%s: err = %v, want ok=%v", c.name, err, c.ok)
		}
	}
	var r kvsp.ReplicaRecord
	if err := kvsp.Decode([]byte(replicaExample), &r); err != nil || r.HeldLayers() != 32 {
		t.Fatalf("held layers %d, %v", r.HeldLayers(), err)
	}
}

func new0() *kvsp.ReplicaRecord { return new(kvsp.ReplicaRecord) }

func TestStatusValidation(t *testing.T) {
	st := func(old, repl string) error {
		return kvsp.Decode([]byte(strings.Replace(statusExample, old, repl, 1)), new(kvsp.InstanceStatus))
	}
	for _, c := range []struct {
		name, old, new string
		ok             bool
	}{
		{"R-ST-7 unknown state", `"active"`, `"busy"`, false},
		{"R-REC-15 requested sleeping", `"requested_state": null`, `"requested_state": "sleeping"`, true},
		{"A-19 requested draining", `"requested_state": null`, `"requested_state": "draining"`, false},
		{"R-REC-15 requested absent", `"requested_state": null, `, ``, true},
		{"R-REC-14 utilization above 1", `0.71`, `1.5`, false},
		{"R-REC-14 negative count", `"queued": 3`, `"queued": -3`, false},
		{"R-REC-14 zero counts", `"running": 18`, `"running": 0`, true},
		{"R-REC-14 links empty", `"links": [ { "holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12 } ]`, `"links": []`, true},
		{"R-ST-17 link holder not normalised", `"holder": "https://h1.example/kvsp/"`, `"holder": "https://h1.example:443/kvsp/"`, false},
		{"epoch as ms since 1970", `"epoch": 12`, `"epoch": 1764547200000`, true},
		{"epoch zero", `"epoch": 12`, `"epoch": 0`, false},
	} {
		err := st(c.old, c.new)
		if c.ok != (err == nil) {
			t.Errorf("%s: err = %v, want ok=%v", c.name, err, c.ok)
		}
	}
}

func TestCheckpointValidation(t *testing.T) {
	cp := func(old, repl string) (*kvsp.Checkpoint, error) {
		c := &kvsp.Checkpoint{}
		return c, kvsp.Decode([]byte(strings.Replace(checkpointExample, old, repl, 1)), c)
	}
	c, err := cp("", "")
	if err != nil || c.Sampler.Params["p"] != 0.9 || c.OutputOffset != 3 || c.Session.String() != "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11" {
		t.Fatalf("example: %+v %v", c, err)
	}
	if err := c.ValidateFor(4); err != nil {
		t.Errorf("prompt tail of 2 with B=4: %v", err)
	}
	if err := c.ValidateFor(2); err == nil {
		t.Error("R-REC-19: prompt tail of 2 with B=2 accepted")
	}
	for _, x := range []struct{ name, old, new string }{
		{"R-REC-18 offset != len(generated)", `"output_offset": 3`, `"output_offset": 4`},
		{"R-REC-17 session not a UUID", `6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11`, `not-a-uuid`},
		{"R-REC-17 uppercase UUID", `6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11`, `6F1D0A9E-2C55-4D7E-9A0E-5B7F2F9F6A11`},
		{"R-REC-21 params not an object", `{"p": 0.9}`, `[0.9]`},
		{"epoch zero (A-25: sessions start at 1)", `"epoch": 1`, `"epoch": 0`},
	} {
		if _, err := cp(x.old, x.new); !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("%s: err = %v", x.name, err)
		}
	}
	// a resume whose epoch is not above the checkpoint's is stale.
	var r kvsp.ResumeRequest
	err = kvsp.Decode([]byte(`{"epoch":1,"checkpoint":`+checkpointExample+`}`), &r)
	if !errors.Is(err, kvsp.ErrStaleEpoch) {
		t.Errorf("resume with epoch 1: %v, want ErrStaleEpoch", err)
	}
	if err := kvsp.Decode([]byte(`{"epoch":2,"checkpoint":`+checkpointExample+`}`), &r); err != nil {
		t.Errorf("resume with epoch 2: %v", err)
	}
}

func TestShardMapAndReshard(t *testing.T) {
	sm := func(old, repl string) error {
		return kvsp.Decode([]byte(strings.Replace(shardMapExample, old, repl, 1)), new(kvsp.ShardMap))
	}
	if err := sm(`[32768, 65536]`, `[32769, 65536]`); err == nil {
		t.Error("R-RSH-2: gap accepted")
	}
	if err := sm(`[32768, 65536]`, `[32000, 65536]`); err == nil {
		t.Error("R-RSH-2: overlap accepted")
	}
	if err := sm(`[0, 32768]`, `[0, 0]`); err == nil {
		t.Error("R-RSH-2: empty range accepted")
	}
	if err := sm(`"version": 4`, `"version": 0`); err != nil {
		t.Errorf("version 0: %v", err)
	}

	var plan kvsp.Reshard
	if err := kvsp.Decode([]byte(planExample), &plan); err != nil || plan.Kind != kvsp.ReshardPlan || plan.From != 4 || plan.To != 5 {
		t.Fatalf("plan: %+v %v", plan, err)
	}
	if err := plan.ValidateFor(16384); err != nil {
		t.Errorf("aligned plan: %v", err)
	}
	if err := plan.ValidateFor(5000); err == nil {
		t.Error("A-26: unaligned plan accepted")
	}
	if err := plan.ValidateFor(0); err == nil {
		t.Error("block_tokens 0 accepted")
	}
	rs := func(s string) (kvsp.Reshard, error) {
		var r kvsp.Reshard
		return r, kvsp.Decode([]byte(s), &r)
	}
	if r, err := rs(`{"map":"c3f8e1","commit":5}`); err != nil || r.Kind != kvsp.ReshardCommit || r.Commit != 5 {
		t.Errorf("commit: %+v %v", r, err)
	}
	if r, err := rs(`{"map":"c3f8e1","abort":5}`); err != nil || r.Kind != kvsp.ReshardAbort {
		t.Errorf("abort: %+v %v", r, err)
	}
	for _, bad := range []string{
		`{"map":"c3f8e1","commit":5,"abort":5}`,
		`{"map":"c3f8e1"}`,
		`{"map":"c3f8e1","from":4,"deadline_ms":200}`,
		`{"commit":5}`,
		strings.Replace(planExample, `"fetch": [{ "tokens": [32768, 49152]`, `"fetch": [{ "tokens": [0, 16384]`, 1), // R-RSH-6
		strings.Replace(planExample, `"deadline_ms": 200`, `"deadline_ms": 0`, 1),
	} {
		if _, err := rs(bad); !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("accepted %s: %v", bad, err)
		}
	}
	// Each kind marshals only its own members.
	for _, s := range []string{`{"map":"m","commit":5}`, `{"map":"m","abort":6}`} {
		r, _ := rs(s)
		b, err := kvsp.Marshal(&r)
		if err != nil || string(b) != s {
			t.Errorf("marshal %s = %s, %v", s, b, err)
		}
	}
}

func TestLookupResponse(t *testing.T) {
	ok := `{"matched":1,"replicas":[[` + replicaExample + `]],"targets":[{"instance":"https://ii7.example/kvsp/","fetch_us":96,"recompute_us":191}]}`
	var r kvsp.LookupResponse
	if err := kvsp.Decode([]byte(ok), &r); err != nil || r.Matched != 1 || r.Targets[0].FetchUs != 96 {
		t.Fatalf("lookup response: %v", err)
	}
	for _, bad := range []string{
		`{"matched":1,"replicas":[[` + replicaExample + `]],"targets":[{"instance":"https://ii7.example/kvsp/","recompute_us":191}]}`,
		`{"matched":2,"replicas":[[` + replicaExample + `]]}`,
		`{"matched":1,"replicas":[[]]}`,
		`{"replicas":[]}`,
	} {
		if err := kvsp.Decode([]byte(bad), new(kvsp.LookupResponse)); !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("accepted %.60s: %v", bad, err)
		}
	}
	if err := kvsp.Decode([]byte(`{"matched":0,"replicas":[]}`), new(kvsp.LookupResponse)); err != nil {
		t.Errorf("A-3 miss: %v", err)
	}
}

func TestSmallRecords(t *testing.T) {
	for _, c := range []struct {
		v    kvsp.Validator
		text string
		ok   bool
	}{
		{new(kvsp.StateBody), `{"state":"draining"}`, true},
		{new(kvsp.StateBody), `{"state":"busy"}`, false},
		{new(kvsp.LeaseRenewal), `{"ttl_ms":2000}`, true},
		{new(kvsp.LeaseRenewal), `{}`, false},
		{new(kvsp.LeaseResponse), `{"lease":"3b2f-a","ttl_ms":2000,"block_keys":["` + hx32 + `"]}`, true},
		{new(kvsp.LeaseResponse), `{"lease":"a/b","ttl_ms":2000,"block_keys":["` + hx32 + `"]}`, false},
		{new(kvsp.LeaseResponse), `{"lease":"..","ttl_ms":2000,"block_keys":["` + hx32 + `"]}`, false},
		{new(kvsp.PrefetchStatus), `{"directive":"a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10","state":"partial","loaded":["` + hx32 + `"],"failed":[]}`, true},
		{new(kvsp.PrefetchStatus), `{"directive":"a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10","state":"done","loaded":[],"failed":[]}`, false},
		{new(kvsp.CheckpointAck), `{"output_offset":8}`, true},
		{new(kvsp.PrefetchDirective), strings.Replace(prefetchExample, `"ascending"`, `"descending"`, 1), false},
		{new(kvsp.PrefetchDirective), strings.Replace(prefetchExample, `"sources": ["https://h1.example/kvsp/"]`, `"sources": []`, 1), false},
		{new(kvsp.LookupRequest), strings.Replace(lookupExample, `"https://ii9.example/kvsp/"`, `"https://ii9.example/kvsp/?x"`, 1), false},
	} {
		if err := kvsp.Decode([]byte(c.text), c.v); c.ok != (err == nil) {
			t.Errorf("%T %s: err = %v, want ok=%v", c.v, c.text, err, c.ok)
		}
	}
}

// TestGenerateRequestLimits: a generation is bounded (413) and needs its
// session and epoch (400).
func TestGenerateRequestLimits(t *testing.T) {
	ok := kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1, ScopeID: kvsp.ScopeID{1}, CompatID: kvsp.CompatID{1}, Tokens: []uint32{1}, MaxTokens: 8}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	big := ok
	big.MaxTokens = kvsp.MaxGenerateTokens + 1
	if err := big.Validate(); !errors.Is(err, kvsp.ErrTooLarge) {
		t.Fatalf("max_tokens over the bound: %v", err)
	}
	// A seed above 2^53-1 could never be checkpointed: refused at
	// the door rather than a session that hangs (found by L2).
	for _, seed := range []uint64{kvsp.MaxJSONInt + 1, 1 << 60} {
		s := ok
		s.Sampler = &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: seed}
		if err := s.Validate(); !errors.Is(err, kvsp.ErrInvalid) {
			t.Fatalf("seed %d: %v, want 400", seed, err)
		}
		s.Sampler.Seed = kvsp.MaxJSONInt
		if err := s.Validate(); err != nil {
			t.Fatalf("seed 2^53-1: %v", err)
		}
	}
	noEpoch := ok
	noEpoch.Epoch = 0
	if err := noEpoch.Validate(); !errors.Is(err, kvsp.ErrInvalid) {
		t.Fatalf("no epoch: %v", err)
	}
}

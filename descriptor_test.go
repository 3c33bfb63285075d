package kvsp_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

const prettyDescriptor = `{
  "tokenizer_digest" : "sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c",
  "layout": "kvsp-layout-1",
  "block_tokens": 4,
  "positional": "rope",
  "kv_dtype": "bf16",
  "head_dim": 128,
  "kv_heads": 8,
  "layers": 32,
  "model_digest": "sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda",
  "model": "example-model"
}`

func compatOf(t *testing.T, text string) (kvsp.CompatID, error) {
	t.Helper()
	d, err := kvsp.ParseDescriptor([]byte(text))
	if err != nil {
		return kvsp.CompatID{}, err
	}
	return d.CompatID()
}

// TestDescriptorFormIndependent: member order and whitespace do not change
// the Compatibility ID (R-CMP-14).
func TestDescriptorFormIndependent(t *testing.T) {
	c, err := compatOf(t, prettyDescriptor)
	if err != nil {
		t.Fatal(err)
	}
	if c.String() != vecCompatID.value {
		t.Fatalf("compat_id of reordered descriptor = %s, want %s", c, vecCompatID.value)
	}
}

// replaceMember rewrites one member of the appendix descriptor's JCS text.
func replaceMember(name, value string) string {
	s := vecJCS.value
	i := strings.Index(s, `"`+name+`":`)
	j := i + len(name) + 3
	end := j
	depth := 0
	inStr := false
	for ; end < len(s); end++ {
		c := s[end]
		if inStr {
			if c == '"' && s[end-1] != '\\' {
				inStr = false
			}
			continue
		}
		if c == '"' {
			inStr = true
		} else if c == '[' {
			depth++
		} else if c == ']' {
			depth--
		} else if (c == ',' || c == '}') && depth == 0 {
			break
		}
	}
	if value == "" { // drop the member
		if s[end] == ',' {
			return s[:i] + s[end+1:]
		}
		return s[:i-1] + s[end:]
	}
	return s[:j] + value + s[end:]
}

func addMember(member string) string {
	return strings.TrimSuffix(vecJCS.value, "}") + "," + member + "}"
}

// TestDescriptorRequiredMembers drops each required member in turn (R-CMP-1).
func TestDescriptorRequiredMembers(t *testing.T) {
	for _, m := range []string{"model", "model_digest", "tokenizer_digest", "layers", "kv_heads", "head_dim", "kv_dtype", "positional", "block_tokens", "layout"} {
		text := replaceMember(m, "")
		if strings.Contains(text, `"`+m+`"`) {
			t.Fatalf("member %s not dropped", m)
		}
		if _, err := kvsp.ParseDescriptor([]byte(text)); !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("without %s: err = %v, want ErrInvalid", m, err)
		}
	}
}

// TestDescriptorValues covers R-CMP-4..12 and the JSON strictness of A-29.
func TestDescriptorValues(t *testing.T) {
	for _, c := range []struct {
		name, text string
		ok         bool
	}{
		{"R-CMP-6 empty adapters", addMember(`"adapters":[]`), false},
		{"R-CMP-6 null adapters", addMember(`"adapters":null`), false},
		{"R-CMP-5 one adapter", addMember(`"adapters":["sha-256:` + strings.Repeat("ab", 32) + `"]`), true},
		{"R-CMP-5 bare-hex adapter", addMember(`"adapters":["` + strings.Repeat("ab", 32) + `"]`), false},
		{"R-CMP-4 uppercase digest", replaceMember("tokenizer_digest", `"sha-256:9F42A7A29DCA3063AD26D7BE7FE6A930FA38AFB1A703E4F7FF538DB4E133B19C"`), false},
		{"R-CMP-4 sha-512 prefix", replaceMember("model_digest", `"sha-512:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda"`), false},
		{"R-CMP-7 layers as string", replaceMember("layers", `"32"`), false},
		{"R-CMP-7 layers fractional", replaceMember("layers", `32.5`), false},
		{"R-CMP-7 layers 32.0", replaceMember("layers", `32.0`), false},
		{"R-CMP-7 layers exponent", replaceMember("layers", `3.2e1`), false},
		{"R-CMP-7 layers zero", replaceMember("layers", `0`), false},
		{"R-CMP-7 kv_heads negative", replaceMember("kv_heads", `-8`), false},
		{"R-CMP-7 head_dim huge", replaceMember("head_dim", `9007199254740993`), false},
		{"R-CMP-8 bfloat16", replaceMember("kv_dtype", `"bfloat16"`), false},
		{"R-CMP-8 BF16", replaceMember("kv_dtype", `"BF16"`), false},
		{"R-CMP-8 fp8-e4m3", replaceMember("kv_dtype", `"fp8-e4m3"`), true},
		{"R-CMP-9 rope theta", replaceMember("positional", `"rope;theta=500000"`), true},
		{"R-CMP-9 rope theta scaling", replaceMember("positional", `"rope;theta=500000,scaling=yarn"`), true},
		{"R-CMP-9 none", replaceMember("positional", `"none"`), true},
		{"R-CMP-9 alibi", replaceMember("positional", `"alibi"`), false},
		{"R-CMP-9 theta exponent", replaceMember("positional", `"rope;theta=5e5"`), false},
		{"R-CMP-9 theta leading zero", replaceMember("positional", `"rope;theta=0500000"`), false},
		{"R-CMP-9 none with params", replaceMember("positional", `"none;theta=1"`), false},
		{"R-CMP-9 unknown param", replaceMember("positional", `"rope;base=1"`), false},
		{"R-CMP-9 theta twice", replaceMember("positional", `"rope;theta=1,theta=2"`), false},
		{"R-CMP-9 uppercase scaling", replaceMember("positional", `"rope;scaling=YaRN"`), false},
		{"R-CMP-12 other layout", replaceMember("layout", `"kvsp-layout-2"`), false},
		{"block_tokens zero", replaceMember("block_tokens", `0`), false},
		{"model empty", replaceMember("model", `""`), false},
		{"unknown member rejected in a descriptor", addMember(`"sliding_window":4096`), false},
		{"A-29 duplicate member", addMember(`"layers":32`), false},
		{"R-REC-2 case-sensitive names", strings.Replace(vecJCS.value, `"layers"`, `"Layers"`, 1), false},
		{"A-29 invalid UTF-8", replaceMember("model", "\"ex\xffmple\""), false},
		{"not an object", `[]`, false},
		{"trailing data", vecJCS.value + `{}`, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := kvsp.ParseDescriptor([]byte(c.text))
			if c.ok && err != nil {
				t.Fatalf("rejected: %v\n%s", err, c.text)
			}
			if !c.ok && !errors.Is(err, kvsp.ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid\n%s", err, c.text)
			}
		})
	}
}

// TestDescriptorIdentity: every member that changes the cache changes the
// ID; adapter order matters (R-CMP-5, R-CMP-10); equivalent positional
// spellings do not.
func TestDescriptorIdentity(t *testing.T) {
	a := "sha-256:" + strings.Repeat("aa", 32)
	b := "sha-256:" + strings.Repeat("bb", 32)
	ids := map[kvsp.CompatID]string{}
	for _, text := range []string{
		vecJCS.value,
		addMember(`"adapters":["` + a + `","` + b + `"]`),
		addMember(`"adapters":["` + b + `","` + a + `"]`),
		replaceMember("positional", `"rope;theta=500000"`),
		replaceMember("block_tokens", `16`),
		replaceMember("kv_dtype", `"fp16"`),
		replaceMember("model", `"example-model-2"`),
	} {
		c, err := compatOf(t, text)
		if err != nil {
			t.Fatal(err)
		}
		if prev, dup := ids[c]; dup {
			t.Errorf("same compat_id for\n%s\n%s", prev, text)
		}
		ids[c] = text
	}
	x, err1 := compatOf(t, replaceMember("positional", `"rope;scaling=yarn,theta=500000"`))
	y, err2 := compatOf(t, replaceMember("positional", `"rope;theta=500000,scaling=yarn"`))
	if err1 != nil || err2 != nil || x != y {
		t.Errorf("parameter order changed the ID (A-30): %v %v", err1, err2)
	}
}

func TestPositionalCanonical(t *testing.T) {
	for in, want := range map[string]string{
		"rope":                           "rope",
		"none":                           "none",
		"rope;theta=10000":               "rope;theta=10000",
		"rope;scaling=yarn":              "rope;scaling=yarn",
		"rope;scaling=yarn,theta=500000": "rope;theta=500000,scaling=yarn",
	} {
		p, err := kvsp.ParsePositional(in)
		if err != nil || p.String() != want {
			t.Errorf("ParsePositional(%q) = %q, %v; want %q", in, p, err, want)
		}
	}
	p, _ := kvsp.ParsePositional("rope;theta=10000,scaling=linear")
	if got := p.WithoutDefaults(10000, "").String(); got != "rope;scaling=linear" {
		t.Errorf("WithoutDefaults = %q", got)
	}
	for _, bad := range []string{"", "rope;", "rope;theta=", "rope;theta", "rope;theta=1,", "rope;theta=-1", "rope;theta=18446744073709551616", "Rope", "rope ;theta=1"} {
		if _, err := kvsp.ParsePositional(bad); !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("ParsePositional(%q) accepted", bad)
		}
	}
}

func TestElementSizes(t *testing.T) {
	for ty, n := range map[kvsp.ElementType]int{"bf16": 2, "fp16": 2, "fp32": 4, "fp8-e4m3": 1, "fp8-e5m2": 1, "int8": 0} {
		if ty.Size() != n {
			t.Errorf("%s.Size() = %d, want %d (R-REG-7)", ty, ty.Size(), n)
		}
	}
}

// TestElementTypesAgree: package container keeps its own element table (it
// imports nothing of kvsp); the two must name and size the same registry.
func TestElementTypesAgree(t *testing.T) {
	for _, name := range []kvsp.ElementType{kvsp.BF16, kvsp.FP16, kvsp.FP32, kvsp.FP8E4M3, kvsp.FP8E5M2} {
		et, ok := container.ParseElemType(string(name))
		if !ok || et.Size() != name.Size() || et.String() != string(name) {
			t.Errorf("%s: container has %v (size %d), kvsp size %d", name, et, et.Size(), name.Size())
		}
	}
	if _, ok := container.ParseElemType("int8"); ok {
		t.Error("container accepts an unregistered element type")
	}
}

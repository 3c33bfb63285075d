package gateway

import (
	"strings"
	"testing"
)

// TestTextStreamHoldsSplitCharacters: octets of one character split
// across tokens are sent once whole; an incomplete one at the end becomes
// U+FFFD.
func TestTextStreamHoldsSplitCharacters(t *testing.T) {
	var ts textStream
	var out strings.Builder
	for _, p := range [][]byte{[]byte("Gr"), {0xc3}, {0xbc, 'n', 0xf0, 0x9f}, {0x8c, 0x8d}, []byte("!")} {
		s, stopped := ts.add(p)
		if stopped {
			t.Fatal("stopped without a stop sequence")
		}
		for _, r := range s {
			if r == '\uFFFD' {
				t.Fatalf("a split character was sent in pieces: %q", s)
			}
		}
		out.WriteString(s)
	}
	out.WriteString(ts.flush())
	if out.String() != "Grün🌍!" {
		t.Fatalf("text %q", out.String())
	}
	ts = textStream{}
	s, _ := ts.add([]byte{'a', 0xe2, 0x82})
	if s+ts.flush() != "a\uFFFD" {
		t.Fatalf("an answer ending inside a character: %q", s)
	}
}

// TestTextStreamStopsAcrossTokens: a stop sequence split over tokens ends
// the answer before it; text that only begins like one is held, then sent
// once it is not.
func TestTextStreamStopsAcrossTokens(t *testing.T) {
	ts := textStream{stops: []string{"of Fr", "\n\n"}}
	var out strings.Builder
	for i, p := range []string{"The capital ", "o", "f Germany", " is", " Berlin.", " Capital o", "f Fr", "ance"} {
		s, stopped := ts.add([]byte(p))
		out.WriteString(s)
		if stopped {
			if i != 6 {
				t.Fatalf("stopped at piece %d", i)
			}
			break
		}
	}
	if out.String() != "The capital of Germany is Berlin. Capital " {
		t.Fatalf("text %q", out.String())
	}
	if s, stopped := ts.add([]byte("more")); s != "" || !stopped || ts.flush() != "" {
		t.Fatal("text after the stop sequence")
	}
}

// TestParseRequestRefusals: every refusal names its parameter; neutral
// values of parameters kvsp does not run are accepted.
func TestParseRequestRefusals(t *testing.T) {
	for _, tc := range []struct {
		body, param string
		chat        bool
	}{
		{`[]`, "", true},
		{"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}", "", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}]} {}`, "", true},
		{`{"messages":[{"role":"user","content":"x"}]}`, "model", true},
		{`{"model":"m","messages":[]}`, "messages", true},
		{`{"model":"m","messages":[{"role":"tool","content":"x"}]}`, "messages[0].role", true},
		{`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}`, "messages[0].content[0]", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}`, "n", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[]}`, "tools", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"logit_bias":{"1":5}}`, "logit_bias", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}`, "response_format", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":0.5}`, "temperature", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":0}`, "top_p", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}`, "max_tokens", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"seed":-1}`, "seed", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}`, "stop", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}`, "stream_options", true},
		{`{"model":"m","messages":[{"role":"user","content":"x"}],"presence_penalty":0.5}`, "presence_penalty", true},
		{`{"model":"m","prompt":["a","b"]}`, "prompt", false},
		{`{"model":"m","prompt":"a","suffix":"b"}`, "suffix", false},
		{`{"model":"m","prompt":"a","echo":true}`, "echo", false},
		{`{"model":"m","messages":[{"role":"user","content":"x"}]}`, "messages", false},
	} {
		_, e := parseRequest([]byte(tc.body), tc.chat)
		if e == nil || e.Status != 400 || (tc.param != "" && (e.Param == nil || *e.Param != tc.param)) {
			t.Errorf("%s: %+v, want 400 naming %q", tc.body, e, tc.param)
		}
	}
	q, e := parseRequest([]byte(`{"model":"m","messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],`+
		`"n":1,"presence_penalty":0,"frequency_penalty":0,"logprobs":false,"temperature":0,"max_completion_tokens":9,"max_tokens":3,"stop":"x",`+
		`"stream":true,"stream_options":{"include_usage":true},"user":"u","seed":null}`), true)
	if e != nil || !q.greedy || q.maxTokens != 9 || q.messages[0] != (message{"system", "ab"}) || len(q.stops) != 1 || !q.usage {
		t.Fatalf("a request of neutral values: %+v %v", q, e)
	}
}

package gateway

import (
	"errors"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/kvsp/kvsp/server"
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
		{`{"model":"m","messages":[{"role":"user","content":"x"}]}}`, "", true},
		{`{"model":"m","prompt":"x"}]`, "", false},
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

// TestErrorsSayWhatToDo: a method the path does not serve is 405 with
// Allow; every 429 and 503 carries Retry-After, and a 400 does not; a body
// that cannot be read is answered 400, not an empty 200; a request that
// could never fit its key's tokens a minute is 400, not a 429 the client
// would retry for ever (what schemathesis and a review of api/openapi.yaml
// found).
func TestErrorsSayWhatToDo(t *testing.T) {
	g := &Gateway{cfg: Config{MaxBody: 1 << 10}, inflight: map[*server.APIKey]int{}, used: map[*server.APIKey]int{}, failures: map[string]int{}}
	w := httptest.NewRecorder()
	g.ServeHTTP(w, httptest.NewRequest("DELETE", "/v1/models", nil))
	if w.Code != 405 || w.Header().Get("Allow") != "GET" {
		t.Errorf("DELETE /v1/models: %d Allow %q", w.Code, w.Header().Get("Allow"))
	}
	for status, retry := range map[int]string{400: "", 429: "1", 503: "1"} {
		w := httptest.NewRecorder()
		writeError(w, &apiError{Status: status, Type: "x", Message: "m"})
		if w.Header().Get("Retry-After") != retry {
			t.Errorf("%d: Retry-After %q, want %q", status, w.Header().Get("Retry-After"), retry)
		}
	}
	w = httptest.NewRecorder()
	r := httptest.NewRequest("POST", "/v1/completions", io.MultiReader(strings.NewReader(`{"model"`), iotest.ErrReader(errors.New("bad chunk"))))
	if status := g.complete(w, r, nil, "", false); status != 400 || w.Code != 400 || !strings.Contains(w.Body.String(), "could not be read") {
		t.Errorf("an unreadable body: %d %d %s", status, w.Code, w.Body)
	}
	key := &server.APIKey{MaxTokensPerMinute: 100}
	if _, e := g.admit(key, 90, 20); e == nil || e.Status != 400 {
		t.Errorf("110 tokens on a key of 100 a minute: %+v, want 400", e)
	}
	release, e := g.admit(key, 50, 20)
	if e != nil {
		t.Fatal(e)
	}
	defer release(20)
	if _, e := g.admit(key, 50, 20); e == nil || e.Status != 429 {
		t.Errorf("140 tokens within the minute on a key of 100: %+v, want 429", e)
	}
}

package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strings"
	"unicode/utf8"
)

// apiError is an error in the OpenAI API's shape: {"error": {"message",
// "type", "param", "code"}}, with its HTTP status.
type apiError struct {
	Status  int     `json:"-"`
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *apiError) Error() string { return e.Message }

func str(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// invalid is a 400 naming the parameter at fault.
func invalid(param, code, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: fmt.Sprintf(format, args...), Param: str(param), Code: str(code)}
}

// unsupported refuses a parameter the API defines and kvsp does not run.
func unsupported(param string) *apiError {
	return invalid(param, "unsupported_parameter", "%s is not supported by this server", param)
}

// request is a chat or text completion request, checked.
type request struct {
	chat      bool
	model     string
	messages  []message
	prompt    string
	maxTokens int // 0: the model's default
	greedy    bool
	topP      float64
	seed      *uint64
	stops     []string
	stream    bool
	usage     bool // stream_options.include_usage
}

type message struct{ role, content string }

// neutral are the values of parameters kvsp does not implement that ask
// for nothing (a client library may send them as they are).
var neutral = map[string]func(json.RawMessage) bool{
	"n":                 func(v json.RawMessage) bool { return isNumber(v, 1) },
	"presence_penalty":  func(v json.RawMessage) bool { return isNumber(v, 0) },
	"frequency_penalty": func(v json.RawMessage) bool { return isNumber(v, 0) },
	"logprobs":          func(v json.RawMessage) bool { return string(v) == "false" },
	"echo":              func(v json.RawMessage) bool { return string(v) == "false" },
}

// known are the parameters of the two endpoints that kvsp reads; user is
// the caller's label for its end user (accepted, not used).
var known = map[bool]map[string]bool{
	true: {"model": true, "messages": true, "max_tokens": true, "max_completion_tokens": true, "temperature": true, "top_p": true,
		"seed": true, "stop": true, "stream": true, "stream_options": true, "user": true},
	false: {"model": true, "prompt": true, "max_tokens": true, "temperature": true, "top_p": true, "seed": true, "stop": true,
		"stream": true, "stream_options": true, "user": true},
}

func isNumber(v json.RawMessage, want float64) bool {
	var f float64
	return json.Unmarshal(v, &f) == nil && f == want
}

// parseRequest decodes and checks a request body: unknown members and
// those of the API that kvsp does not run are refused, naming them.
func parseRequest(body []byte, chat bool) (*request, *apiError) {
	if !utf8.Valid(body) { // JSON is UTF-8 (RFC 8259); decoding would replace the octets silently
		return nil, invalid("", "", "the body is not valid UTF-8")
	}
	var fields map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&fields); err != nil || fields == nil || len(bytes.TrimLeft(body[dec.InputOffset():], " \t\r\n")) != 0 {
		return nil, invalid("", "", "the body is not a JSON object")
	}
	for name, v := range fields {
		if known[chat][name] || string(v) == "null" {
			continue
		}
		if ok := neutral[name]; ok != nil && ok(v) {
			continue
		}
		if name == "n" {
			return nil, invalid("n", "unsupported_parameter", "n must be 1: this server makes one answer per request")
		}
		if name == "prompt" || name == "messages" {
			return nil, invalid(name, "", "%s belongs to the other completions endpoint", name)
		}
		return nil, unsupported(name)
	}
	q := &request{chat: chat, topP: 1}
	get := func(name string, v any) *apiError {
		raw, ok := fields[name]
		if !ok || string(raw) == "null" {
			return nil
		}
		if err := json.Unmarshal(raw, v); err != nil {
			return invalid(name, "", "%s: %v", name, strings.TrimPrefix(err.Error(), "json: "))
		}
		return nil
	}
	if e := get("model", &q.model); e != nil {
		return nil, e
	}
	if q.model == "" {
		return nil, invalid("model", "", "model: required")
	}
	if chat {
		var raw []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
			Name    *string         `json:"name"`
		}
		if e := get("messages", &raw); e != nil {
			return nil, e
		}
		if len(raw) == 0 {
			return nil, invalid("messages", "", "messages: at least one message")
		}
		for i, m := range raw {
			where := fmt.Sprintf("messages[%d]", i)
			role := m.Role
			if role == "developer" {
				role = "system" // the newer name of the system role
			}
			if role != "system" && role != "user" && role != "assistant" {
				return nil, invalid(where+".role", "", "%s.role: %q: this server takes system, developer, user and assistant messages", where, m.Role)
			}
			content, e := contentText(m.Content, where+".content")
			if e != nil {
				return nil, e
			}
			q.messages = append(q.messages, message{role, content})
		}
	} else {
		raw, ok := fields["prompt"]
		if !ok {
			return nil, invalid("prompt", "", "prompt: required")
		}
		if err := json.Unmarshal(raw, &q.prompt); err != nil {
			return nil, invalid("prompt", "unsupported_parameter", "prompt: one string (batches and token arrays are not supported)")
		}
	}
	var maxTokens, maxCompletion *int64
	if e := get("max_tokens", &maxTokens); e != nil {
		return nil, e
	}
	if e := get("max_completion_tokens", &maxCompletion); e != nil {
		return nil, e
	}
	for name, v := range map[string]*int64{"max_tokens": maxTokens, "max_completion_tokens": maxCompletion} {
		if v != nil && (*v < 1 || *v > math.MaxInt32) {
			return nil, invalid(name, "", "%s: at least 1", name)
		}
	}
	if maxCompletion != nil {
		q.maxTokens = int(*maxCompletion)
	} else if maxTokens != nil {
		q.maxTokens = int(*maxTokens)
	}
	var temperature *float64
	if e := get("temperature", &temperature); e != nil {
		return nil, e
	}
	if e := get("top_p", &q.topP); e != nil {
		return nil, e
	}
	if !(q.topP > 0 && q.topP <= 1) {
		return nil, invalid("top_p", "", "top_p: in (0, 1]")
	}
	switch {
	case temperature == nil || *temperature == 1:
	case *temperature == 0:
		q.greedy = true
	default:
		return nil, invalid("temperature", "unsupported_value", "temperature: 0 (greedy) or 1 (top-p sampling with top_p); other temperatures are not supported")
	}
	var seed *int64
	if e := get("seed", &seed); e != nil {
		return nil, e
	}
	if seed != nil {
		if *seed < 0 || *seed >= 1<<53 {
			return nil, invalid("seed", "", "seed: in 0..2^53-1")
		}
		u := uint64(*seed)
		q.seed = &u
	}
	if raw, ok := fields["stop"]; ok && string(raw) != "null" {
		var one string
		if json.Unmarshal(raw, &one) == nil {
			q.stops = []string{one}
		} else if err := json.Unmarshal(raw, &q.stops); err != nil {
			return nil, invalid("stop", "", "stop: a string or an array of up to 4 strings")
		}
		if len(q.stops) > 4 {
			return nil, invalid("stop", "", "stop: up to 4 sequences")
		}
		for _, s := range q.stops {
			if s == "" || len(s) > 256 || !utf8.ValidString(s) {
				return nil, invalid("stop", "", "stop: each sequence of 1 to 256 octets of UTF-8")
			}
		}
	}
	if e := get("stream", &q.stream); e != nil {
		return nil, e
	}
	if raw, ok := fields["stream_options"]; ok && string(raw) != "null" {
		var so map[string]json.RawMessage
		if err := json.Unmarshal(raw, &so); err != nil {
			return nil, invalid("stream_options", "", "stream_options: an object")
		}
		for k, v := range so {
			if k != "include_usage" {
				return nil, unsupported("stream_options." + k)
			}
			if err := json.Unmarshal(v, &q.usage); err != nil {
				return nil, invalid("stream_options.include_usage", "", "stream_options.include_usage: a boolean")
			}
		}
		if !q.stream {
			return nil, invalid("stream_options", "", "stream_options: only with stream true")
		}
	}
	return q, nil
}

// contentText is a message's content: a string, or an array of text
// parts (concatenated); other parts (images, audio) are refused.
func contentText(raw json.RawMessage, where string) (string, *apiError) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", invalid(where, "", "%s: a string or an array of text parts", where)
	}
	var b strings.Builder
	for i, p := range parts {
		if p.Type != "text" || p.Text == nil {
			return "", invalid(fmt.Sprintf("%s[%d]", where, i), "unsupported_parameter", "%s[%d]: only text parts are supported", where, i)
		}
		b.WriteString(*p.Text)
	}
	return b.String(), nil
}

// errBody is an error response's body.
func errBody(e *apiError) []byte {
	b, _ := json.Marshal(map[string]*apiError{"error": e})
	return b
}

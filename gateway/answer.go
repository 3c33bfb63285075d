package gateway

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// usage is the API's usage object; cached_tokens are the prompt tokens
// whose KV came from a cache (resident at the instance, or loaded from a
// holder), as the instance's engine counted them.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// answer writes one completion: server-sent events as the text comes
// (with a comment when nothing was sent for a while: a session migrating),
// or one JSON response at the end.
type answer struct {
	w         http.ResponseWriter
	rc        *http.ResponseController
	q         *request
	model     string
	created   int64
	stream    bool
	keepAlive time.Duration
	ts        textStream

	mu      sync.Mutex
	id      string
	started bool // the stream's headers went
	role    bool // the assistant role went (chat)
	last    time.Time
	text0   strings.Builder // the text of a response not streamed
	failed  error
	quit    chan struct{}
	once    sync.Once
}

func (a *answer) init() {
	if a.id != "" {
		return
	}
	var b [12]byte
	rand.Read(b[:])
	prefix := "cmpl-"
	if a.q.chat {
		prefix = "chatcmpl-"
	}
	a.id = prefix + hex.EncodeToString(b[:])
	a.last = time.Now()
	a.rc = http.NewResponseController(a.w)
	a.quit = make(chan struct{})
	if a.stream {
		go a.keepAlives()
	}
}

// keepAlives sends an SSE comment when the stream was quiet for
// keepAlive: clients and proxies keep a connection that says something.
func (a *answer) keepAlives() {
	t := time.NewTicker(a.keepAlive / 2)
	defer t.Stop()
	for {
		select {
		case <-a.quit:
			return
		case <-t.C:
		}
		a.mu.Lock()
		if a.failed == nil && time.Since(a.last) >= a.keepAlive {
			a.write(": keep-alive\n\n")
		}
		a.mu.Unlock()
	}
}

func (a *answer) stop() {
	a.once.Do(func() {
		if a.quit != nil {
			close(a.quit)
		}
	})
}

// write sends raw SSE octets (a.mu held).
func (a *answer) write(s string) error {
	if a.failed != nil {
		return a.failed
	}
	if !a.started {
		h := a.w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("X-Accel-Buffering", "no")
		a.w.WriteHeader(http.StatusOK)
		a.started = true
	}
	if _, err := a.w.Write([]byte(s)); err != nil {
		a.failed = err
		return err
	}
	if err := a.rc.Flush(); err != nil {
		a.failed = err
		return err
	}
	a.last = time.Now()
	return nil
}

func (a *answer) event(v any) error {
	b, _ := json.Marshal(v)
	return a.write("data: " + string(b) + "\n\n")
}

// choice is one choice of a chunk or a response.
func (a *answer) choice(text string, finish *string, final bool) map[string]any {
	c := map[string]any{"index": 0, "finish_reason": finish}
	if !a.q.chat {
		c["text"], c["logprobs"] = text, nil
		return c
	}
	msg := map[string]any{"content": text}
	if !a.role || final {
		msg["role"] = "assistant"
	}
	if final {
		c["message"], c["logprobs"] = msg, nil
	} else if finish != nil && text == "" {
		c["delta"] = map[string]any{}
	} else {
		c["delta"] = msg
	}
	return c
}

func (a *answer) object(final bool) string {
	switch {
	case a.q.chat && final:
		return "chat.completion"
	case a.q.chat:
		return "chat.completion.chunk"
	}
	return "text_completion"
}

// text sends (or keeps) text of the answer.
func (a *answer) text(s string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.init()
	if !a.stream {
		a.text0.WriteString(s)
		return nil
	}
	if s == "" && (a.role || !a.q.chat) {
		return nil
	}
	err := a.event(map[string]any{"id": a.id, "object": a.object(false), "created": a.created, "model": a.model,
		"choices": []any{a.choice(s, nil, false)}})
	a.role = true
	return err
}

// end sends the answer's end: why it ended, and its usage.
func (a *answer) end(finish string, session kvsp.UUID, u usage) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.init()
	a.stop()
	if !a.stream {
		a.started = true
		writeJSON(a.w, http.StatusOK, map[string]any{"id": a.id, "object": a.object(true), "created": a.created, "model": a.model,
			"choices": []any{a.choice(a.text0.String(), &finish, true)}, "usage": u})
		return nil
	}
	if err := a.event(map[string]any{"id": a.id, "object": a.object(false), "created": a.created, "model": a.model,
		"choices": []any{a.choice("", &finish, false)}}); err != nil {
		return err
	}
	if a.q.usage {
		if err := a.event(map[string]any{"id": a.id, "object": a.object(false), "created": a.created, "model": a.model,
			"choices": []any{}, "usage": u}); err != nil {
			return err
		}
	}
	return a.write("data: [DONE]\n\n")
}

// fail ends the answer with an error: its status before anything was
// sent, else an error event in the API's shape (the stream is not cut).
func (a *answer) fail(e *apiError) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stop()
	if !a.started {
		return writeError(a.w, e)
	}
	b := errBody(e)
	a.write("data: " + string(b) + "\n\n")
	return e.Status
}

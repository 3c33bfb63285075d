// Package gateway is kvsp's OpenAI-compatible API: POST
// /v1/chat/completions, POST /v1/completions (streamed as server-sent
// events, or not) and GET /v1/models, as OpenAI's SDKs call them, over
// kvsp. Text is tokenized with the model's own tokenizer and chat template
// (llama.cpp's, loaded without the weights); each request is placed at
// the PC and generated at the instance it names, following its session
// to another instance if that one fails, so the client's stream goes on.
// Clients authenticate with bearer API keys, which the policy holds as
// SHA-256 hashes, each mapped to a principal and one scope: the scope its
// requests run in and share KV with.
package gateway

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/engine/llamacpp"
	"github.com/kvsp/kvsp/server"
)

// Model is a model the gateway serves.
type Model struct {
	// ID is the name clients give as "model".
	ID    string
	Vocab *llamacpp.Vocabulary
	// ContextTokens bounds a request's prompt and output tokens together.
	ContextTokens int
	// DefaultMaxTokens is a request's output limit when it sets none (KV
	// is reserved for it, so never the whole context); MaxTokens the
	// largest a request may ask.
	DefaultMaxTokens, MaxTokens int
	compat                      kvsp.CompatID
}

// Config configures a gateway.
type Config struct {
	Models []Model
	// Client calls the PC and the instances with the process's identity,
	// authorized for the scopes of the API keys.
	Client      *client.Client
	Controllers []string
	Policy      *server.PolicyStore
	Logger      *slog.Logger
	Registerer  prometheus.Registerer
	// KeepAlive is how long a stream may go without a line before the
	// gateway sends an SSE comment (while a session migrates); default 2s.
	KeepAlive time.Duration
	// MaxBody bounds a request body; default 4 MiB.
	MaxBody int64
	// Retry is the pause between a session's placement attempts; default
	// 100 ms.
	Retry time.Duration
	// PlaceWait bounds how long a request waits for a placement (no
	// instance with room, the PC unreachable, a session not yet moved)
	// before it is answered 503 with Retry-After; default 30 s.
	PlaceWait time.Duration
}

// Gateway serves the API.
type Gateway struct {
	cfg    Config
	models map[string]*Model
	ctl    *client.Controller
	log    *slog.Logger
	m      metrics

	mu       sync.Mutex
	inflight map[*server.APIKey]int
	minute   int64
	used     map[*server.APIKey]int // tokens in the current minute
	failures map[string]int         // failed authentications per peer, this minute
}

// New returns a gateway.
func New(cfg Config) (*Gateway, error) {
	if len(cfg.Models) == 0 || cfg.Client == nil || len(cfg.Controllers) == 0 || cfg.Policy == nil {
		return nil, errors.New("gateway: models, a client, a controller and the policy are required")
	}
	if cfg.KeepAlive <= 0 {
		cfg.KeepAlive = 2 * time.Second
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = 4 << 20
	}
	if cfg.Retry <= 0 {
		cfg.Retry = 100 * time.Millisecond
	}
	if cfg.PlaceWait <= 0 {
		cfg.PlaceWait = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	g := &Gateway{cfg: cfg, models: map[string]*Model{}, ctl: cfg.Client.Controller(cfg.Controllers[0], cfg.Controllers[1:]...), log: cfg.Logger,
		m: newMetrics(cfg.Registerer), inflight: map[*server.APIKey]int{}, used: map[*server.APIKey]int{}, failures: map[string]int{}}
	for i := range cfg.Models {
		m := &cfg.Models[i]
		c, err := m.Vocab.Descriptor().CompatID()
		if err != nil {
			return nil, err
		}
		m.compat = c
		if m.ID == "" || g.models[m.ID] != nil {
			return nil, fmt.Errorf("gateway: models[%d]: a unique id is required", i)
		}
		if m.ContextTokens <= 1 || m.MaxTokens < 1 || m.DefaultMaxTokens < 1 || m.DefaultMaxTokens > m.MaxTokens || m.MaxTokens >= m.ContextTokens {
			return nil, fmt.Errorf("gateway: models[%d]: 1 <= default_max_tokens <= max_tokens < context_tokens", i)
		}
		g.models[m.ID] = m
	}
	return g, nil
}

// endpoints are the gateway's routes; the name labels its metrics.
var endpoints = []struct{ method, path, name string }{
	{http.MethodGet, "/v1/models", "models"},
	{http.MethodPost, "/v1/chat/completions", "chat"},
	{http.MethodPost, "/v1/completions", "completions"},
}

// Routes returns the gateway's routes, "METHOD /path", sorted: what
// api/openapi.yaml must describe, and only that.
func Routes() []string {
	var out []string
	for _, e := range endpoints {
		out = append(out, e.method+" "+e.path)
	}
	slices.Sort(out)
	return out
}

// ServeHTTP implements http.Handler.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	var endpoint string
	known := false
	for _, e := range endpoints {
		if r.URL.Path == e.path {
			known = true
			if r.Method == e.method {
				endpoint = e.name
			}
		}
	}
	switch {
	case endpoint == "" && known:
		var allow []string
		for _, e := range endpoints {
			if e.path == r.URL.Path {
				allow = append(allow, e.method)
			}
		}
		w.Header().Set("Allow", strings.Join(allow, ", ")) // RFC 9110 section 15.5.6
		writeError(w, &apiError{Status: http.StatusMethodNotAllowed, Type: "invalid_request_error", Message: r.Method + " is not allowed here"})
		return
	case endpoint == "":
		writeError(w, &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", Message: "unknown URL: " + r.URL.Path})
		return
	}
	key, bearer, e := g.authenticate(r)
	if e != nil {
		writeError(w, e)
		return
	}
	start := time.Now()
	status := http.StatusOK
	defer func() {
		g.m.requests.WithLabelValues(key.Principal, endpoint, strconv.Itoa(status)).Inc()
		g.log.Info("request", "principal", key.Principal, "endpoint", endpoint, "status", status, "duration", time.Since(start).Round(time.Millisecond))
	}()
	if endpoint == "models" {
		g.listModels(w)
		return
	}
	status = g.complete(w, r, key, bearer, endpoint == "chat")
}

// authenticate finds the request's API key (Authorization: Bearer KEY).
// Failed attempts are counted per peer; past 20 in a minute the peer is
// answered 429 until the minute ends, without its key being looked at.
func (g *Gateway) authenticate(r *http.Request) (*server.APIKey, string, *apiError) {
	peer, _, _ := net.SplitHostPort(r.RemoteAddr)
	g.mu.Lock()
	g.roll()
	blocked := g.failures[peer] >= 20
	g.mu.Unlock()
	if blocked {
		g.m.authFailures.Inc()
		return nil, "", &apiError{Status: http.StatusTooManyRequests, Type: "requests", Code: str("rate_limit_exceeded"), Message: "too many failed authentications from this address; try again in a minute"}
	}
	bearer, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	bearer = strings.TrimSpace(bearer)
	key := g.cfg.Policy.Policy().APIKey(bearer)
	if !ok || key == nil {
		g.m.authFailures.Inc()
		g.mu.Lock()
		if len(g.failures) < 100000 {
			g.failures[peer]++
		}
		g.mu.Unlock()
		return nil, "", &apiError{Status: http.StatusUnauthorized, Type: "invalid_request_error", Code: str("invalid_api_key"), Message: "Incorrect API key provided."}
	}
	return key, bearer, nil
}

// roll starts a new minute of the per-minute counts (g.mu held).
func (g *Gateway) roll() {
	if m := time.Now().Unix() / 60; m != g.minute {
		g.minute = m
		clear(g.used)
		clear(g.failures)
	}
}

func (g *Gateway) listModels(w http.ResponseWriter) {
	type entry struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	out := struct {
		Object string  `json:"object"`
		Data   []entry `json:"data"`
	}{Object: "list", Data: []entry{}}
	for _, m := range g.cfg.Models {
		out.Data = append(out.Data, entry{ID: m.ID, Object: "model", OwnedBy: "kvsp"})
	}
	writeJSON(w, http.StatusOK, out)
}

// admit takes a request of n prompt tokens and up to max output tokens
// into the key's limits, or says when to come back.
func (g *Gateway) admit(key *server.APIKey, n, max int) (release func(used int), e *apiError) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.roll()
	if key.MaxConcurrent > 0 && g.inflight[key] >= key.MaxConcurrent {
		return nil, &apiError{Status: http.StatusTooManyRequests, Type: "requests", Code: str("rate_limit_exceeded"),
			Message: fmt.Sprintf("this key runs at most %d requests at once", key.MaxConcurrent)}
	}
	if key.MaxTokensPerMinute > 0 && n+max > key.MaxTokensPerMinute {
		// Never admitted, however long the client waits: not a 429.
		return nil, invalid("max_tokens", "", "the prompt's %d tokens and max_tokens %d are more than this key's %d tokens a minute", n, max, key.MaxTokensPerMinute)
	}
	if key.MaxTokensPerMinute > 0 && g.used[key]+n+max > key.MaxTokensPerMinute {
		return nil, &apiError{Status: http.StatusTooManyRequests, Type: "tokens", Code: str("rate_limit_exceeded"),
			Message: fmt.Sprintf("this key's requests may take %d tokens a minute", key.MaxTokensPerMinute)}
	}
	g.inflight[key]++
	g.used[key] += n + max // reserved; what the answer did not use is given back
	minute := g.minute
	return func(used int) {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.inflight[key]--
		if g.inflight[key] == 0 {
			delete(g.inflight, key)
		}
		if g.minute == minute {
			g.used[key] -= max - used
		}
	}, nil
}

// complete runs one completion and returns its HTTP status.
// bearer is the key presented: a policy reloaded mid-answer is asked
// whether it still admits it.
func (g *Gateway) complete(w http.ResponseWriter, r *http.Request, key *server.APIKey, bearer string, chat bool) int {
	raw := r.Body
	body, err := io.ReadAll(http.MaxBytesReader(w, raw, g.cfg.MaxBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			// The rest of the body is read (up to a bound) and dropped, so
			// that the client, still sending, reads the answer rather than
			// a reset connection.
			io.Copy(io.Discard, io.LimitReader(raw, maxDrain))
			return writeError(w, &apiError{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error", Code: str("request_too_large"),
				Message: fmt.Sprintf("the request body is larger than %d octets", g.cfg.MaxBody)})
		}
		// The client went away mid-body, or sent a body that cannot be
		// read (a malformed chunk): answered, whoever may still read it.
		return writeError(w, invalid("", "", "the request body could not be read"))
	}
	q, e := parseRequest(body, chat)
	if e != nil {
		return writeError(w, e)
	}
	m := g.models[q.model]
	if m == nil {
		return writeError(w, &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", Param: str("model"), Code: str("model_not_found"),
			Message: fmt.Sprintf("The model %q does not exist: GET /v1/models lists the models served here.", q.model)})
	}
	var toks []uint32
	param := "prompt"
	if chat {
		param = "messages"
		msgs := make([]llamacpp.Message, len(q.messages))
		for i, x := range q.messages {
			msgs[i] = llamacpp.Message{Role: x.role, Content: x.content}
		}
		toks, err = m.Vocab.Chat(msgs)
	} else {
		toks, err = m.Vocab.Tokenize(q.prompt, false, true)
	}
	if err != nil {
		if errors.Is(err, llamacpp.ErrText) {
			return writeError(w, invalid(param, "", "%s: %v", param, strings.TrimPrefix(err.Error(), "llamacpp: text: ")))
		}
		g.log.Error("tokenization failed", "err", err)
		return writeError(w, &apiError{Status: http.StatusInternalServerError, Type: "server_error", Message: "the prompt could not be tokenized"})
	}
	maxTokens := q.maxTokens
	if maxTokens == 0 {
		maxTokens = m.DefaultMaxTokens
	}
	if maxTokens > m.MaxTokens {
		return writeError(w, invalid("max_tokens", "", "max_tokens: at most %d for %s", m.MaxTokens, m.ID))
	}
	if len(toks)+maxTokens > m.ContextTokens {
		return writeError(w, invalid(param, "context_length_exceeded",
			"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the %s, %d for the completion).",
			m.ContextTokens, len(toks)+maxTokens, len(toks), param, maxTokens))
	}
	release, e := g.admit(key, len(toks), maxTokens)
	if e != nil {
		return writeError(w, e)
	}
	used := 0
	defer func() { release(used) }()

	pq := &kvsp.PlaceRequest{ScopeID: key.ScopeID(), CompatID: m.compat, Tokens: toks, MaxTokens: uint64(maxTokens)}
	if !q.greedy {
		seed := q.seed
		if seed == nil { // drawn and recorded: a migrated session draws on from it
			var b [8]byte
			rand.Read(b[:])
			s := binary.LittleEndian.Uint64(b[:]) >> 11
			seed = &s
		}
		pq.Sampler = &kvsp.PlaceSampler{Method: kvsp.SamplerTopP, Params: map[string]any{"p": q.topP}, Seed: *seed}
	}
	out := &answer{w: w, q: q, model: m.ID, created: time.Now().Unix(), stream: q.stream, keepAlive: g.cfg.KeepAlive, ts: textStream{stops: q.stops}}
	out.mu.Lock()
	out.init() // keep-alives from now on: a long prefill, or a migration
	out.mu.Unlock()
	defer out.stop()
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	pol := g.cfg.Policy.Policy()
	res, err := g.cfg.Client.RunSessionWithin(ctx, g.ctl, pq, g.cfg.Retry, g.cfg.PlaceWait, func(i uint64, tok uint32) error {
		if p := g.cfg.Policy.Policy(); p != pol { // reloaded: is the key still in force?
			if p.APIKey(bearer) == nil {
				return errRevoked
			}
			pol = p
		}
		used++
		text, stopped := out.ts.add(m.Vocab.Piece(tok))
		if err := out.text(text); err != nil {
			return err
		}
		if stopped {
			return errStopped
		}
		return nil
	})
	finish := "length"
	switch {
	case errors.Is(err, errStopped) || (err == nil && res.Finish == kvsp.FinishStop):
		finish = "stop"
	case err == nil:
	case errors.Is(err, errRevoked):
		return out.fail(&apiError{Status: http.StatusUnauthorized, Type: "invalid_request_error", Code: str("invalid_api_key"), Message: "The API key was revoked."})
	case r.Context().Err() != nil:
		return 499 // the client went away: its session is cancelled with it
	default:
		return out.fail(apiErrorOf(err, param))
	}
	if err := out.text(out.ts.flush()); err != nil {
		return 499
	}
	u := usage{PromptTokens: len(toks), CompletionTokens: used, TotalTokens: len(toks) + used}
	if res.Prefill != nil {
		u.PromptTokensDetails.CachedTokens = int(res.Prefill.CachedTokens)
	}
	g.m.tokens.WithLabelValues(key.Principal, "prompt").Add(float64(len(toks)))
	g.m.tokens.WithLabelValues(key.Principal, "cached").Add(float64(u.PromptTokensDetails.CachedTokens))
	g.m.tokens.WithLabelValues(key.Principal, "completion").Add(float64(used))
	if err := out.end(finish, res.Session, u); err != nil {
		return 499
	}
	return http.StatusOK
}

// maxDrain bounds what is read and dropped of a body past MaxBody.
const maxDrain = 64 << 20

var (
	errStopped = errors.New("gateway: a stop sequence ended the answer")
	errRevoked = errors.New("gateway: the API key was revoked")
)

// apiErrorOf maps a KVSP error to the API's shape.
func apiErrorOf(err error, param string) *apiError {
	var p *kvsp.Problem
	if errors.As(err, &p) {
		switch {
		case p.Status == http.StatusBadRequest:
			return invalid(param, "", "%s", p.Detail)
		case p.Status == http.StatusTooManyRequests:
			return &apiError{Status: http.StatusTooManyRequests, Type: "requests", Code: str("rate_limit_exceeded"), Message: "the scope holds its share of the model's capacity; try again shortly"}
		case p.Status == http.StatusServiceUnavailable || p.Status == http.StatusConflict:
			return &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: str("overloaded"), Message: "no instance can run the request now; try again shortly"}
		}
	}
	if errors.Is(err, kvsp.ErrUnavailable) { // no placement within PlaceWait
		return &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: str("overloaded"), Message: "no instance can run the request now; try again shortly"}
	}
	// The kind of failure, not its text: an error's text may name
	// internal addresses.
	kind := "the PC or the instance failed"
	if u := errors.Unwrap(err); u != nil && p != nil {
		kind = u.Error()
	}
	return &apiError{Status: http.StatusBadGateway, Type: "server_error", Message: "the request could not be run: " + kind}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(b)
}

func writeError(w http.ResponseWriter, e *apiError) int {
	if (e.Status == http.StatusTooManyRequests || e.Status == http.StatusServiceUnavailable) && w.Header().Get("Retry-After") == "" {
		w.Header().Set("Retry-After", "1") // every 429 and 503 says when to come back (api/openapi.yaml)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.Status)
	w.Write(errBody(e))
	return e.Status
}

type metrics struct {
	requests     *prometheus.CounterVec
	tokens       *prometheus.CounterVec
	authFailures prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) metrics {
	m := metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_gateway_requests_total",
			Help: "API requests by principal (never by key), endpoint and HTTP status (499: the client went away)."}, []string{"principal", "endpoint", "status"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_gateway_tokens_total",
			Help: "Tokens by principal and kind: prompt, cached (prompt tokens whose KV came from a cache), completion."}, []string{"principal", "kind"}),
		authFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_gateway_auth_failures_total",
			Help: "Requests refused for their API key (missing, unknown or revoked), and those of peers past 20 such failures a minute."}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.tokens, m.authFailures)
	}
	return m
}

package server

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"mime"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/bytebufferpool"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/mtls"
)

// HandlerFunc is a KVSP route handler: it writes a success response itself
// and returns an error for everything else, which the adapter turns into a
// problem details response (STYLE rule 7).
type HandlerFunc func(w http.ResponseWriter, r *http.Request) error

// Route configures one route.
type Route struct {
	// Roles may call the route; empty means any known principal.
	Roles []Role
	// MaxBody bounds the request body (413 above it); 0 means
	// DefaultMaxBody, and a negative value no body at all.
	MaxBody int64
	// Timeout bounds the handler (its context and write deadline); 0 means
	// none: streaming routes set their own per-handler deadlines.
	Timeout time.Duration
}

// DefaultMaxBody is the body limit of JSON routes.
const DefaultMaxBody = 1 << 20

type ctxKey int

const (
	connKey ctxKey = iota // the request's TLS connection (http.Server.ConnContext)
	principalKey
	requestIDKey
	loggerKey
)

// PrincipalFrom returns the authenticated, authorized principal of a
// request (never nil inside a handler).
func PrincipalFrom(ctx context.Context) *Principal {
	p, _ := ctx.Value(principalKey).(*Principal)
	return p
}

// RequestID returns the request's id, as logged on every line.
func RequestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey).(string)
	return id
}

// Logger returns the request's logger (with its request id).
func Logger(ctx context.Context) *slog.Logger {
	if l, ok := ctx.Value(loggerKey).(*requestLog); ok {
		return l.get()
	}
	return slog.New(slog.DiscardHandler)
}

// requestLog is a request's logger, with its request id and principal,
// made when a line is written: slog's With formats its attributes at
// once, which for every request was 2% of all the CPU of kvsp demo
// --speed 24, for lines that are mostly never written.
type requestLog struct {
	base      *slog.Logger
	id, ident string
	once      sync.Once
	l         *slog.Logger
}

func (rl *requestLog) get() *slog.Logger {
	rl.once.Do(func() {
		rl.l = rl.base.With("request_id", rl.id)
		if rl.ident != "" {
			rl.l = rl.l.With("principal", rl.ident)
		}
	})
	return rl.l
}

// newRequestID is a request's correlation id (its log lines, its problem
// details): 64 bits from the runtime's ChaCha8 generator (math/rand/v2),
// which crypto/rand's getrandom system call on every request cost more
// than it was worth; nothing is authorized by it.
func newRequestID() string {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], rand.Uint64())
	return hex.EncodeToString(b[:])
}

// statusWriter records whether and what the handler wrote, and sets the
// write deadline of each of its writes (the minimum rate, below).
type statusWriter struct {
	http.ResponseWriter
	status int
	bytes  int64

	// The minimum rate (Config.MinWriteRate, WriteGrace). A response's
	// writes may wait for its reader (for HTTP/2 window, the connection's
	// write lock, the socket) the credit it has, plus the time their own
	// octets take at the rate: before each write or flush its deadline is
	// set to that, and the time it waited is taken from the credit, which
	// its octets at the rate add to, up to the grace. A reader that keeps
	// up the rate is never cut, a stalled one is at the grace (plus the
	// time of the octets of the write it stalls in), and time the handler
	// spends between writes, producing, does not count: a slow producer
	// (a token stream) is never cut, only a slow reader. The credit is
	// capped so that a response that went fast for long cannot bank a
	// stall as long.
	rc           *http.ResponseController // the underlying writer's; nil: writes are not paced
	rate         float64                  // octets per second
	grace, slack time.Duration
	credit       time.Duration
	cancel       context.CancelCauseFunc // the handler's context
	slow         prometheus.Counter      // the route's responses cut for a slow reader

	mu     sync.Mutex // limit, set and failed: SetWriteDeadline may come from another goroutine
	limit  time.Time  // the route's deadline (Timeout), or the handler's own (SetWriteDeadline)
	set    time.Time  // the deadline now set on the underlying writer
	failed error      // a write ran past its deadline: later ones fail at once
}

// heldOctets is what a write that waits for nothing may leave unsent (net/http's
// buffer, internal/h2's held writes): a flush's allowance, and the final one's
// when the handler returns.
const heldOctets = 4 << 10

// ErrSlowReader is the cause the adapter gives a handler's context when
// its client did not read the response at the minimum rate
// (Config.MinWriteRate after WriteGrace): the response is cut (its HTTP/2
// or HTTP/3 stream reset, its HTTP/1.1 connection closed). The transport
// may have ended the context first, with a cause of its own (internal/h2
// as it resets the stream, net/http at the socket's failed write); the
// write's error is a timeout (a net.Error) on every transport.
var ErrSlowReader = errors.New("server: the client read the response below the minimum rate")

// pace starts the minimum rate on w's writes.
func (w *statusWriter) pace(rate int64, grace time.Duration, cancel context.CancelCauseFunc, slow prometheus.Counter) {
	w.rc = http.NewResponseController(w.ResponseWriter)
	w.rate, w.grace, w.credit, w.cancel, w.slow = float64(rate), grace, grace, cancel, slow
	w.slack = grace / 4
}

// pending is a write under way: when it started, how long the rate lets
// it wait, and whether a deadline of the route's or the handler's comes
// sooner.
type pending struct {
	start   time.Time
	allowed time.Duration
	limited bool
}

// arm sets the deadline of a write of n octets about to start; an error
// when an earlier write ran past its deadline.
func (w *statusWriter) arm(n int) (pending, error) {
	now := time.Now()
	allowed := w.credit + time.Duration(float64(n)/w.rate*float64(time.Second))
	want := now.Add(allowed)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.failed != nil {
		return pending{}, w.failed
	}
	limited := !w.limit.IsZero() && !w.limit.After(want)
	if limited {
		want = w.limit
	}
	// The deadline set is kept while it is no earlier than wanted and at
	// most slack later: a reader that keeps up has it moved about once
	// per slack, not a timer's reset per write.
	if w.set.Before(want) || w.set.Sub(want) > w.slack {
		d := want
		if !limited {
			d = want.Add(w.slack)
			if !w.limit.IsZero() && w.limit.Before(d) {
				d = w.limit
			}
		}
		if w.rc.SetWriteDeadline(d) == nil { // else a writer without deadlines: unpaced
			w.set = d
		}
	}
	return pending{now, allowed, limited}, nil
}

// settle takes the time a write waited from the credit; a write past its
// deadline fails every later one and ends the handler's context: for a
// slow reader when the rate's deadline was the one that passed, else
// (the route's Timeout, a role's cut) with the write's error.
func (w *statusWriter) settle(p pending, err error) {
	w.credit = min(w.grace, max(0, p.allowed-time.Since(p.start)))
	var ne net.Error
	if err == nil || !(errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()) {
		return
	}
	w.mu.Lock()
	first := w.failed == nil
	if first {
		w.failed = err
	}
	w.mu.Unlock()
	switch {
	case !first:
	case p.limited:
		w.cancel(err)
	default:
		w.slow.Inc()
		w.cancel(ErrSlowReader)
	}
}

// timedOut returns the error of a write that ran past its deadline.
func (w *statusWriter) timedOut() error {
	if w.rc == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.failed
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if w.rc == nil {
		n, err := w.ResponseWriter.Write(p)
		w.bytes += int64(n)
		return n, err
	}
	pw, err := w.arm(len(p))
	if err != nil {
		return 0, err
	}
	n, err := w.ResponseWriter.Write(p)
	w.settle(pw, err)
	w.bytes += int64(n)
	return n, err
}

// FlushError sends what the response holds (http.ResponseController's
// Flush), within its deadline.
func (w *statusWriter) FlushError() error {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if w.rc == nil {
		return http.NewResponseController(w.ResponseWriter).Flush()
	}
	pw, err := w.arm(heldOctets)
	if err != nil {
		return err
	}
	err = w.rc.Flush()
	w.settle(pw, err)
	return err
}

// Flush is http.Flusher's.
func (w *statusWriter) Flush() { w.FlushError() }

// SetWriteDeadline bounds the response's writes (http.ResponseController):
// with the minimum rate, each write's deadline is the sooner of this one
// and the rate's, and a deadline sooner than the one set applies at once,
// to a write under way too (from any goroutine: a role cutting a response
// short sets it to now).
func (w *statusWriter) SetWriteDeadline(t time.Time) error {
	if w.rc == nil {
		return http.NewResponseController(w.ResponseWriter).SetWriteDeadline(t)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.limit = t
	if t.IsZero() || (!w.set.IsZero() && !t.Before(w.set)) {
		return nil // the rate's deadline, sooner, stays
	}
	w.set = t
	return w.rc.SetWriteDeadline(t)
}

// Unwrap lets http.ResponseController reach the connection.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// authenticate returns the identity of the request's verified client
// certificate. The chain was verified at the handshake (mtls); the
// identity rules are applied again here, so no request passes without one,
// and so is the end of the validity period: a connection does not outlive
// its client's certificate (nor any certificate of its chain).
func authenticate(r *http.Request, now time.Time) (string, error) {
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		return "", fmt.Errorf("%w: no client certificate", kvsp.ErrForbidden)
	}
	id, err := mtls.Identity(r.TLS.PeerCertificates[0])
	if err != nil {
		return "", fmt.Errorf("%w: %v", kvsp.ErrForbidden, err)
	}
	for _, c := range r.TLS.PeerCertificates { // NotBefore was checked at the handshake
		if now.After(c.NotAfter) {
			return id, fmt.Errorf("%w: the client certificate has expired", kvsp.ErrForbidden)
		}
	}
	return id, nil
}

// wrap is the adapter: request id and logger, authentication and
// authorization against the current policy, body limit, deadline, the
// handler, then problem details for its error, metrics and a log line.
func (s *Server) wrap(pattern string, rt Route, h HandlerFunc) http.Handler {
	maxBody := rt.MaxBody
	if maxBody == 0 {
		maxBody = DefaultMaxBody
	}
	rm := s.metrics.forRoute(pattern)
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		start := s.now()
		id := newRequestID()
		rl := &requestLog{base: s.log, id: id}
		// log writes a line of kind through the flood limiter.
		log := func(level slog.Level, kind, msg string, args ...any) {
			if s.log.Enabled(r.Context(), level) {
				s.logs.log(r.Context(), rl.get(), level, kind, msg, args...)
			}
		}
		w := &statusWriter{ResponseWriter: rw}
		if s.altSvc != "" {
			w.Header().Set("Alt-Svc", s.altSvc)
		}
		// Every response, a refusal's problem too, is written within the
		// minimum rate: a client that does not read (an HTTP/2 window of
		// 0) has it cut and its handler's context ended.
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		if s.cfg.MinWriteRate > 0 {
			w.pace(s.cfg.MinWriteRate, s.cfg.WriteGrace, cancel, rm.slow)
		}
		var ident string
		err := func() (err error) {
			// A panic is a bug, not a reason to reset the client's stream:
			// it is logged with the peer and answered 500 (a response
			// already started is cut, as any failure mid-body).
			defer func() {
				v := recover()
				if v == nil || v == http.ErrAbortHandler {
					if v != nil {
						panic(v)
					}
					return
				}
				s.metrics.panics.WithLabelValues(pattern).Inc()
				log(slog.LevelWarn, "panic:"+pattern, "handler panicked", "route", pattern, "peer", r.RemoteAddr,
					"panic", truncate(fmt.Sprint(v), 200), "at", frames(debug.Stack()))
				err = fmt.Errorf("%w: the request could not be served (logged)", kvsp.ErrInternal)
			}()
			ident, err = authenticate(r, start)
			rl.ident = ident // named in the refusals below too
			if err != nil {
				return err
			}
			p := s.policy.Policy().Lookup(ident)
			if p == nil {
				return fmt.Errorf("%w: identity not in the policy", kvsp.ErrForbidden)
			}
			if len(rt.Roles) > 0 && !p.HasAny(rt.Roles...) {
				return fmt.Errorf("%w: role not allowed on this resource", kvsp.ErrForbidden)
			}
			ctx := context.WithValue(ctx, principalKey, p)
			ctx = context.WithValue(ctx, requestIDKey, id)
			ctx = context.WithValue(ctx, loggerKey, rl)
			if rt.Timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, rt.Timeout)
				defer cancel()
				w.SetWriteDeadline(start.Add(rt.Timeout))
				// The write deadline alone let one of B6's slow readers keep
				// its connection 5 s past it now and then (a write of the TLS
				// connection blocked past the deadline): an HTTP/1.1
				// connection whose handler is still running at the deadline
				// is cut from under it.
				if c, ok := r.Context().Value(connKey).(*tls.Conn); ok && r.ProtoMajor == 1 {
					cut := time.AfterFunc(rt.Timeout, func() { c.NetConn().Close() })
					defer cut.Stop()
				}
			}
			if maxBody < 0 {
				if r.ContentLength > 0 {
					return fmt.Errorf("%w: this resource takes no body", kvsp.ErrTooLarge)
				}
			} else {
				r.Body = http.MaxBytesReader(w, r.Body, maxBody)
			}
			return h(w, r.WithContext(ctx))
		}()
		if err == nil {
			err = w.timedOut() // a handler that ignored its write's error: cut all the same
		}
		if err != nil {
			if w.status != 0 {
				// The response was under way (a block stream): it cannot
				// become a problem; abort the stream so the client sees a
				// truncated body rather than a complete-looking one.
				s.metrics.aborted.WithLabelValues(pattern).Inc()
				log(slog.LevelInfo, "aborted:"+pattern, "response cut after it started", "route", pattern, "err", err)
				rm.observe(w.status, time.Since(start), w.bytes)
				if r.ProtoMajor == 1 && abortConn(w) {
					return
				}
				panic(http.ErrAbortHandler)
			}
			writeProblem(w, err, id)
		}
		if w.rc != nil { // what the response still holds goes out within the rate too
			w.arm(heldOctets)
		}
		elapsed := time.Since(start)
		rm.observe(w.status, elapsed, w.bytes)
		args := func() []any { // only for a line that is written
			return []any{"method", r.Method, "route", pattern, "status", w.status, "bytes", w.bytes, "duration_ms", elapsed.Milliseconds()}
		}
		switch {
		case err == nil:
			if s.log.Enabled(r.Context(), slog.LevelDebug) {
				rl.get().Debug("request", args()...) // routine traffic
			}
		case w.status >= 500:
			log(slog.LevelError, pattern+" "+ident+" "+errText(err), "request", append(args(), "err", errText(err))...)
		default: // refused: worth seeing, but a flood of one refusal from one identity is a few lines
			log(slog.LevelInfo, pattern+" "+ident+" "+errText(err), "request", append(args(), "err", errText(err))...)
		}
	})
}

// abortConn cuts an HTTP/1.1 response's connection at once. Letting
// net/http close it after http.ErrAbortHandler closes the TLS connection,
// whose close_notify alert waits up to 5 s for a peer that has stopped
// reading (crypto/tls's own deadline, which replaces the route's): a slow
// reader cut at its route's deadline held its connection that much longer
// (RELIABILITY B6, found failing at 8 s against a 3 s deadline).
func abortConn(w http.ResponseWriter) bool {
	c, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return false
	}
	if tc, ok := c.(*tls.Conn); ok {
		tc.NetConn().Close() // no close_notify: the response is cut, not ended
		return true
	}
	c.Close()
	return true
}

// frames is the stack of a recovered panic without the argument words
// (they could hold a request's data): function and file:line of the
// frames from where it panicked outwards, at most 12.
func frames(stack []byte) string {
	lines := strings.Split(strings.TrimSpace(string(stack)), "\n")
	var out []string
	from := 1 // after "goroutine N [running]:"
	for i := 1; i+1 < len(lines); i += 2 {
		if strings.HasPrefix(lines[i], "panic(") {
			from = i + 2 // the frames below the panic are the recovery's
		}
	}
	for i := from; i+1 < len(lines) && len(out) < 12; i += 2 {
		fn, file := lines[i], strings.TrimSpace(lines[i+1])
		if k := strings.LastIndexByte(fn, '('); k > 0 {
			fn = fn[:k]
		}
		if k := strings.LastIndex(file, " +0x"); k > 0 {
			file = file[:k]
		}
		out = append(out, fn+" "+file)
	}
	return strings.Join(out, "; ")
}

// truncate bounds a string written to the log.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// WriteProblem writes err as application/problem+json (RFC 9457, A-7) with
// Cache-Control: no-store (R-HTTP-10). A body over its limit is 413.
// Handlers return their errors instead; this is for code outside routes.
func WriteProblem(w http.ResponseWriter, r *http.Request, err error) {
	writeProblem(w, err, RequestID(r.Context()))
}

func writeProblem(w http.ResponseWriter, err error, id string) {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		err = fmt.Errorf("%w: request body over %d octets", kvsp.ErrTooLarge, mbe.Limit)
	}
	p := kvsp.ProblemFor(err)
	if id != "" && p.Instance == "" {
		p.Instance = "urn:kvsp:request:" + id
	}
	body, merr := kvsp.MarshalProblem(p)
	if merr != nil {
		body = []byte(`{"type":"about:blank","status":500}`)
		p.Status = http.StatusInternalServerError
	}
	h := w.Header()
	h.Del("Content-Length")
	h.Del("Repr-Digest")
	h.Set("Content-Type", kvsp.MediaTypeProblem)
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	if (p.Status == http.StatusTooManyRequests || p.Status == http.StatusServiceUnavailable) && h.Get("Retry-After") == "" {
		h.Set("Retry-After", "1") // both are for a while (RFC 9110 section 10.2.3); a client waits, not hammers
	}
	w.WriteHeader(p.Status)
	w.Write(body)
}

// WriteJSON writes a KVSP JSON response (application/kvsp+json,
// Cache-Control: no-store).
func WriteJSON(w http.ResponseWriter, status int, v any) error {
	body, err := kvsp.Marshal(v)
	if err != nil {
		return fmt.Errorf("server: encoding response: %w", err)
	}
	h := w.Header()
	h.Set("Content-Type", kvsp.MediaType)
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, err = w.Write(body)
	return err
}

// WriteJSONBody writes an already encoded KVSP JSON body (hand-written
// encoders on hot paths) with the headers of WriteJSON.
func WriteJSONBody(w http.ResponseWriter, status int, body []byte) error {
	h := w.Header()
	h.Set("Content-Type", kvsp.MediaType)
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, err := w.Write(body)
	return err
}

// NoContent writes a 204 with Cache-Control: no-store.
func NoContent(w http.ResponseWriter) error {
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// DecodeJSON reads a request body of media type application/kvsp+json
// (415 otherwise, A-29) within the route's limit (413) into v, strictly,
// and validates it (400).
func DecodeJSON(r *http.Request, v kvsp.Validator) error {
	if err := RequireMediaType(r, kvsp.MediaType); err != nil {
		return err
	}
	bb := requestBodies.Get()
	defer func() {
		if cap(bb.B) <= maxPooledBody {
			requestBodies.Put(bb)
		}
	}()
	bb.B = bb.B[:0]
	if r.ContentLength > 0 && r.ContentLength <= maxPooledBody {
		bb.B = slices.Grow(bb.B, int(r.ContentLength)+1) // +1: the read that sees EOF needs no growth
	}
	if _, err := bb.ReadFrom(r.Body); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return err
		}
		return fmt.Errorf("%w: reading body: %v", kvsp.ErrInvalid, err)
	}
	// Decoders copy what they keep: the buffer goes back to the pool.
	return kvsp.Decode(bb.B, v)
}

// requestBodies recycles request body buffers up to maxPooledBody
// (bytebufferpool: new ones sized to the bodies most often seen).
var requestBodies bytebufferpool.Pool

const maxPooledBody = 1 << 20

// RequireMediaType checks the request's Content-Type (parameters allowed).
func RequireMediaType(r *http.Request, want string) error {
	ct := r.Header.Get("Content-Type")
	if ct == want { // the common case, without parsing
		return nil
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil || !strings.EqualFold(mt, want) {
		return fmt.Errorf("%w: want Content-Type %s", kvsp.ErrUnsupportedMediaType, want)
	}
	return nil
}

package server

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// logInterval and logBurst bound what a flood writes to the log: at most
// logBurst lines of one kind per interval, then one line saying how many
// were left out (the metrics count every one). Routine traffic is logged
// at debug; refusals at info, failures at error, so that a line at info
// or above is worth an operator's eye (issue: one INFO line per status PUT
// every second drowned the rest).
const (
	logInterval = 10 * time.Second
	logBurst    = 3
	maxLogKinds = 1024 // kinds tracked at once; beyond it the table starts over
)

// limiter decides which lines of each kind are written.
type limiter struct {
	mu    sync.Mutex
	now   func() time.Time
	kinds map[string]*logKind
}

type logKind struct {
	start      time.Time
	n          int // lines of this kind since start
	suppressed int
}

func newLimiter(now func() time.Time) *limiter {
	return &limiter{now: now, kinds: map[string]*logKind{}}
}

// allow reports whether a line of kind is written now, and how many lines
// of that kind the previous interval left out (to be said once).
func (l *limiter) allow(kind string) (ok bool, leftOut int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	k := l.kinds[kind]
	if k == nil {
		if len(l.kinds) >= maxLogKinds {
			clear(l.kinds)
		}
		k = &logKind{start: now}
		l.kinds[kind] = k
	}
	if now.Sub(k.start) >= logInterval {
		leftOut = k.suppressed
		k.start, k.n, k.suppressed = now, 0, 0
	}
	if k.n >= logBurst {
		k.suppressed++
		return false, 0
	}
	k.n++
	return true, leftOut
}

// log writes a line of kind at level through the limiter.
func (l *limiter) log(ctx context.Context, log *slog.Logger, level slog.Level, kind, msg string, args ...any) {
	if !log.Enabled(ctx, level) {
		return
	}
	ok, left := l.allow(kind)
	if !ok {
		return
	}
	if left > 0 {
		args = append(args, "left_out", left, "left_out_within", logInterval.String())
	}
	log.Log(ctx, level, msg, args...)
}

// errorLog is net/http's ErrorLog, as slog lines: a refused TLS handshake
// is a warning that names the peer and the reason (S1), counted, and
// limited like any flood; so is a failed accept. The rest of what
// net/http and its HTTP/2 server say (clients that went away, frames a
// peer got wrong) is at debug.
type errorLog struct {
	s *Server
}

func (e errorLog) Write(p []byte) (int, error) {
	line := string(bytes.TrimSpace(p))
	log := e.s.log
	switch {
	case strings.HasPrefix(line, "http: TLS handshake error from "):
		rest := strings.TrimPrefix(line, "http: TLS handshake error from ")
		peer, reason, _ := strings.Cut(rest, ": ")
		kind := handshakeKind(reason)
		e.s.metrics.handshakes.WithLabelValues(kind).Inc()
		e.s.logs.log(context.Background(), log, slog.LevelWarn, "tls:"+reason, "TLS handshake refused", "peer", peer, "reason", reason)
	case strings.Contains(line, "Accept error"):
		e.s.logs.log(context.Background(), log, slog.LevelWarn, "accept", "accept failed", "err", line)
	default:
		log.Debug(line)
	}
	return len(p), nil
}

// handshakeKind is a refused handshake's reason as a metric label (a small
// fixed set).
func handshakeKind(reason string) string {
	switch {
	case strings.Contains(reason, "EOF") || strings.Contains(reason, "reset by peer") || strings.Contains(reason, "timeout"):
		return "aborted"
	case strings.Contains(reason, "version") || strings.Contains(reason, "protocol") || strings.Contains(reason, "first record does not look like"):
		return "protocol"
	case strings.Contains(reason, "certificate") || strings.Contains(reason, "mtls:") || strings.Contains(reason, "SAN") || strings.Contains(reason, "key usage"):
		return "certificate"
	}
	return "other"
}

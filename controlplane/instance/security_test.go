package instance_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
)

// isRecorder keeps every exchange the IS serves: URL, headers and bodies
// both ways.
type isRecorder struct {
	mu        sync.Mutex
	exchanges []isExchange
}

type isExchange struct {
	route     string
	url       string
	header    http.Header
	req, resp []byte
	respHdr   http.Header
}

type teeWriter struct {
	http.ResponseWriter
	buf bytes.Buffer
}

func (t *teeWriter) Write(p []byte) (int, error) { t.buf.Write(p); return t.ResponseWriter.Write(p) }

func (r *isRecorder) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		body, _ := io.ReadAll(q.Body)
		q.Body = io.NopCloser(bytes.NewReader(body))
		tw := &teeWriter{ResponseWriter: w}
		h.ServeHTTP(tw, q)
		r.mu.Lock()
		r.exchanges = append(r.exchanges, isExchange{route: q.Method + " " + q.URL.Path, url: q.URL.String(), header: q.Header.Clone(),
			req: body, resp: tw.buf.Bytes(), respHdr: w.Header().Clone()})
		r.mu.Unlock()
	})
}

// lockedBuffer is a log sink.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}
func (l *lockedBuffer) Bytes() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return bytes.Clone(l.b.Bytes())
}

// keyForms are the encodings a scope key could leak in: raw, hex (both
// cases), base64 and base64url, padded or not.
func keyForms(key []byte) map[string][]byte {
	return map[string][]byte{
		"raw":               key,
		"hex":               []byte(hex.EncodeToString(key)),
		"HEX":               []byte(strings.ToUpper(hex.EncodeToString(key))),
		"base64":            []byte(base64.StdEncoding.EncodeToString(key)),
		"base64 unpadded":   []byte(base64.RawStdEncoding.EncodeToString(key)),
		"base64url":         []byte(base64.URLEncoding.EncodeToString(key)),
		"base64url unpadd.": []byte(base64.RawURLEncoding.EncodeToString(key)),
	}
}

// leak names the first form of key found in b ("" if none).
func leak(forms map[string][]byte, b []byte) string {
	for name, f := range forms {
		if bytes.Contains(b, f) {
			return name
		}
	}
	return ""
}

// TestS7_ScopeKeyNeverReachesTheIS (RELIABILITY S7; spec Privacy, R-PRV-*):
// the whole flow runs (holders publish, the PC places and looks up, the
// instance prefetches, generates a top-p session with checkpoints and
// offloads and publishes its blocks) with the IS behind a recorder. No
// URL, header or body the IS received or sent, no log line of any role
// (the IS, the PC, the holders, the instance; every server's request
// lines; at debug level) and no metric (names and labels) of the IS, the
// PC or the instance holds the scope key in raw, hex, base64 or base64url
// form. Paired checks keep the test honest: the recorded traffic has
// publishes and lookups carrying the scope_id, every role wrote log lines,
// and the scanner finds the key when it is planted.
func TestS7_ScopeKeyNeverReachesTheIS(t *testing.T) {
	rec := &isRecorder{}
	logs, roleLogs := &lockedBuffer{}, &lockedBuffer{}
	ctlReg := prometheus.NewRegistry()
	debug := &slog.HandlerOptions{Level: slog.LevelDebug}
	w := newRig(t, rigOptions{wrapIS: rec.wrap, ctlReg: ctlReg,
		ctlLog: slog.New(slog.NewJSONHandler(logs, debug)), roleLog: slog.New(slog.NewJSONHandler(roleLogs, debug))})
	w.runAgents(t, "/ii1/")
	tokens := prompt(3)
	w.fill(t, tokens, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: tokens, MaxTokens: 64,
		Sampler: &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: 7}}
	var got int
	if _, err := w.front.RunSession(ctx, w.front.Controller(w.url("/pc/")), q, 50*time.Millisecond, func(uint64, uint32) error { got++; return nil }); err != nil || got != 64 {
		t.Fatalf("session: %d tokens, %v", got, err)
	}
	// The instance's blocks (prompt and generated) reach the IS through
	// its holder.
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, tokens)
	w.waitPublished(t, keys[:3], w.url("/h1/"))

	forms := keyForms(w.scopeKey.Export())
	scopeID := []byte(w.scopeKey.ID().String())
	rec.mu.Lock()
	exchanges := append([]isExchange(nil), rec.exchanges...)
	rec.mu.Unlock()
	routes := map[string]int{}
	withScopeID := 0
	for _, x := range exchanges {
		routes[x.route[:strings.IndexByte(x.route, ' ')]+" "+lastSegment(x.route)]++
		var all bytes.Buffer
		fmt.Fprintf(&all, "%s\n%v\n%v\n", x.url, x.header, x.respHdr)
		all.Write(x.req)
		all.Write(x.resp)
		if f := leak(forms, all.Bytes()); f != "" {
			t.Errorf("the scope key (%s) reached the IS in %s", f, x.route)
		}
		if bytes.Contains(all.Bytes(), scopeID) {
			withScopeID++
		}
	}
	if routes["PUT replicas"] == 0 && routes["POST replicas"] == 0 || routes["POST lookup"] == 0 || withScopeID == 0 {
		t.Fatalf("the recorder saw too little to prove anything: %v, %d exchanges with the scope_id", routes, withScopeID)
	}
	if f := leak(forms, logs.Bytes()); f != "" {
		t.Errorf("the scope key (%s) is in the IS's or the PC's logs, or a server's request lines", f)
	}
	if f := leak(forms, roleLogs.Bytes()); f != "" {
		t.Errorf("the scope key (%s) is in the holders' or the instance's logs", f)
	}
	if len(logs.Bytes()) == 0 || len(roleLogs.Bytes()) == 0 {
		t.Fatalf("logs scanned: %d octets (IS, PC, servers), %d (holders, instance): a role that wrote nothing proves nothing", len(logs.Bytes()), len(roleLogs.Bytes()))
	}
	for name, g := range map[string]prometheus.Gatherer{"IS and PC": ctlReg, "instance": w.reg} {
		mfs, err := g.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		for _, mf := range mfs {
			b.WriteString(mf.String())
		}
		if b.Len() == 0 {
			t.Fatalf("%s: no metrics gathered", name)
		}
		if f := leak(forms, b.Bytes()); f != "" {
			t.Errorf("the scope key (%s) is in the %s metrics", f, name)
		}
	}
	// The scanner finds a planted key in every form.
	for name, f := range forms {
		planted := append(append(bytes.Clone(exchanges[0].req), ' '), f...)
		if leak(map[string][]byte{name: f}, planted) == "" {
			t.Fatalf("the scanner misses the %s form", name)
		}
	}
	t.Logf("%d IS exchanges scanned (%v), %d + %d octets of logs", len(exchanges), routes, len(logs.Bytes()), len(roleLogs.Bytes()))
}

func lastSegment(route string) string {
	p := strings.TrimSuffix(route, "/")
	seg := p[strings.LastIndexByte(p, '/')+1:]
	if len(seg) > 20 { // an identifier: the resource is the segment before
		p = p[:strings.LastIndexByte(p, '/')]
		for len(seg) > 20 && strings.Contains(p, "/") {
			seg, p = p[strings.LastIndexByte(p, '/')+1:], p[:strings.LastIndexByte(p, '/')]
		}
	}
	return seg
}

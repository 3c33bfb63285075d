package server_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"golang.org/x/net/http2"

	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// TestMinimumWriteRate (RELIABILITY B11, the server's part): every
// response is written at server.Config.MinWriteRate after WriteGrace, on
// each protocol the server speaks.
//
//   - A token stream (a line every 50 ms, flushed, for 1.5 s: five times
//     the grace) read by its client is never cut, over HTTP/2, HTTP/1.1 and
//     HTTP/3: the time its handler spends producing does not count.
//   - The same stream, and a 16 MiB body written in 64 KiB writes, to an
//     HTTP/2 client that grants no window (SETTINGS_INITIAL_WINDOW_SIZE
//     0): each stream is reset (CANCEL) within the grace plus a write's
//     octets at the rate, plus slack, and the handler's context ends,
//     although the body's handler ignores its writes' errors.
//   - The body to an HTTP/1.1 client that reads nothing: its connection is
//     closed and the handler's context ends (net/http ends it at the
//     socket write's error).
//   - The body to an HTTP/3 client that reads nothing (quic-go's flow
//     control, a 64 KiB stream window): quic-go's stream write deadline
//     (http3's ResponseController) fails the write, the handler's context
//     ends with server.ErrSlowReader and the stream is reset.
func TestMinimumWriteRate(t *testing.T) {
	const (
		grace = 300 * time.Millisecond
		rate  = 1 << 20 // octets/s: a 64 KiB write's own allowance is 62 ms
		slack = 2 * time.Second
	)
	type end struct {
		proto string
		cause error // context.Cause of the handler's context (nil: it did not end)
		took  time.Duration
	}
	ends := make(chan end, 16)
	reg := prometheus.NewRegistry()
	p := kvsptest.NewPKI(t)
	s := kvsptest.StartServer(t, p, kvsptest.Options{HTTP3: true, Registerer: reg, MinWriteRate: rate, WriteGrace: grace}, func(s *server.Server) {
		r := s.Mount("/w/")
		r.Handle("GET", "tokens", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
			w.Header().Set("Content-Type", "application/jsonl")
			rc := http.NewResponseController(w)
			for i := range 30 {
				if _, err := fmt.Fprintf(w, `{"index":%d,"token":"tok"}`+"\n", i); err != nil {
					return err
				}
				if err := rc.Flush(); err != nil {
					return err
				}
				time.Sleep(50 * time.Millisecond)
			}
			return nil
		})
		r.Handle("GET", "body", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
			start := time.Now()
			w.Header().Set("Content-Type", "application/octet-stream")
			chunk := make([]byte, 64<<10)
			for range 256 {
				w.Write(chunk) // errors ignored: the handler ends by its context alone
			}
			select {
			case <-req.Context().Done():
				ends <- end{req.Proto, context.Cause(req.Context()), time.Since(start)}
			case <-time.After(10 * time.Second):
				ends <- end{req.Proto, nil, time.Since(start)}
			}
			return nil
		})
	})
	leaf := p.Leaf(kvsptest.ClientA)
	slow := func(route string) float64 {
		return kvsptest.MetricSum(t, reg, "kvsp_http_slow_reader_responses_total", map[string]string{"route": "GET /w/" + route})
	}
	waitEnd := func(t *testing.T, proto string, limit time.Duration) end {
		t.Helper()
		select {
		case e := <-ends:
			if e.proto != proto || e.cause == nil {
				t.Fatalf("%s: the handler's context did not end (%v after %v)", e.proto, e.cause, e.took)
			}
			if e.took > limit {
				t.Errorf("%s: the handler's context ended after %v, want within %v", proto, e.took, limit)
			}
			return e
		case <-time.After(limit + 10*time.Second):
			t.Fatalf("%s: the handler never ended", proto)
		}
		return end{}
	}

	t.Run("a slow producer is never cut", func(t *testing.T) {
		h1 := p.ClientTLS(leaf)
		h1.NextProtos = []string{"http/1.1"}
		h3 := &http3.Transport{TLSClientConfig: p.ClientTLS(leaf)}
		defer h3.Close()
		for name, rt := range map[string]http.RoundTripper{
			"HTTP/2.0": &http.Transport{TLSClientConfig: p.ClientTLS(leaf), ForceAttemptHTTP2: true},
			"HTTP/1.1": &http.Transport{TLSClientConfig: h1},
			"HTTP/3.0": h3,
		} {
			if tr, ok := rt.(*http.Transport); ok {
				defer tr.CloseIdleConnections()
			}
			resp, body, err := get(&http.Client{Transport: rt, Timeout: 10 * time.Second}, "GET", s.URL("/w/tokens"), "", "")
			if err != nil || resp.StatusCode != 200 || resp.Proto != name {
				t.Fatalf("%s: %v %v", name, resp, err)
			}
			if n := strings.Count(string(body), "\n"); n != 30 {
				t.Fatalf("%s: %d lines of 30: the stream was cut", name, n)
			}
		}
		if n := slow("tokens"); n != 0 {
			t.Fatalf("%v token streams cut for a slow reader", n)
		}
	})

	t.Run("HTTP/2 without window", func(t *testing.T) {
		h := dialH2(t, s.Addr, p.ClientTLS(leaf), http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
		defer h.c.Close()
		start := time.Now()
		for i, path := range []string{"/w/body", "/w/tokens"} {
			if err := h.write(func(fr *http2.Framer) error {
				return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: requestBlock(path), EndStream: true, EndHeaders: true})
			}); err != nil {
				t.Fatal(err)
			}
		}
		for range 2 {
			select {
			case rst := <-h.resets:
				if rst.ErrCode != http2.ErrCodeCancel {
					t.Errorf("stream %d reset with %v, want CANCEL", rst.StreamID, rst.ErrCode)
				}
				if d := time.Since(start); d > grace+slack {
					t.Errorf("stream %d reset after %v, want within %v", rst.StreamID, d, grace+slack)
				}
			case <-time.After(grace + slack + 5*time.Second):
				t.Fatal("a stream without window was never reset")
			}
		}
		waitEnd(t, "HTTP/2.0", grace+slack)
		if n := slow("body") + slow("tokens"); n != 2 {
			t.Errorf("%v responses counted cut for a slow reader, want 2", n)
		}
	})

	t.Run("HTTP/1.1 not read", func(t *testing.T) {
		conf := p.ClientTLS(leaf)
		conf.NextProtos = []string{"http/1.1"}
		c, err := tls.Dial("tcp", s.Addr, conf)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "GET /w/body HTTP/1.1\r\nHost: x\r\n\r\n")
		waitEnd(t, "HTTP/1.1", grace+slack) // net/http ends it first, at the write's error (context.Canceled)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.Copy(io.Discard, bufio.NewReader(c)); err == nil || strings.Contains(err.Error(), "timeout") {
			t.Errorf("the connection of a response cut was not closed: %v", err)
		}
	})

	t.Run("HTTP/3 not read", func(t *testing.T) {
		tr := &http3.Transport{TLSClientConfig: p.ClientTLS(leaf), QUICConfig: &quic.Config{InitialStreamReceiveWindow: 64 << 10, MaxStreamReceiveWindow: 64 << 10}}
		defer tr.Close()
		resp, err := (&http.Client{Transport: tr}).Get(s.URL("/w/body"))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		e := waitEnd(t, "HTTP/3.0", grace+slack)
		if !errors.Is(e.cause, server.ErrSlowReader) {
			t.Errorf("the handler's context ended with %v, want server.ErrSlowReader", e.cause)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		var se *quic.StreamError
		if !errors.As(err, &se) {
			t.Errorf("the body read %d octets, then %v; want the stream reset", n, err)
		}
	})
	t.Logf("responses cut for a slow reader: body %v, tokens %v", slow("body"), slow("tokens"))
}

package server_test

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// h2conn is a raw HTTP/2 client connection driven frame by frame.
type h2conn struct {
	c   *tls.Conn
	fr  *http2.Framer
	wmu sync.Mutex // the Framer's writes: the test's and the reader's ACKs

	maxStreams atomic.Uint32 // the server's SETTINGS_MAX_CONCURRENT_STREAMS
	settings   chan struct{} // closed at the server's first SETTINGS
	goAway     atomic.Pointer[http2.GoAwayFrame]
	resets     chan http2.RSTStreamFrame // the server's RST_STREAMs (while there is room)
	done       chan struct{}             // closed when the server ends the connection
	readErr    error
}

func dialH2(t *testing.T, addr string, conf *tls.Config, settings ...http2.Setting) *h2conn {
	t.Helper()
	conf = conf.Clone()
	conf.NextProtos = []string{"h2"}
	c, err := tls.Dial("tcp", addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	if p := c.ConnectionState().NegotiatedProtocol; p != "h2" {
		t.Fatalf("ALPN %q, want h2", p)
	}
	h := &h2conn{c: c, fr: http2.NewFramer(c, c), settings: make(chan struct{}), resets: make(chan http2.RSTStreamFrame, 1024), done: make(chan struct{})}
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	if err := h.fr.WriteSettings(settings...); err != nil {
		t.Fatal(err)
	}
	go h.read()
	select {
	case <-h.settings:
	case <-time.After(5 * time.Second):
		t.Fatal("no SETTINGS from the server")
	}
	return h
}

func (h *h2conn) read() {
	defer close(h.done)
	first := true
	for {
		f, err := h.fr.ReadFrame()
		if err != nil {
			h.readErr = err
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
			if v, ok := f.Value(http2.SettingMaxConcurrentStreams); ok {
				h.maxStreams.Store(v)
			}
			h.wmu.Lock()
			h.fr.WriteSettingsAck()
			h.wmu.Unlock()
			if first {
				first = false
				close(h.settings)
			}
		case *http2.GoAwayFrame:
			g := *f
			h.goAway.Store(&g)
		case *http2.RSTStreamFrame:
			select {
			case h.resets <- *f:
			default:
			}
		}
	}
}

// write runs fn on the Framer unless the server has ended the connection.
func (h *h2conn) write(fn func(fr *http2.Framer) error) error {
	select {
	case <-h.done:
		return io.EOF
	default:
	}
	h.wmu.Lock()
	defer h.wmu.Unlock()
	return fn(h.fr)
}

func (h *h2conn) closed(d time.Duration) bool {
	select {
	case <-h.done:
		return true
	case <-time.After(d):
		return false
	}
}

func requestBlock(path string) []byte {
	var b bytes.Buffer
	enc := hpack.NewEncoder(&b)
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", "127.0.0.1"}, {":path", path}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	return b.Bytes()
}

// TestB7_HTTP2RapidResetAndContinuationFlood is row B7 of RELIABILITY.md,
// with golang.org/x/net/http2.Framer as the attacking client.
//
// Rapid reset (CVE-2023-39325): 10^4 streams are opened and reset at once,
// on a route whose handler takes 20 ms and ignores cancellation (the
// worst case). The number of handlers running at once never exceeds the
// server's advertised SETTINGS_MAX_CONCURRENT_STREAMS, the process's
// goroutines stay within that bound of their baseline, the server may
// close the connection (ENHANCE_YOUR_CALM) and the attack reconnects;
// afterwards goroutines return to baseline and a normal request is served.
//
// CONTINUATION flood (CVE-2023-45288): one HEADERS frame without
// END_HEADERS, then CONTINUATION frames of header data, far past
// MaxHeaderBytes. The server closes the connection (GOAWAY, then EOF)
// before it has taken 1 MiB. A run of 10^5 empty CONTINUATION frames costs
// the server only the octets it reads (net/http bounds header data, not
// frames): goroutines stay bounded and other clients are served.
//
// KVSP_NET_HTTP2=1 runs it against net/http's HTTP/2 server instead of
// internal/h2 (for comparison).
//
// govulncheck, the row's third check, needs its vulnerability database,
// which these machines cannot reach; it is not run here.
func TestB7_HTTP2RapidResetAndContinuationFlood(t *testing.T) {
	const (
		streams = 10_000
		hold    = 20 * time.Millisecond
		slack   = 64 // goroutines: connections, the sampler, the runtime
		// maxStreamsCap bounds what the server may advertise: with it,
		// 10^4 resets cannot become 10^4 goroutines.
		maxStreamsCap = 1000
	)
	var running, peakRunning atomic.Int64
	p := kvsptest.NewPKI(t)
	r := startRig(t, p, rigOptions{NetHTTP2: os.Getenv("KVSP_NET_HTTP2") == "1"}, func(s *server.Server) {
		echoRoutes(s)
		s.Mount("/f/").Handle("GET", "hold", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
			n := running.Add(1)
			for {
				m := peakRunning.Load()
				if n <= m || peakRunning.CompareAndSwap(m, n) {
					break
				}
			}
			time.Sleep(hold) // ignores the reset on purpose
			running.Add(-1)
			return server.NoContent(w)
		})
	})
	conf := p.ClientTLS(p.Leaf(kvsptest.ClientA))
	probe := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: conf.Clone(), ForceAttemptHTTP2: true})
	served := func(when string) {
		t.Helper()
		if resp, _, err := get(probe, "GET", r.URL("/t/any"), "", ""); err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: a normal request was not served: %v %v", when, resp, err)
		}
	}
	served("before")
	// The probe's connection goes before each count: its idle handler
	// workers (at most 16, kept while it is open) are not a leak.
	probe.CloseIdleConnections()
	base := kvsptest.QuietGoroutines()

	// A sampler of the process's goroutines.
	var peakG atomic.Int64
	stopSampler := make(chan struct{})
	samplerDone := make(chan struct{})
	go func() {
		defer close(samplerDone)
		for {
			peakG.Store(max(peakG.Load(), int64(runtime.NumGoroutine())))
			select {
			case <-stopSampler:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()

	t.Run("rapid reset", func(t *testing.T) {
		hdr := requestBlock("/f/hold")
		sent, conns, calm := 0, 0, 0
		var maxStreams uint32
		start := time.Now()
		for sent < streams {
			h := dialH2(t, r.Addr, conf)
			conns++
			maxStreams = h.maxStreams.Load()
			for id := uint32(1); sent < streams; id += 2 {
				err := h.write(func(fr *http2.Framer) error {
					if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hdr, EndStream: true, EndHeaders: true}); err != nil {
						return err
					}
					return fr.WriteRSTStream(id, http2.ErrCodeCancel)
				})
				if err != nil {
					break
				}
				sent++
			}
			if g := h.goAway.Load(); g != nil && g.ErrCode == http2.ErrCodeEnhanceYourCalm {
				calm++
			}
			h.c.Close()
			<-h.done
		}
		if maxStreams == 0 || maxStreams > maxStreamsCap {
			t.Errorf("the server advertised SETTINGS_MAX_CONCURRENT_STREAMS %d, want 1..%d", maxStreams, maxStreamsCap)
		}
		for end := time.Now().Add(5 * time.Second); running.Load() > 0 && time.Now().Before(end); {
			time.Sleep(5 * time.Millisecond)
		}
		t.Logf("%d streams opened and reset in %v over %d connections (%d closed with ENHANCE_YOUR_CALM); MAX_CONCURRENT_STREAMS %d; peak handlers %d; goroutines: baseline %d, peak %d",
			sent, time.Since(start).Round(time.Millisecond), conns, calm, maxStreams, peakRunning.Load(), base, peakG.Load())
		if n := peakRunning.Load(); n > int64(maxStreams) {
			t.Errorf("%d handlers ran at once, more than MAX_CONCURRENT_STREAMS %d", n, maxStreams)
		}
		if n, bound := peakG.Load(), int64(base)+int64(min(maxStreams, maxStreamsCap))+slack; n > bound {
			t.Errorf("goroutines peaked at %d, above baseline %d + MAX_CONCURRENT_STREAMS %d (at most %d) + %d", n, base, maxStreams, maxStreamsCap, slack)
		}
		figures.Report(t, figures.Row{Row: "B7", Inputs: int64(sent),
			Held:   fmt.Sprintf("%d streams opened and reset: at most %d handlers at once (MAX_CONCURRENT_STREAMS %d); CONTINUATION floods closed with GOAWAY", sent, peakRunning.Load(), maxStreams),
			Detail: map[string]float64{"reset_streams": float64(sent), "peak_handlers": float64(peakRunning.Load())}})
	})

	t.Run("CONTINUATION flood", func(t *testing.T) {
		var b bytes.Buffer
		b.Write(requestBlock("/t/any"))
		enc := hpack.NewEncoder(&b)
		value := strings.Repeat("a", 1000)
		for b.Len() < 4<<20 { // 4 MiB of header data
			enc.WriteField(hpack.HeaderField{Name: "x-flood", Value: value, Sensitive: true})
		}
		block := b.Bytes()
		const frag = 16 << 10
		h := dialH2(t, r.Addr, conf)
		defer h.c.Close()
		taken := 0
		err := h.write(func(fr *http2.Framer) error {
			return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block[:frag], EndStream: true})
		})
		for off := frag; err == nil && off < len(block); off += frag {
			taken = off
			end := min(off+frag, len(block))
			err = h.write(func(fr *http2.Framer) error { return fr.WriteContinuation(1, end == len(block), block[off:end]) })
		}
		if !h.closed(5 * time.Second) {
			t.Fatalf("the connection is open after %d octets of header data", len(block))
		}
		select {
		case <-r.ServerClosed(h.c.LocalAddr().String()):
		case <-time.After(5 * time.Second):
			t.Fatal("the server did not close its side")
		}
		read := r.ServerRead(h.c.LocalAddr().String())
		g := h.goAway.Load()
		t.Logf("the server read %d octets and closed; the client wrote %d octets of header data (%v); GOAWAY: %v", read, taken, err, goAwayCode(g))
		if g == nil {
			t.Error("closed without a GOAWAY")
		} else if g.ErrCode == http2.ErrCodeNo {
			t.Errorf("GOAWAY %v, want an error code", g.ErrCode)
		}
		if read > 1<<20 {
			t.Errorf("the server read %d octets of the flood before closing, want < 1 MiB", read)
		}
		served("after the flood")
	})

	t.Run("empty CONTINUATION frames", func(t *testing.T) {
		h := dialH2(t, r.Addr, conf)
		defer h.c.Close()
		hdr := requestBlock("/t/any")
		err := h.write(func(fr *http2.Framer) error {
			return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr, EndStream: true})
		})
		n := 0
		for ; err == nil && n < 100_000; n++ {
			err = h.write(func(fr *http2.Framer) error { return fr.WriteContinuation(1, false, nil) })
		}
		served("during a run of empty CONTINUATION frames")
		t.Logf("%d empty CONTINUATION frames written (%v); connection closed: %v", n, err, h.closed(0))
		if err != nil && !errors.Is(err, io.EOF) && !h.closed(time.Second) {
			t.Errorf("write failed (%v) on an open connection", err)
		}
	})

	close(stopSampler)
	<-samplerDone
	served("after the attacks")
	probe.CloseIdleConnections()
	if n := kvsptest.SettleGoroutines(base, 5*time.Second); n > base {
		t.Errorf("%d goroutines after the attacks, baseline %d", n, base)
	}
}

func goAwayCode(g *http2.GoAwayFrame) string {
	if g == nil {
		return "none"
	}
	return g.ErrCode.String()
}

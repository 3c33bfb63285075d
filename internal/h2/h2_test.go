package h2_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/kvsp/kvsp/internal/h2"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// selfSigned is a server certificate for 127.0.0.1.
func selfSigned(t testing.TB) (tls.Certificate, *x509.CertPool) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "h2 test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}, pool
}

// testServer is an http.Server on loopback TLS whose HTTP/2 is the
// package's.
type testServer struct {
	addr string
	hs   *http.Server
	pool *x509.CertPool
}

func startServer(t testing.TB, cfg h2.Config, h http.Handler) *testServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cert, pool := selfSigned(t)
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ErrorLog: log.New(io.Discard, "", 0)}
	h2.New(cfg).Configure(hs)
	done := make(chan struct{})
	go func() { defer close(done); hs.Serve(tls.NewListener(ln, tc)) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := hs.Shutdown(ctx); err != nil {
			hs.Close()
		}
		<-done
	})
	return &testServer{addr: ln.Addr().String(), hs: hs, pool: pool}
}

// client is net/http's HTTP/2 client with bulk windows, as kvsp's.
func (s *testServer) client(t testing.TB) *http.Client {
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: s.pool, NextProtos: []string{"h2"}}, ForceAttemptHTTP2: true,
		HTTP2: &http.HTTP2Config{MaxReadFrameSize: 1 << 20, MaxReceiveBufferPerConnection: 3 << 20, MaxReceiveBufferPerStream: 3 << 20}}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

func (s *testServer) url(path string) string { return "https://" + s.addr + path }

// rawConn is a client connection driven frame by frame.
type rawConn struct {
	t  testing.TB
	c  *tls.Conn
	fr *http2.Framer
	mu sync.Mutex // writes
}

func (s *testServer) raw(t testing.TB, settings ...http2.Setting) *rawConn {
	t.Helper()
	c, err := tls.Dial("tcp", s.addr, &tls.Config{RootCAs: s.pool, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	rc := &rawConn{t: t, c: c, fr: http2.NewFramer(c, c)}
	rc.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	io.WriteString(c, http2.ClientPreface)
	rc.fr.WriteSettings(settings...)
	return rc
}

func (rc *rawConn) request(id uint32, method, path string, end bool, extra ...string) {
	rc.t.Helper()
	if err := rc.tryRequest(id, method, path, end, extra...); err != nil {
		rc.t.Fatal(err)
	}
}

func (rc *rawConn) tryRequest(id uint32, method, path string, end bool, extra ...string) error {
	var b bytes.Buffer
	enc := hpack.NewEncoder(&b)
	for _, f := range [][2]string{{":method", method}, {":scheme", "https"}, {":authority", "127.0.0.1"}, {":path", path}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	for i := 0; i+1 < len(extra); i += 2 {
		enc.WriteField(hpack.HeaderField{Name: extra[i], Value: extra[i+1]})
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: b.Bytes(), EndStream: end, EndHeaders: true})
}

// next reads frames until one for which keep returns true, answering
// the server's SETTINGS; it fails the test after d.
func (rc *rawConn) next(d time.Duration, keep func(http2.Frame) bool) http2.Frame {
	rc.t.Helper()
	rc.c.SetReadDeadline(time.Now().Add(d))
	defer rc.c.SetReadDeadline(time.Time{})
	var seen []string
	for {
		f, err := rc.fr.ReadFrame()
		if err != nil {
			rc.t.Fatalf("reading frames: %v (after %v)", err, seen)
		}
		seen = append(seen, fmt.Sprint(f.Header()))
		if sf, ok := f.(*http2.SettingsFrame); ok && !sf.IsAck() {
			rc.mu.Lock()
			rc.fr.WriteSettingsAck()
			rc.mu.Unlock()
		}
		if keep(f) {
			return f
		}
	}
}

var block = func() []byte { // 8 MiB, not a repetition of anything short
	b := make([]byte, 8<<20)
	for i := range b {
		b[i] = byte(i*7 + i>>11)
	}
	return b
}()

func blockHandler(n int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(n))
		w.Write(block[:n])
	}
}

// TestGetAndPutBodies: bodies of every size class cross intact both
// ways, over one connection with concurrent streams, through windows far
// smaller than the bodies.
func TestGetAndPutBodies(t *testing.T) {
	for _, cfg := range []h2.Config{{}, {StreamWindow: 65535, ConnWindow: 65535, MaxReadFrameSize: 16 << 10}} {
		t.Run(fmt.Sprintf("window=%d", cfg.StreamWindow), func(t *testing.T) {
			mux := http.NewServeMux()
			mux.HandleFunc("GET /b/{n}", func(w http.ResponseWriter, r *http.Request) {
				n, _ := strconv.Atoi(r.PathValue("n"))
				blockHandler(n)(w, r)
			})
			mux.HandleFunc("PUT /sum", func(w http.ResponseWriter, r *http.Request) {
				h := sha256.New()
				n, err := io.Copy(h, r.Body)
				if err != nil {
					http.Error(w, err.Error(), 400)
					return
				}
				fmt.Fprintf(w, "%d %x", n, h.Sum(nil))
			})
			s := startServer(t, cfg, mux)
			c := s.client(t)
			sizes := []int{0, 1, 16375, 16384, 100_000, 1 << 20, 2<<20 + 17, 8 << 20}
			var wg sync.WaitGroup
			for i, n := range sizes {
				wg.Go(func() {
					resp, err := c.Get(s.url("/b/" + strconv.Itoa(n)))
					if err != nil {
						t.Error(err)
						return
					}
					defer resp.Body.Close()
					got, err := io.ReadAll(resp.Body)
					if err != nil || resp.ProtoMajor != 2 || !bytes.Equal(got, block[:n]) || resp.ContentLength != int64(n) {
						t.Errorf("GET %d: %v, proto %d, %d octets, equal %v", n, err, resp.ProtoMajor, len(got), bytes.Equal(got, block[:n]))
					}
				})
				wg.Go(func() {
					body := block[i*1000 : i*1000+n/2]
					req, _ := http.NewRequest("PUT", s.url("/sum"), bytes.NewReader(body))
					resp, err := c.Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					defer resp.Body.Close()
					got, _ := io.ReadAll(resp.Body)
					if want := fmt.Sprintf("%d %x", len(body), sha256.Sum256(body)); string(got) != want {
						t.Errorf("PUT %d: %q, want %q", len(body), got, want)
					}
				})
			}
			wg.Wait()
		})
	}
}

// TestDataFramesFillRecords: a body's DATA frames are as large as the
// client allows, cut so that frame header and payload fill whole TLS
// records (16 KiB), the last one ending the stream; the response's
// headers say what the handler set.
func TestDataFramesFillRecords(t *testing.T) {
	const n = 3<<20 + 5
	s := startServer(t, h2.Config{}, blockHandler(n))
	rc := s.raw(t, http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1 << 20}, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
	rc.fr.SetMaxReadFrameSize(1 << 20)
	rc.fr.WriteWindowUpdate(0, 1<<30)
	rc.request(1, "GET", "/x", true)
	hf := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok }).(*http2.MetaHeadersFrame)
	if hf.PseudoValue("status") != "200" || hf.Fields[len(hf.Fields)-1].Name == "" {
		t.Fatalf("headers %v", hf.Fields)
	}
	got := map[string]string{}
	for _, f := range hf.RegularFields() {
		got[f.Name] = f.Value
	}
	if got["content-length"] != strconv.Itoa(n) || got["content-type"] != "application/octet-stream" || got["date"] == "" {
		t.Fatalf("headers %v", got)
	}
	var sizes []int
	var body []byte
	for {
		df := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
		sizes = append(sizes, len(df.Data()))
		body = append(body, df.Data()...)
		if df.StreamEnded() {
			break
		}
	}
	if !bytes.Equal(body, block[:n]) {
		t.Fatal("body differs")
	}
	for i, k := range sizes[:len(sizes)-1] {
		if k != 1<<20-9 {
			t.Fatalf("frame %d of %v: %d octets, want %d (the frame and its header fill 64 records)", i, sizes, k, 1<<20-9)
		}
	}
}

// TestWindowsAndSettings: a client with a small stream window gets the body as it opens the window; a SETTINGS_INITIAL_WINDOW_SIZE
// raised mid-stream applies to the open stream (RFC 9113 section 6.9.2).
func TestWindowsAndSettings(t *testing.T) {
	const n = 200_000
	s := startServer(t, h2.Config{}, blockHandler(n))
	rc := s.raw(t, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1000})
	rc.request(1, "GET", "/x", true)
	var body []byte
	df := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
	body = append(body, df.Data()...)
	if len(body) != 1000 {
		t.Fatalf("first DATA %d octets through a window of 1000", len(body))
	}
	rc.mu.Lock()
	rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
	rc.mu.Unlock()
	for len(body) < n {
		df := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
		body = append(body, df.Data()...)
		if len(body) < n {
			rc.mu.Lock()
			rc.fr.WriteWindowUpdate(0, uint32(len(df.Data())))
			rc.mu.Unlock()
		}
	}
	if !bytes.Equal(body, block[:n]) {
		t.Fatal("body differs")
	}
}

// TestResetAndPanic: a stream the client resets ends its handler's
// context and makes its writes fail, and only its own (the connection
// serves on); a handler that panics resets only
// its stream (INTERNAL_ERROR); the connection serves on.
func TestResetAndPanic(t *testing.T) {
	ended := make(chan error, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("/stall", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("x"))
		http.NewResponseController(w).Flush() // a small write is held until then
		<-r.Context().Done()
		_, err := w.Write(block[:1<<20])
		ended <- err
	})
	flushed := make(chan error, 1)
	mux.HandleFunc("/quiet", func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		flushed <- http.NewResponseController(w).Flush() // the headers of a reset stream: not sent
	})
	mux.HandleFunc("/panic", func(http.ResponseWriter, *http.Request) { panic("on purpose") })
	mux.HandleFunc("/ok", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) })
	s := startServer(t, h2.Config{}, mux)
	rc := s.raw(t)
	rc.request(1, "GET", "/stall", true)
	rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok })
	rc.mu.Lock()
	rc.fr.WriteRSTStream(1, http2.ErrCodeCancel)
	rc.mu.Unlock()
	select {
	case err := <-ended:
		if err == nil {
			t.Fatal("a write on a reset stream succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context did not end with the reset")
	}
	rc.request(7, "GET", "/quiet", true)
	time.Sleep(10 * time.Millisecond)
	rc.mu.Lock()
	rc.fr.WriteRSTStream(7, http2.ErrCodeCancel)
	rc.mu.Unlock()
	if err := <-flushed; err == nil {
		t.Fatal("headers flushed on a reset stream")
	}
	rc.request(9, "GET", "/panic", true)
	rst := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	if rst.StreamID != 9 || rst.ErrCode != http2.ErrCodeInternal {
		t.Fatalf("after a panic: %v", rst)
	}
	rc.request(11, "GET", "/ok", true)
	df := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
	if df.StreamID != 11 || string(df.Data()) != "ok" {
		t.Fatalf("then: %v %q", df.StreamID, df.Data())
	}
}

// TestRequestSemantics: HEAD sends headers only, 204 no body, trailers
// reach the handler after the body, a body unread by its handler is
// answered and the client told to stop (RST_STREAM NO_ERROR), and a
// header list over the bound is 431.
func TestRequestSemantics(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/b", blockHandler(5000))
	mux.HandleFunc("/none", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) })
	mux.HandleFunc("/trailer", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%d %s", len(b), r.Trailer.Get("X-Sum"))
	})
	mux.HandleFunc("/early", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("early")) })
	s := startServer(t, h2.Config{MaxHeaderBytes: 4096}, mux)
	c := s.client(t)
	resp, err := c.Head(s.url("/b"))
	if err != nil || resp.ContentLength != 5000 {
		t.Fatalf("HEAD: %v %v", resp, err)
	}
	if b, _ := io.ReadAll(resp.Body); len(b) != 0 {
		t.Fatalf("HEAD answered %d octets", len(b))
	}
	resp, err = c.Get(s.url("/none"))
	if err != nil || resp.StatusCode != 204 {
		t.Fatalf("204: %v %v", resp, err)
	}
	req, _ := http.NewRequest("POST", s.url("/trailer"), io.NopCloser(strings.NewReader("hello")))
	req.Trailer = http.Header{"X-Sum": nil}
	req.ContentLength = -1
	req.Trailer.Set("X-Sum", "abc")
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != "5 abc" {
		t.Fatalf("trailers: %q", b)
	}
	rc := s.raw(t)
	rc.request(1, "POST", "/early", false)
	rc.mu.Lock()
	rc.fr.WriteData(1, false, []byte("more to come"))
	rc.mu.Unlock()
	rst := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	if rst.StreamID != 1 || rst.ErrCode != http2.ErrCodeNo {
		t.Fatalf("unread body: %v", rst)
	}
	// Each field within the bound (one longer is a COMPRESSION_ERROR of
	// the connection, as in net/http), together over it.
	rc.request(3, "GET", "/b", true, "x-big1", strings.Repeat("a", 2000), "x-big2", strings.Repeat("b", 2000), "x-big3", strings.Repeat("c", 2000))
	hf := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok }).(*http2.MetaHeadersFrame)
	if hf.StreamID != 3 || hf.PseudoValue("status") != "431" {
		t.Fatalf("headers over the bound: stream %d status %s", hf.StreamID, hf.PseudoValue("status"))
	}
}

// TestWriteDeadline: a response whose client stops reading (no window)
// fails its write at the deadline set through http.ResponseController,
// and only that stream is reset (CANCEL): the connection serves on.
func TestWriteDeadline(t *testing.T) {
	got := make(chan error, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		http.NewResponseController(w).SetWriteDeadline(time.Now().Add(200 * time.Millisecond))
		_, err := w.Write(block[:1<<20])
		got <- err
	})
	mux.HandleFunc("/ok", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) })
	s := startServer(t, h2.Config{}, mux)
	rc := s.raw(t)
	start := time.Now()
	rc.request(1, "GET", "/slow", true) // the default window: 65535 octets, never reopened
	select {
	case err := <-got:
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("write: %v, want a timeout", err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("write failed after %v", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the write outlived its deadline")
	}
	rst := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	if rst.StreamID != 1 || rst.ErrCode != http2.ErrCodeCancel {
		t.Fatalf("the stream past its deadline: %v", rst)
	}
	rc.mu.Lock()
	rc.fr.WriteWindowUpdate(0, 1<<20) // what stream 1 took of the connection's window
	rc.mu.Unlock()
	rc.request(3, "GET", "/ok", true)
	df := rc.next(5*time.Second, func(f http2.Frame) bool { d, ok := f.(*http2.DataFrame); return ok && d.StreamID == 3 }).(*http2.DataFrame)
	if string(df.Data()) != "ok" {
		t.Fatalf("then %q", df.Data())
	}
}

// TestWriteDeadlineResetsTheStream (RELIABILITY B11): a client that grants
// no window (SETTINGS_INITIAL_WINDOW_SIZE 0) leaves a response waiting;
// at its write deadline the stream is reset (CANCEL) at once, and the
// handler's context ends, although the handler ignores the write's error
// and waits for its context rather than returning. A deadline moved to
// now from another goroutine cuts a write under way the same way. Another
// stream of the connection, which the client grants window, flows
// meanwhile.
func TestWriteDeadlineResetsTheStream(t *testing.T) {
	const deadline = 200 * time.Millisecond
	type ended struct {
		path  string
		write error
		after time.Duration
	}
	done := make(chan ended, 2)
	cuts := make(chan *http.ResponseController, 1)
	mux := http.NewServeMux()
	stall := func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rc := http.NewResponseController(w)
		if r.URL.Path == "/stall" {
			rc.SetWriteDeadline(time.Now().Add(deadline))
		} else {
			rc.SetWriteDeadline(time.Now().Add(time.Hour))
			cuts <- rc
		}
		_, err := w.Write(block[:1<<20]) // its error ignored:
		<-r.Context().Done()             // the handler only ends with its context
		done <- ended{r.URL.Path, err, time.Since(start)}
	}
	mux.HandleFunc("/stall", stall)
	mux.HandleFunc("/cut", stall)
	mux.HandleFunc("/ok", blockHandler(256<<10))
	s := startServer(t, h2.Config{}, mux)
	rc := s.raw(t, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
	start := time.Now()
	rc.request(1, "GET", "/stall", true)
	rc.request(3, "GET", "/ok", true)
	rc.mu.Lock()
	rc.fr.WriteWindowUpdate(3, 256<<10)
	rc.fr.WriteWindowUpdate(0, 256<<10)
	rc.mu.Unlock()
	got := 0
	var rst *http2.RSTStreamFrame
	for rst == nil || got < 256<<10 {
		switch f := rc.next(5*time.Second, func(f http2.Frame) bool {
			switch f := f.(type) {
			case *http2.DataFrame:
				return f.StreamID == 3
			case *http2.RSTStreamFrame:
				return true
			}
			return false
		}).(type) {
		case *http2.DataFrame:
			got += len(f.Data())
		case *http2.RSTStreamFrame:
			if f.StreamID != 1 || f.ErrCode != http2.ErrCodeCancel {
				t.Fatalf("RST_STREAM %v, want stream 1's CANCEL", f)
			}
			if d := time.Since(start); d < deadline || d > deadline+2*time.Second {
				t.Fatalf("stream 1 reset after %v, want just past its deadline of %v", d, deadline)
			}
			rst = f
		}
	}
	checkEnded := func(path string) {
		t.Helper()
		select {
		case e := <-done:
			var ne net.Error
			if e.path != path || !errors.As(e.write, &ne) || !ne.Timeout() {
				t.Fatalf("%s ended: its write returned %v, want a timeout", e.path, e.write)
			}
			t.Logf("%s: write %v, handler ended after %v", e.path, e.write, e.after.Round(time.Millisecond))
		case <-time.After(5 * time.Second):
			t.Fatalf("the handler of %s did not end: its context goes on past the reset", path)
		}
	}
	checkEnded("/stall")

	rc.request(5, "GET", "/cut", true)
	cut := <-cuts
	time.Sleep(50 * time.Millisecond) // the write waits for window
	cut.SetWriteDeadline(time.Now())
	f := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	if f.StreamID != 5 || f.ErrCode != http2.ErrCodeCancel {
		t.Fatalf("after the cut: RST_STREAM %v, want stream 5's CANCEL", f)
	}
	checkEnded("/cut")
}

// TestIdleAndShutdown: a connection without streams goes away after the
// idle timeout (GOAWAY NO_ERROR, then closed); Shutdown lets a response
// under way finish, refuses new streams and ends the connection.
func TestIdleAndShutdown(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("/wait", func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-release
		w.Write([]byte("done"))
	})
	s := startServer(t, h2.Config{IdleTimeout: 300 * time.Millisecond}, mux)
	rc := s.raw(t)
	ga := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok }).(*http2.GoAwayFrame)
	if ga.ErrCode != http2.ErrCodeNo {
		t.Fatalf("idle: GOAWAY %v", ga.ErrCode)
	}
	rc.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := rc.fr.ReadFrame(); err == nil {
		t.Fatal("the idle connection is still open")
	}

	rc = s.raw(t)
	rc.request(1, "GET", "/wait", true)
	<-started
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		shut <- s.hs.Shutdown(ctx)
	}()
	rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok })
	close(release)
	df := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
	if string(df.Data()) != "done" {
		t.Fatalf("in flight at shutdown: %q", df.Data())
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
}

// TestControlFlood: a client that provokes control frames (PING) and
// never reads is cut off once the bound of queued frames is reached,
// rather than buffered without end.
func TestControlFlood(t *testing.T) {
	s := startServer(t, h2.Config{}, http.NotFoundHandler())
	rc := s.raw(t)
	var err error
	for i := 0; i < 2_000_000 && err == nil; i++ {
		err = rc.fr.WritePing(false, [8]byte{byte(i)})
	}
	if err == nil {
		t.Fatal("2,000,000 PINGs written to a server that queues their ACKs for a client that does not read")
	}
}

// TestConcurrencyBound: no more handlers run at once than
// MAX_CONCURRENT_STREAMS, even when their streams are reset (rapid
// reset): past 4x the limit queued, the connection is not read until
// handlers make room (the client is held back, not cut off); when none
// do within QueueWait it ends with ENHANCE_YOUR_CALM.
func TestConcurrencyBound(t *testing.T) {
	var running, peak atomic.Int64
	stuck := make(chan struct{})
	defer close(stuck)
	mux := http.NewServeMux()
	mux.HandleFunc("/quick", func(w http.ResponseWriter, r *http.Request) {
		n := running.Add(1)
		for m := peak.Load(); n > m && !peak.CompareAndSwap(m, n); m = peak.Load() {
		}
		time.Sleep(5 * time.Millisecond)
		running.Add(-1)
	})
	mux.HandleFunc("/stuck", func(w http.ResponseWriter, r *http.Request) { <-stuck })
	mux.HandleFunc("/ok", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) })
	s := startServer(t, h2.Config{MaxConcurrentStreams: 10, QueueWait: 300 * time.Millisecond}, mux)
	reset := func(rc *rawConn, path string, n int) (id uint32, err error) {
		for id = 1; id < uint32(2*n); id += 2 {
			if err = rc.tryRequest(id, "GET", path, true); err == nil {
				rc.mu.Lock()
				err = rc.fr.WriteRSTStream(id, http2.ErrCodeCancel)
				rc.mu.Unlock()
			}
			if err != nil {
				break
			}
		}
		return id, err
	}
	rc := s.raw(t)
	id, err := reset(rc, "/quick", 1000)
	if err != nil {
		t.Fatalf("the connection failed under a rapid reset whose handlers end: %v", err)
	}
	rc.request(id, "GET", "/ok", true)
	df := rc.next(10*time.Second, func(f http2.Frame) bool { d, ok := f.(*http2.DataFrame); return ok && d.StreamID == id }).(*http2.DataFrame)
	if string(df.Data()) != "ok" || peak.Load() > 10 {
		t.Fatalf("after 1000 reset streams: %q, %d handlers at once (MAX_CONCURRENT_STREAMS 10)", df.Data(), peak.Load())
	}

	rc = s.raw(t)
	done := make(chan *http2.GoAwayFrame, 1)
	go func() {
		var g *http2.GoAwayFrame
		defer func() { done <- g }()
		for {
			f, err := rc.fr.ReadFrame()
			if err != nil {
				return
			}
			if ga, ok := f.(*http2.GoAwayFrame); ok {
				g = ga
			}
		}
	}()
	reset(rc, "/stuck", 1000) // 10 handlers that never end, 40 queued behind them, then the rest
	if g := <-done; g == nil || g.ErrCode != http2.ErrCodeEnhanceYourCalm {
		t.Fatalf("GOAWAY %v when no handler made room", g)
	}
}

// TestH2Spec runs h2spec (github.com/summerwind/h2spec, installed by
// make deps) against the server: every test of RFC 7540/9113 and HPACK
// must pass. The server advertises the default SETTINGS_MAX_FRAME_SIZE
// (h2spec's frame size tests assume it).
func TestH2Spec(t *testing.T) {
	bin := os.Getenv("KVSP_H2SPEC")
	if bin == "" {
		if os.Getenv("KVSP_REQUIRE_H2SPEC") == "1" {
			t.Fatal("KVSP_H2SPEC is not set (make deps installs h2spec into bin/)")
		}
		t.Skip("set KVSP_H2SPEC to h2spec's path (make test does)")
	}
	s := startServer(t, h2.Config{MaxReadFrameSize: 16 << 10}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Write([]byte("hello"))
	}))
	_, port, _ := net.SplitHostPort(s.addr)
	out, err := exec.Command(bin, "-t", "-k", "-h", "127.0.0.1", "-p", port, "-o", "5").CombinedOutput()
	m := regexp.MustCompile(`(\d+) tests, (\d+) passed, (\d+) skipped, (\d+) failed`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("h2spec: %v\n%s", err, out)
	}
	t.Logf("h2spec: %s", m[0])
	if string(m[4]) != "0" || string(m[3]) != "0" {
		t.Fatalf("h2spec: %s\n%s", m[0], out[bytes.Index(out, []byte("Failures:")):])
	}
}

// TestQueuedResetReturnsWindow: a request body buffered for a handler
// that waits behind MAX_CONCURRENT_STREAMS, whose stream is then reset,
// goes back to the connection's window (found in review: it leaked, and
// after one window's worth no body could be sent on the connection).
func TestQueuedResetReturnsWindow(t *testing.T) {
	release := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("/block", func(w http.ResponseWriter, r *http.Request) { <-release })
	mux.HandleFunc("/read", func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) })
	s := startServer(t, h2.Config{MaxConcurrentStreams: 1, ConnWindow: 65535, StreamWindow: 65535, MaxReadFrameSize: 16 << 10}, mux)
	rc := s.raw(t)
	rc.request(1, "GET", "/block", true) // runs, holds the only handler slot...
	time.Sleep(20 * time.Millisecond)
	rc.mu.Lock()
	rc.fr.WriteRSTStream(1, http2.ErrCodeCancel) // ...after its stream is gone (a rapid reset)
	rc.mu.Unlock()
	time.Sleep(20 * time.Millisecond)
	rc.request(3, "POST", "/read", false) // queued behind it
	for sent := 0; sent < 65535; {
		k := min(16384, 65535-sent)
		rc.mu.Lock()
		rc.fr.WriteData(3, false, make([]byte, k))
		rc.mu.Unlock()
		sent += k
	}
	rc.mu.Lock()
	rc.fr.WriteRSTStream(3, http2.ErrCodeCancel) // the queued stream, its body buffered
	rc.mu.Unlock()
	time.Sleep(20 * time.Millisecond)
	close(release)
	var back uint32
	for back < 65535/2 {
		f := rc.next(5*time.Second, func(f http2.Frame) bool { w, ok := f.(*http2.WindowUpdateFrame); return ok && w.StreamID == 0 })
		back += f.(*http2.WindowUpdateFrame).Increment
	}
}

// TestShutdownWhilePinged: a graceful shutdown ends a connection whose
// client keeps sending frames (found in review: the serve loop's idle
// deadline overwrote the close's, and Shutdown waited out its context).
func TestShutdownWhilePinged(t *testing.T) {
	for trial := 0; trial < 50; trial++ {
		started, release := make(chan struct{}), make(chan struct{})
		mux := http.NewServeMux()
		mux.HandleFunc("/wait", func(w http.ResponseWriter, r *http.Request) { close(started); <-release })
		s := startServer(t, h2.Config{}, mux)
		rc := s.raw(t)
		rc.request(1, "GET", "/wait", true)
		<-started
		ended := make(chan struct{}) // the server's FIN: it went away
		go func() { io.Copy(io.Discard, rc.c); close(ended) }()
		stop := make(chan struct{})
		go func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-ended: // as a client does: its own FIN ends the server's linger
					rc.mu.Lock()
					rc.c.NetConn().(*net.TCPConn).CloseWrite()
					rc.mu.Unlock()
					return
				default:
				}
				rc.mu.Lock()
				err := rc.fr.WritePing(false, [8]byte{byte(i)})
				rc.mu.Unlock()
				if err != nil {
					return
				}
				time.Sleep(20 * time.Microsecond)
			}
		}()
		shut := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			shut <- s.hs.Shutdown(ctx)
		}()
		time.Sleep(10 * time.Millisecond)
		close(release)
		err := <-shut
		close(stop)
		if err != nil {
			t.Fatalf("trial %d: Shutdown: %v", trial, err)
		}
	}
}

// TestMalformedRequestsRefused: requests net/http's HTTP/2 server refuses
// are reset (PROTOCOL_ERROR) before any handler: a scheme that is not
// http(s), an extended-CONNECT :protocol, userinfo in :authority.
func TestMalformedRequestsRefused(t *testing.T) {
	reached := make(chan string, 8)
	s := startServer(t, h2.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { reached <- r.Host }))
	rc := s.raw(t)
	cases := []struct {
		name   string
		fields [][2]string
	}{
		{"scheme ftp", [][2]string{{":method", "GET"}, {":scheme", "ftp"}, {":authority", "a"}, {":path", "/"}}},
		{":protocol", [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", "a"}, {":path", "/"}, {":protocol", "websocket"}}},
		{"userinfo", [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", "u@a"}, {":path", "/"}}},
	}
	for i, tc := range cases {
		id := uint32(2*i + 1)
		var b bytes.Buffer
		enc := hpack.NewEncoder(&b)
		for _, f := range tc.fields {
			enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		rc.mu.Lock()
		rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: b.Bytes(), EndStream: true, EndHeaders: true})
		rc.mu.Unlock()
		f := rc.next(5*time.Second, func(f http2.Frame) bool {
			r, ok := f.(*http2.RSTStreamFrame)
			h, okh := f.(*http2.MetaHeadersFrame)
			return (ok && r.StreamID == id) || (okh && h.StreamID == id)
		})
		if r, ok := f.(*http2.RSTStreamFrame); !ok || r.ErrCode != http2.ErrCodeProtocol {
			t.Errorf("%s: %v, want RST_STREAM PROTOCOL_ERROR", tc.name, f.Header())
		}
	}
	select {
	case h := <-reached:
		t.Fatalf("a malformed request reached its handler (host %q)", h)
	default:
	}
}

// TestFirstFrameIsSettings: a shutdown that reaches a connection before
// its preface sends nothing but closes it: the server's first frame is
// never a GOAWAY (RFC 9113 section 3.4; found in review).
func TestFirstFrameIsSettings(t *testing.T) {
	s := startServer(t, h2.Config{}, http.NotFoundHandler())
	c, err := tls.Dial("tcp", s.addr, &tls.Config{RootCAs: s.pool, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	time.Sleep(20 * time.Millisecond)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		s.hs.Shutdown(ctx)
	}()
	time.Sleep(20 * time.Millisecond)
	io.WriteString(c, http2.ClientPreface)
	fr := http2.NewFramer(c, c)
	fr.WriteSettings()
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	f, err := fr.ReadFrame()
	if err == nil {
		if _, ok := f.(*http2.SettingsFrame); !ok {
			t.Fatalf("the server's first frame is %v, not SETTINGS", f.Header())
		}
	}
}

// TestExpectContinue: a request with Expect: 100-continue is answered
// 100 when its handler first reads the body, and then completes.
func TestExpectContinue(t *testing.T) {
	s := startServer(t, h2.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%d", len(b))
	}))
	rc := s.raw(t)
	rc.request(1, "POST", "/", false, "expect", "100-continue", "content-length", "5")
	hf := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok }).(*http2.MetaHeadersFrame)
	if hf.PseudoValue("status") != "100" || hf.StreamEnded() {
		t.Fatalf("first answer: %s", hf.PseudoValue("status"))
	}
	rc.mu.Lock()
	rc.fr.WriteData(1, true, []byte("hello"))
	rc.mu.Unlock()
	hf = rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok }).(*http2.MetaHeadersFrame)
	df := rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
	if hf.PseudoValue("status") != "200" || string(df.Data()) != "5" {
		t.Fatalf("then %s %q", hf.PseudoValue("status"), df.Data())
	}
}

// TestStreamsShareASmallWindow: sixteen responses of 1 MiB through a
// client whose connection window is 64 KiB all arrive whole: the
// connection's window goes to its waiting streams in turn, and none is
// left waiting when window is there.
func TestStreamsShareASmallWindow(t *testing.T) {
	s := startServer(t, h2.Config{}, blockHandler(1<<20))
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: s.pool, NextProtos: []string{"h2"}}, ForceAttemptHTTP2: true,
		HTTP2: &http.HTTP2Config{MaxReceiveBufferPerConnection: 64 << 10, MaxReceiveBufferPerStream: 64 << 10}}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			resp, err := c.Get(s.url("/"))
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			if b, err := io.ReadAll(resp.Body); err != nil || !bytes.Equal(b, block[:1<<20]) {
				t.Errorf("%d octets, %v", len(b), err)
			}
		})
	}
	wg.Wait()
}

// goroutineID is the calling goroutine's number, from its stack trace.
func goroutineID() string {
	var buf [64]byte
	return strings.Fields(string(buf[:runtime.Stack(buf[:], false)]))[1]
}

// TestHandlersReuseGoroutines: a connection's handlers run on workers that
// outlive them (a worker keeps the stack it grew), no more than sixteen
// wait idle once a burst is over, and those end after a second idle.
func TestHandlersReuseGoroutines(t *testing.T) {
	var mu sync.Mutex
	ids := map[string]int{}
	var burst sync.WaitGroup
	s := startServer(t, h2.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/burst" {
			burst.Done()
			burst.Wait() // all of the burst's handlers run at once
			return
		}
		mu.Lock()
		ids[goroutineID()]++
		mu.Unlock()
	}))
	c := s.client(t)
	get := func(path string) {
		resp, err := c.Get(s.url(path))
		if err != nil {
			t.Error(err)
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	const sequential = 20
	for range sequential {
		get("/seq")
	}
	if len(ids) > sequential/2 {
		t.Fatalf("%d sequential requests ran on %d goroutines: handlers do not reuse them", sequential, len(ids))
	}

	base := runtime.NumGoroutine()
	const n = 40
	burst.Add(n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() { get("/burst") })
	}
	wg.Wait()
	extra, bounded := 0, false
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if extra = runtime.NumGoroutine() - base; extra <= 16 {
			bounded = true
			break
		}
	}
	if !bounded {
		t.Fatalf("%d goroutines more than before a burst of %d handlers, want at most 16 idle workers", extra, n)
	}
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if extra = runtime.NumGoroutine() - base; extra <= 0 {
			return
		}
	}
	t.Fatalf("%d goroutines more than before a burst of %d handlers 5 s after it, want its idle workers ended (after 1 s idle)", extra, n)
}

// TestSmallWritesHeld: writes of a few octets are held and go out with the
// next write (a container's header with its first sections: one DATA
// frame), with the handler's return (one frame ending the stream), or at
// a Flush, as net/http holds them.
func TestSmallWritesHeld(t *testing.T) {
	hdr := bytes.Repeat([]byte{'h'}, 532)
	proceed := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("/pieces", func(w http.ResponseWriter, r *http.Request) {
		for _, s := range []string{"a", "b", "c"} {
			io.WriteString(w, s)
		}
	})
	mux.HandleFunc("/container", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(hdr)+64<<10))
		w.Write(hdr)
		w.Write(block[:64<<10])
	})
	mux.HandleFunc("/flush", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "x")
		http.NewResponseController(w).Flush()
		<-proceed
	})
	s := startServer(t, h2.Config{}, mux)
	rc := s.raw(t, http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1 << 20}, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
	rc.fr.SetMaxReadFrameSize(1 << 20)
	rc.fr.WriteWindowUpdate(0, 1<<20)
	data := func(id uint32) *http2.DataFrame {
		t.Helper()
		return rc.next(5*time.Second, func(f http2.Frame) bool { d, ok := f.(*http2.DataFrame); return ok && d.StreamID == id }).(*http2.DataFrame)
	}

	rc.request(1, "GET", "/pieces", true)
	if d := data(1); string(d.Data()) != "abc" || !d.StreamEnded() {
		t.Fatalf("three small writes: a frame of %q (END_STREAM %v), want one of \"abc\" ending the stream", d.Data(), d.StreamEnded())
	}

	rc.request(3, "GET", "/container", true)
	if d := data(3); len(d.Data()) <= len(hdr) || !bytes.Equal(d.Data()[:len(hdr)], hdr) {
		t.Fatalf("a header and its sections: a first frame of %d octets, want the header and sections in one", len(d.Data()))
	}

	rc.request(5, "GET", "/flush", true)
	if d := data(5); string(d.Data()) != "x" || d.StreamEnded() {
		t.Fatalf("flushed: %q (END_STREAM %v)", d.Data(), d.StreamEnded())
	}
	close(proceed)
	if d := data(5); len(d.Data()) != 0 || !d.StreamEnded() {
		t.Fatalf("then: %q (END_STREAM %v)", d.Data(), d.StreamEnded())
	}
}

// TestGracefulCloseDrains: a connection that goes away gracefully (here
// after the client's own GOAWAY) sends FIN after its GOAWAY and reads
// what the client still sends for a short linger, rather than closing
// with octets unread: a close with unread octets is a reset, which can
// destroy the GOAWAY in the client's buffers (RFC 9113 section 6.8; h2spec
// 6.8 #1 sends a PING after its GOAWAY). A client writing after the
// server's GOAWAY still finds the connection open; closed at once, its
// second write would meet the reset its first provoked.
func TestGracefulCloseDrains(t *testing.T) {
	s := startServer(t, h2.Config{}, blockHandler(1))
	rc := s.raw(t)
	rc.next(5*time.Second, func(f http2.Frame) bool { sf, ok := f.(*http2.SettingsFrame); return ok && !sf.IsAck() })
	rc.mu.Lock()
	rc.fr.WriteGoAway(0, http2.ErrCodeNo, nil)
	rc.mu.Unlock()
	rc.next(5*time.Second, func(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok })
	for i := range 2 {
		if i > 0 {
			time.Sleep(200 * time.Millisecond) // a reset provoked by the first PING has come back
		}
		rc.mu.Lock()
		err := rc.fr.WritePing(false, [8]byte{byte(i)})
		rc.mu.Unlock()
		if err != nil {
			t.Fatalf("PING %d after the server's GOAWAY: %v (the server closed without draining)", i, err)
		}
	}
	rc.c.CloseWrite()
	rc.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	for { // a PING the server read before it stopped reading may be answered
		f, err := rc.fr.ReadFrame()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatalf("after the GOAWAYs: %v, want io.EOF (the server's FIN, not a reset)", err)
		}
		if pf, ok := f.(*http2.PingFrame); !ok || !pf.IsAck() {
			t.Fatalf("after the GOAWAYs: %v, want io.EOF", f.Header())
		}
	}
}

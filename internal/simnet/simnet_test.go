package simnet

import (
	"crypto/x509"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestExchanges: identities reach the handler as a TLS peer certificate,
// bodies stream both ways as written, a host taken down cuts its streams
// with ErrReset (never a clean end), refuses new requests, and serves
// again once up; drops and delays come from the seed.
func TestExchanges(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := New(1)
		peer := &x509.Certificate{Raw: []byte("me")}
		release := make(chan struct{})
		f.Up("a:443", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.TLS == nil || len(r.TLS.PeerCertificates) != 1 || string(r.TLS.PeerCertificates[0].Raw) != "me" {
				http.Error(w, "who", http.StatusForbidden)
				return
			}
			b, _ := io.ReadAll(r.Body)
			w.Header().Set("X-Len", string(rune('0'+len(b))))
			w.Write([]byte("first "))
			w.(http.Flusher).Flush()
			select {
			case <-release:
				w.Write([]byte("second"))
			case <-r.Context().Done():
			}
		}))
		c := &http.Client{Transport: f.Transport(peer)}
		resp, err := c.Post("https://a:443/x", "text/plain", strings.NewReader("abc"))
		if err != nil || resp.StatusCode != 200 || resp.Header.Get("X-Len") != "3" {
			t.Fatalf("%v %v", resp, err)
		}
		buf := make([]byte, 6)
		if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "first " {
			t.Fatalf("streamed part: %q %v", buf, err)
		}
		close(release)
		rest, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(rest) != "second" {
			t.Fatalf("rest: %q %v", rest, err)
		}
		// A host that goes down mid-stream.
		release = make(chan struct{})
		resp, err = c.Get("https://a:443/x")
		if err != nil {
			t.Fatal(err)
		}
		io.ReadFull(resp.Body, buf)
		f.Down("a:443")
		if _, err := io.ReadAll(resp.Body); !errors.Is(err, ErrReset) {
			t.Fatalf("a cut stream: %v, want ErrReset", err)
		}
		resp.Body.Close()
		if _, err := c.Get("https://a:443/x"); !errors.Is(err, ErrRefused) {
			t.Fatalf("down: %v", err)
		}
		f.Up("a:443", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }))
		f.SetFaults(Faults{Drop: 0.5, Delay: 10 * time.Millisecond})
		var ok, lost int
		start := time.Now()
		for range 200 {
			resp, err := c.Get("https://a:443/y")
			switch {
			case err == nil && resp.StatusCode == http.StatusNoContent:
				ok++
				resp.Body.Close()
			case errors.Is(err, ErrReset):
				lost++
			default:
				t.Fatalf("%v %v", resp, err)
			}
		}
		if ok < 60 || lost < 60 || f.Stats().Dropped != lost {
			t.Fatalf("ok %d lost %d stats %+v", ok, lost, f.Stats())
		}
		if d := time.Since(start); d <= 0 || d > 200*10*time.Millisecond {
			t.Fatalf("delays took %v", d)
		}
	})
}

package quicbulk_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/quicbulk"
	"github.com/kvsp/kvsp/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var geom = container.Geometry{Layers: 8, BlockTokens: 16, KVHeads: 2, HeadDim: 64, Elem: container.BF16}

var compat = kvsp.CompatID{7}

func scope() kvsp.ScopeID { s, _ := kvsp.ParseScopeID(kvsptest.Scope); return s }

// block is a container of geom with content seeded by seed.
func block(t testing.TB, seed byte) ([]byte, *container.Block) {
	hdr, _ := container.NewHeader(container.CodecRaw, 0, geom.Layers, geom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, hdr)
	k, v := make([]byte, geom.RawSectionLen()), make([]byte, geom.RawSectionLen())
	for l := range geom.Layers {
		for i := range k {
			k[i], v[i] = byte(i)^seed^byte(l), byte(i*3)+seed
		}
		w.WriteLayer(k, v)
	}
	if _, err := w.Close(); err != nil {
		t.Fatal(err)
	}
	blk, err := container.OpenBlock(buf.Bytes(), geom)
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), blk
}

// fixture is a holder serving HTTPS and the bulk path on one port.
type fixture struct {
	pki  *kvsptest.PKI
	srv  *kvsptest.Server
	bulk *quicbulk.Server
}

func start(t testing.TB, mount func(*server.Server)) *fixture {
	f := &fixture{pki: kvsptest.NewPKI(t), bulk: &quicbulk.Server{}}
	if mount == nil {
		h, err := holder.New(holder.Config{Base: "https://127.0.0.1/h1/", Geometries: map[kvsp.CompatID]container.Geometry{compat: geom},
			Capacity: 1 << 30, LeaseQuota: holder.LeaseQuota{Octets: 1 << 30, MaxTTL: time.Minute, MaxLeases: 16}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close(context.Background()) })
		mount = func(s *server.Server) { h.Mount(s.Mount("/h1/")) }
	}
	f.srv = kvsptest.StartServer(t, f.pki, kvsptest.Options{QUIC: map[string]server.QUICHandler{quicbulk.ALPN: f.bulk}, QUICConfig: quicbulk.DefaultConfig()},
		func(s *server.Server) {
			f.bulk.Handler = s.Handler()
			mount(s)
		})
	return f
}

// client returns a KVSP client whose block transfers go over the bulk
// path, as identity id.
func (f *fixture) client(t testing.TB, id string) (*client.Client, *quicbulk.Transport) {
	tr := &quicbulk.Transport{TLS: f.pki.ClientTLS(f.pki.Leaf(id))}
	c, err := client.New(client.Config{TLS: f.pki.ClientTLS(f.pki.Leaf(id)), Bulk: tr})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c, tr
}

func ref(i byte) client.BlockRef {
	return client.BlockRef{Compat: compat, Scope: scope(), Key: kvsp.BlockKey{i, 1}}
}

// readAll reads every layer of a stream (verified as it arrives) and the
// end (Repr-Digest checked).
func readAll(s *client.BlockStream) ([]byte, error) {
	var out []byte
	for {
		l, err := s.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(append(out, l.K...), l.V...)
	}
}

// TestBulkSameAsHTTPS (R-BLK-6, R-BLK-8, R-BLK-9, R-BLK-12): a block PUT
// over the bulk path is stored; GETs over it, whole and by layer range,
// verify layer by layer, and carry the same Repr-Digest and bytes as the
// same GETs over HTTP/2.
func TestBulkSameAsHTTPS(t *testing.T) {
	f := start(t, nil)
	c, _ := f.client(t, kvsptest.ClientA)
	h2, _ := client.New(client.Config{TLS: f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA))})
	defer h2.Close()
	data, blk := block(t, 3)
	hc := c.Holder(f.srv.URL("/h1/"))
	if err := hc.PutBlock(context.Background(), ref(1), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	if err := hc.PutBlock(context.Background(), ref(1), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); !errors.Is(err, client.ErrExists) {
		t.Fatalf("second PUT: %v, want ErrExists (R-BLK-14)", err)
	}
	for _, layers := range []*kvsp.LayerRange{nil, {2, 5}, {7, 7}} {
		o := client.GetOptions{Layers: layers, LayerDigests: blk.LayerDigests()}
		var got [2][]byte
		var digests [2]string
		for i, holder := range []*client.Holder{hc, h2.Holder(f.srv.URL("/h1/"))} {
			s, err := holder.GetBlock(context.Background(), ref(1), geom, o)
			if err != nil {
				t.Fatal(err)
			}
			got[i], err = readAll(s)
			s.Close()
			if err != nil {
				t.Fatalf("layers %v: %v", layers, err)
			}
			digests[i] = s.Header.Get("Repr-Digest")
		}
		if !bytes.Equal(got[0], got[1]) || digests[0] != digests[1] || digests[0] == "" {
			t.Fatalf("layers %v: bulk and HTTP/2 differ (%d vs %d octets, %q vs %q)", layers, len(got[0]), len(got[1]), digests[0], digests[1])
		}
	}
}

// TestBulkAuthorization (R-BLK-13, R-BLK-19, R-HTTP-4): a certificate the
// CA did not sign never completes the handshake; an identity outside the
// policy, and one without the block's scope, get 403 problem details over
// the bulk path as over HTTPS; a missing block is 404.
func TestBulkAuthorization(t *testing.T) {
	f := start(t, nil)
	for _, tc := range []struct {
		id   string
		want error
	}{
		{kvsptest.Stranger, kvsp.ErrForbidden},
		{kvsptest.DNSOnly, kvsp.ErrScopeDenied},
		{kvsptest.ClientA, kvsp.ErrNotFound},
	} {
		c, _ := f.client(t, tc.id)
		_, err := c.Holder(f.srv.URL("/h1/")).GetBlock(context.Background(), ref(9), geom, client.GetOptions{})
		var p *kvsp.Problem
		if !errors.Is(err, tc.want) || !errors.As(err, &p) {
			t.Errorf("%s: %v, want problem details %v", tc.id, err, tc.want)
		}
	}
	other := kvsptest.NewPKI(t) // another CA
	tr := &quicbulk.Transport{TLS: other.ClientTLS(other.Leaf(kvsptest.ClientA))}
	defer tr.Close()
	tr.TLS.RootCAs = f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA)).RootCAs
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL("/h1/blocks/x"), nil)
	// TLS 1.3: the client finishes first, the server then refuses.
	_, err := tr.RoundTrip(req)
	var te *quic.TransportError
	if !errors.As(err, &te) || !te.ErrorCode.IsCryptoError() {
		t.Fatalf("a client certificate of another CA: %v, want a refused handshake", err)
	}
}

// TestBulkFallsBackToHTTPS: a holder that does not serve the bulk path
// (no ALPN) is reached over HTTPS, and the block still arrives verified;
// the transport itself says the request was not sent.
func TestBulkFallsBackToHTTPS(t *testing.T) {
	pki := kvsptest.NewPKI(t)
	h, err := holder.New(holder.Config{Base: "https://127.0.0.1/h1/", Geometries: map[kvsp.CompatID]container.Geometry{compat: geom},
		Capacity: 1 << 30, LeaseQuota: holder.LeaseQuota{Octets: 1 << 30, MaxTTL: time.Minute, MaxLeases: 16}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(context.Background())
	srv := kvsptest.StartServer(t, pki, kvsptest.Options{HTTP3: true}, func(s *server.Server) { h.Mount(s.Mount("/h1/")) })
	tr := &quicbulk.Transport{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA))}
	c, err := client.New(client.Config{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), Bulk: tr})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	data, blk := block(t, 5)
	hc := c.Holder(srv.URL("/h1/"))
	if err := hc.PutBlock(context.Background(), ref(2), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatalf("PUT with fallback: %v", err)
	}
	s, err := hc.GetBlock(context.Background(), ref(2), geom, client.GetOptions{LayerDigests: blk.LayerDigests()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := readAll(s); err != nil {
		t.Fatal(err)
	}
	s.Close()
	req, _ := http.NewRequest(http.MethodGet, srv.URL("/h1/"), nil)
	_, err = tr.RoundTrip(req)
	var ns interface{ NotServed() bool }
	if !errors.As(err, &ns) || !ns.NotServed() {
		t.Fatalf("bulk to an HTTP/3-only port: %v, want a DialError", err)
	}
}

// TestHTTP3BesideBulk: HTTP/3 and the bulk path share the UDP port and
// the listener's QUIC configuration (DefaultConfig), and both serve.
func TestHTTP3BesideBulk(t *testing.T) {
	pki := kvsptest.NewPKI(t)
	bulk := &quicbulk.Server{}
	srv := kvsptest.StartServer(t, pki, kvsptest.Options{HTTP3: true, QUIC: map[string]server.QUICHandler{quicbulk.ALPN: bulk}, QUICConfig: quicbulk.DefaultConfig()},
		func(s *server.Server) {
			bulk.Handler = s.Handler()
			s.Mount("/x/").Handle("GET", "hello", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
				_, err := w.Write([]byte(r.Proto))
				return err
			})
		})
	for _, cfg := range []client.Config{
		{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), HTTP3: true},
		{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), Bulk: &quicbulk.Transport{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA))}},
	} {
		c, err := client.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		// A block GET goes over Bulk when set; over HTTP/3 otherwise.
		_, err = c.Holder(srv.URL("/x/")).GetBlock(context.Background(), ref(1), geom, client.GetOptions{})
		var p *kvsp.Problem
		if !errors.As(err, &p) || p.Status != 404 {
			t.Fatalf("HTTP3=%v bulk=%v: %v, want the server's 404", cfg.HTTP3, cfg.Bulk != nil, err)
		}
	}
}

// rawConn dials the bulk ALPN directly, for heads no Transport would send.
func rawConn(t *testing.T, f *fixture) *quic.Conn {
	tc := f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA))
	tc.NextProtos = []string{quicbulk.ALPN}
	conn, err := quic.DialAddr(context.Background(), f.srv.Addr, tc, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.CloseWithError(0, "") })
	return conn
}

// TestBulkBadHeads (RELIABILITY B-rows): a malformed head gets a 400
// problem (or a reset when it cannot be read at all), and the same
// connection serves the next stream.
func TestBulkBadHeads(t *testing.T) {
	f := start(t, nil)
	conn := rawConn(t, f)
	for name, head := range map[string][]byte{
		"garbage":          []byte("GET / HTTP/1.1\r\n\r\n"),
		"header injection": {12, 3, 'G', 'E', 'T', 1, '/', 1, 1, 'x', 2, '\r', '\n'},
		"bad target":       {8, 3, 'G', 'E', 'T', 3, 'a', 'b', 'c', 0},
	} {
		str, err := conn.OpenStreamSync(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		str.Write(head)
		str.Close()
		str.SetReadDeadline(time.Now().Add(5 * time.Second))
		resp, err := quicbulk.ReadResponse(str)
		if err != nil {
			var se *quic.StreamError
			if !errors.As(err, &se) {
				t.Errorf("%s: %v, want a 400 or a stream reset", name, err)
			}
			continue
		}
		body, _ := io.ReadAll(str)
		if resp.Status != 400 || resp.Header.Get("Content-Type") != kvsp.MediaTypeProblem {
			t.Errorf("%s: %d %s %s", name, resp.Status, resp.Header.Get("Content-Type"), body)
		}
	}
	// The connection still serves.
	b, _ := quicbulk.AppendRequest(nil, &quicbulk.Request{Method: "GET", Target: "/h1/blocks/" + compat.String() + "/" + kvsptest.Scope + "/" + ref(3).Key.String()})
	str, err := conn.OpenStreamSync(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	str.Write(b)
	str.Close()
	resp, err := quicbulk.ReadResponse(str)
	if err != nil || resp.Status != 404 {
		t.Fatalf("after bad heads: %+v %v, want 404", resp, err)
	}
	io.Copy(io.Discard, str)
}

// TestBulkAbortIsNotEOF: a response that fails after it started reaches
// the client as an error, never as a shorter complete body.
func TestBulkAbortIsNotEOF(t *testing.T) {
	f := start(t, func(s *server.Server) {
		s.Mount("/x/").Handle("GET", "cut", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			w.Header().Set("Content-Length", "1000000")
			w.Write(make([]byte, 300000))
			return errors.New("the tier failed mid-block")
		})
	})
	tr := &quicbulk.Transport{TLS: f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA))}
	defer tr.Close()
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL("/x/cut"), nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	n, err := io.Copy(io.Discard, resp.Body)
	var se *quic.StreamError
	if !errors.As(err, &se) || se.ErrorCode != quicbulk.CodeAborted {
		t.Fatalf("after %d octets: %v, want a reset with CodeAborted", n, err)
	}
}

// TestBulkManyStreams: 64 block GETs at once on one connection, each a
// different layer range, all verified.
func TestBulkManyStreams(t *testing.T) {
	f := start(t, nil)
	c, tr := f.client(t, kvsptest.ClientA)
	hc := c.Holder(f.srv.URL("/h1/"))
	var blks []*container.Block
	for i := range 4 {
		data, blk := block(t, byte(i))
		if err := hc.PutBlock(context.Background(), ref(byte(i)), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
		blks = append(blks, blk)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 64 {
		wg.Go(func() {
			a := uint32(i % 8)
			o := client.GetOptions{Layers: &kvsp.LayerRange{a, 7}, LayerDigests: blks[i%4].LayerDigests()}
			s, err := hc.GetBlock(context.Background(), ref(byte(i%4)), geom, o)
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			got, err := readAll(s)
			if err == nil && uint64(len(got)) != uint64(8-a)*2*geom.RawSectionLen() {
				err = fmt.Errorf("stream %d: %d octets", i, len(got))
			}
			if err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Log(tr.BufferReport())
}

// TestBulkShutdownDrains: Shutdown lets a response under way finish, and
// refuses streams opened after it began.
func TestBulkShutdownDrains(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	f := start(t, func(s *server.Server) {
		s.Mount("/x/").Handle("GET", "slow", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			w.Write([]byte("first half,"))
			close(started)
			<-release
			_, err := w.Write([]byte(" second half"))
			return err
		})
		s.Mount("/x/").Handle("GET", "fast", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			_, err := w.Write([]byte("ok"))
			return err
		})
	})
	tr := &quicbulk.Transport{TLS: f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA))}
	defer tr.Close()
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL("/x/slow"), nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	<-started
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done <- f.bulk.Shutdown(ctx)
	}()
	// Once Shutdown has begun, new streams are reset with CodeShutdown.
	for deadline := time.Now().Add(5 * time.Second); ; {
		req2, _ := http.NewRequest(http.MethodGet, f.srv.URL("/x/fast"), nil)
		r2, err := tr.RoundTrip(req2)
		if err == nil {
			_, err = io.ReadAll(r2.Body)
			r2.Body.Close()
		}
		var se *quic.StreamError
		if errors.As(err, &se) && se.ErrorCode == quicbulk.CodeShutdown {
			break
		}
		if err != nil || time.Now().After(deadline) {
			t.Fatalf("a stream opened during shutdown: %v, want a reset with CodeShutdown", err)
		}
	}
	close(release)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != "first half, second half" {
		t.Fatalf("drained response: %q, %v", body, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

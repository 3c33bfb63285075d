package client_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/sockio"
	"github.com/kvsp/kvsp/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var geom = container.Geometry{Layers: 4, BlockTokens: 4, KVHeads: 2, HeadDim: 8, Elem: container.BF16}

// peer is a loopback server answering as the tests need; calls counts the
// requests per route.
type peer struct {
	*kvsptest.Server
	calls map[string]*atomic.Int32
	block []byte
	blk   *container.Block
}

func newPeer(t *testing.T, http3 bool) (*peer, *client.Client) {
	p := &peer{calls: map[string]*atomic.Int32{}}
	rng := rand.New(rand.NewPCG(1, 2))
	h, _ := container.NewHeader(container.CodecRaw, 0, 4, geom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	for i := 0; i < 4; i++ {
		k := make([]byte, geom.RawSectionLen())
		for j := range k {
			k[j] = byte(rng.Uint32())
		}
		w.WriteLayer(k, k)
	}
	w.Close()
	p.block = buf.Bytes()
	var err error
	if p.blk, err = container.OpenBlock(p.block, geom); err != nil {
		t.Fatal(err)
	}
	count := func(name string) {
		if p.calls[name] == nil {
			p.calls[name] = new(atomic.Int32)
		}
	}
	for _, n := range []string{"flaky-get", "flaky-post", "put", "block", "publish"} {
		count(n)
	}
	pki := kvsptest.NewPKI(t)
	p.Server = kvsptest.StartServer(t, pki, kvsptest.Options{HTTP3: http3}, func(s *server.Server) {
		is := s.Mount("/is/")
		is.Handle("PUT", "replicas/{holder}/{key}", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			var rec kvsp.ReplicaRecord
			if err := server.DecodeJSON(r, &rec); err != nil {
				return err
			}
			if r.PathValue("holder") != kvsp.ResourceID(rec.Holder) {
				return kvsp.ErrInvalid
			}
			rec.TTLMs = min(rec.TTLMs, 60000)
			st := http.StatusOK
			if p.calls["publish"].Add(1) == 1 {
				st = http.StatusCreated
			}
			return server.WriteJSON(w, st, &rec)
		})
		is.Handle("DELETE", "replicas/{holder}/{key}", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			return kvsp.ErrNotFound
		})
		is.Handle("POST", "lookup", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			var q kvsp.LookupRequest
			if err := server.DecodeJSON(r, &q); err != nil {
				return err
			}
			if !server.PrincipalFrom(r.Context()).MayUseScope(q.ScopeID) {
				return kvsp.ErrScopeDenied
			}
			return server.WriteJSON(w, 200, &kvsp.LookupResponse{Replicas: [][]kvsp.ReplicaRecord{}})
		})
		pc := s.Mount("/pc/")
		pc.Handle("PUT", "sessions/{s}/checkpoint", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			return kvsp.NewProblem(kvsp.ErrStaleEpoch, "epoch 1 is below 2").With("epoch", 2)
		})
		pc.Handle("GET", "flaky", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			if p.calls["flaky-get"].Add(1) < 3 {
				return kvsp.ErrUnavailable
			}
			return server.WriteJSON(w, 200, &kvsp.StateBody{State: kvsp.StateActive})
		})
		pc.Handle("GET", "teapot", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			w.WriteHeader(418)
			return nil
		})
		ii := s.Mount("/ii/")
		ii.Handle("POST", "prefetch", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			p.calls["flaky-post"].Add(1)
			return kvsp.ErrUnavailable
		})
		h := s.Mount("/h1/")
		h.Handle("GET", "blocks/{c}/{s}/{k}", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			p.calls["block"].Add(1)
			v := p.blk.Full()
			if r.URL.Query().Get("layers") == "1-2" {
				v, _ = p.blk.Range(1, 2)
			}
			d := v.Digest()
			switch r.PathValue("k") {
			case strings.Repeat("0e", 32): // a wrong Repr-Digest
				d[0] ^= 1
			case strings.Repeat("0d", 32): // none
				w.Header().Set("Content-Type", kvsp.MediaTypeBlock)
				v.WriteTo(w)
				return nil
			}
			w.Header().Set("Content-Type", kvsp.MediaTypeBlock)
			w.Header().Set("Repr-Digest", container.ReprDigest(d))
			_, err := v.WriteTo(w)
			return err
		})
		h.Handle("PUT", "blocks/{c}/{s}/{k}", server.Route{MaxBody: 1 << 20}, func(w http.ResponseWriter, r *http.Request) error {
			if p.calls["put"].Add(1) > 1 {
				return kvsp.ErrPreconditionFailed
			}
			if r.Header.Get("If-None-Match") != "*" {
				return kvsp.ErrPreconditionRequired
			}
			want, err := container.ParseReprDigest(r.Header.Get("Repr-Digest"))
			if err != nil {
				return kvsp.ErrInvalid
			}
			b, _ := io.ReadAll(r.Body)
			blk, err := container.OpenBlock(b, geom)
			if err != nil || blk.ContainerDigest() != want {
				return kvsp.ErrDigestMismatch
			}
			w.Header().Set("Cache-Control", "no-store")
			w.WriteHeader(201)
			return nil
		})
	})
	c, err := client.New(client.Config{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), HTTP3: http3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return p, c
}

func ref(key byte) client.BlockRef {
	var r client.BlockRef
	for i := range r.Key {
		r.Key[i] = key
	}
	r.Compat[0], r.Scope[0] = 1, 1
	return r
}

// TestProblemsBecomeSentinels: problem details decode back into the kvsp
// sentinels with their extension members; unlisted statuses map by class
// (R-ERR-*, R-HTTP-9).
func TestProblemsBecomeSentinels(t *testing.T) {
	p, c := newPeer(t, false)
	ctx := context.Background()
	cp := &kvsp.Checkpoint{Session: kvsp.UUID{1}, Epoch: 1, CompatID: kvsp.CompatID{1}, ScopeID: kvsp.ScopeID{1},
		PromptBlocks: []kvsp.BlockKey{}, PromptTail: []uint32{}, Generated: []uint32{}, Sampler: kvsp.Sampler{Method: "greedy", Params: map[string]any{}}}
	_, err := c.Controller(p.URL("/pc/")).PutCheckpoint(ctx, cp)
	var prob *kvsp.Problem
	if !errors.Is(err, kvsp.ErrStaleEpoch) || !errors.As(err, &prob) || prob.Extensions["epoch"] != float64(2) {
		t.Fatalf("stale epoch: %v", err)
	}
	var sb kvsp.StateBody
	_ = sb
	_, err = c.Index(p.URL("/is/")).Lookup(ctx, &kvsp.LookupRequest{ScopeID: kvsp.ScopeID{9}, CompatID: kvsp.CompatID{1}, BlockKeys: []kvsp.BlockKey{}})
	if !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Fatalf("scope denied: %v", err)
	}
	if err := c.Index(p.URL("/is/")).Withdraw(ctx, "https://127.0.0.1/h1/", kvsp.BlockKey{1}); err != nil {
		t.Fatalf("withdraw of an unknown record is not an error (A-28): %v", err)
	}
	// Publish: 201 first, then 200, with the capped TTL echoed.
	rec := &kvsp.ReplicaRecord{BlockKey: kvsp.BlockKey{1}, CompatID: kvsp.CompatID{1}, ScopeID: kvsp.ScopeID{1}, Holder: "https://127.0.0.1/h1/",
		Codec: 1, Size: 1, Digest: kvsp.Digest{1}, Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 3}}}, TTLMs: 600000}
	got, created, err := c.Index(p.URL("/is/")).Publish(ctx, rec)
	if err != nil || !created || got.TTLMs != 60000 {
		t.Fatalf("publish: %v %v %v", got, created, err)
	}
	if _, created, err := c.Index(p.URL("/is/")).Publish(ctx, rec); err != nil || created {
		t.Fatalf("refresh: %v %v", created, err)
	}
}

// TestRetries: idempotent requests are retried on 503, POST is not.
func TestRetries(t *testing.T) {
	p, c := newPeer(t, false)
	ctx := context.Background()
	_, _, err := client.DoForTest(c, ctx, "GET", p.URL("/pc/flaky"))
	if err != nil || p.calls["flaky-get"].Load() != 3 {
		t.Fatalf("GET after two 503: %v, %d calls", err, p.calls["flaky-get"].Load())
	}
	d := &kvsp.PrefetchDirective{Directive: kvsp.UUID{1}, ScopeID: kvsp.ScopeID{1}, CompatID: kvsp.CompatID{1},
		Blocks: []kvsp.PrefetchBlock{{BlockKey: kvsp.BlockKey{1}, Sources: []string{"https://127.0.0.1/h1/"}}}, DeadlineMs: 50, LeaseMs: 2000}
	if _, err := c.Instance(p.URL("/ii/")).Prefetch(ctx, d); !errors.Is(err, kvsp.ErrUnavailable) || p.calls["flaky-post"].Load() != 1 {
		t.Fatalf("POST retried: %v, %d calls", err, p.calls["flaky-post"].Load())
	}
	if _, _, err := client.DoForTest(c, ctx, "GET", p.URL("/pc/teapot")); !errors.Is(err, kvsp.ErrInvalid) {
		t.Fatalf("418 is handled as 400: %v", err)
	}
}

// TestConnsReadAndWriteRaw: the client's TCP connections are
// internal/sockio's, whose reads and writes leave the runtime's monitor
// thread asleep (TestRawCallsLeaveTheMonitorAsleep measures that), so an
// instance streaming blocks in pays for it no more than the holder does.
func TestConnsReadAndWriteRaw(t *testing.T) {
	p, c := newPeer(t, false)
	var conn net.Conn
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { conn = i.Conn }})
	if _, _, err := client.DoForTest(c, ctx, "GET", p.URL("/pc/teapot")); !errors.Is(err, kvsp.ErrInvalid) {
		t.Fatal(err)
	}
	tc, ok := conn.(*tls.Conn)
	if !ok {
		t.Fatalf("the request went on a %T, want a *tls.Conn", conn)
	}
	if _, ok := tc.NetConn().(*sockio.Conn); !ok {
		t.Fatalf("the TLS connection is over a %T, want a *sockio.Conn", tc.NetConn())
	}
}

// TestGetBlockVerifies: a block stream yields verified layers; a wrong or
// missing Repr-Digest and altered layer data are caught (R-BLK-6..10,
// R-ERR-12), over HTTP/2 and HTTP/3.
func TestGetBlockVerifies(t *testing.T) {
	for _, h3 := range []bool{false, true} {
		p, c := newPeer(t, h3)
		ctx := context.Background()
		h := c.Holder(p.URL("/h1/"))
		all := make([]container.Digest, 4)
		copy(all, p.blk.LayerDigests())

		read := func(s *client.BlockStream, err error) (int, error) {
			if err != nil {
				return 0, err
			}
			defer s.Close()
			n := 0
			for {
				if _, err := s.Next(); err == io.EOF {
					return n, nil
				} else if err != nil {
					return n, err
				}
				n++
			}
		}
		if n, err := read(h.GetBlock(ctx, ref(1), geom, client.GetOptions{LayerDigests: all, ReplicaCodec: 1})); err != nil || n != 4 {
			t.Fatalf("http3=%v full block: %d layers, %v", h3, n, err)
		}
		if n, err := read(h.GetBlock(ctx, ref(1), geom, client.GetOptions{Layers: &kvsp.LayerRange{1, 2}, LayerDigests: all})); err != nil || n != 2 {
			t.Fatalf("layers 1-2: %d layers, %v", n, err)
		}
		if _, err := read(h.GetBlock(ctx, ref(0x0e), geom, client.GetOptions{})); !errors.Is(err, container.ErrDigestMismatch) {
			t.Fatalf("wrong Repr-Digest: %v", err)
		}
		if _, err := read(h.GetBlock(ctx, ref(0x0d), geom, client.GetOptions{})); !errors.Is(err, kvsp.ErrDigestMismatch) {
			t.Fatalf("missing Repr-Digest: %v", err)
		}
		bad := append([]container.Digest(nil), all...)
		bad[2][0] ^= 1
		if n, err := read(h.GetBlock(ctx, ref(1), geom, client.GetOptions{LayerDigests: bad, ReplicaCodec: 1})); !errors.Is(err, container.ErrDigestMismatch) || n != 2 {
			t.Fatalf("layer digest mismatch: %d layers then %v", n, err)
		}
	}
}

// TestPutBlock: If-None-Match and Repr-Digest are sent; a second PUT is
// ErrExists (R-BLK-12, R-BLK-14).
func TestPutBlock(t *testing.T) {
	p, c := newPeer(t, false)
	h := c.Holder(p.URL("/h1/"))
	ctx := context.Background()
	if err := h.PutBlock(ctx, ref(1), bytes.NewReader(p.block), int64(len(p.block)), p.blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	if err := h.PutBlock(ctx, ref(1), bytes.NewReader(p.block), int64(len(p.block)), p.blk.ContainerDigest()); !errors.Is(err, client.ErrExists) {
		t.Fatalf("second PUT: %v", err)
	}
}

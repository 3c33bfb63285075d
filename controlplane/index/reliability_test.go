package index_test

// Rows of RELIABILITY.md that concern the Index Service (F6, F7, the IS
// halves of S8 and S9). L3 needs the memory backend's internals and is in
// sweep_test.go.

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// bubbleIS is an IS reached through the server's handler, without a
// socket, so that it runs inside a synctest bubble on virtual time: every
// request still passes the server's authentication (the peer certificate
// set on the request) and the policy's authorization.
type bubbleIS struct {
	t     *testing.T
	h     http.Handler
	certs map[string]*x509.Certificate
}

// newBubbleServer starts, outside any bubble, a server with policy whose
// IS routes are mounted later (inside the bubble) on the returned server.
func newBubbleServer(t *testing.T, policy string, ids ...string) (*kvsptest.Server, map[string]*x509.Certificate) {
	p := kvsptest.NewPKI(t)
	srv := kvsptest.StartServer(t, p, kvsptest.Options{Policy: policy}, nil)
	certs := map[string]*x509.Certificate{}
	for _, id := range ids {
		certs[id] = p.Leaf(id).Cert
	}
	return srv, certs
}

// do sends one request as id and returns the status and body.
func (x *bubbleIS) do(id, method, path string, body []byte) (int, []byte) {
	x.t.Helper()
	req := httptest.NewRequest(method, "https://127.0.0.1/is/"+path, bytes.NewReader(body))
	req.TLS = &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true, PeerCertificates: []*x509.Certificate{x.certs[id]}}
	if body != nil {
		req.Header.Set("Content-Type", kvsp.MediaType)
	}
	w := httptest.NewRecorder()
	x.h.ServeHTTP(w, req)
	b, _ := io.ReadAll(w.Result().Body)
	return w.Code, b
}

// publish sends a record as id; it returns the status and the stored
// record (nil on an error status).
func (x *bubbleIS) publish(id string, r *kvsp.ReplicaRecord) (int, *kvsp.ReplicaRecord) {
	x.t.Helper()
	body, err := kvsp.Marshal(r)
	if err != nil {
		x.t.Fatal(err)
	}
	st, out := x.do(id, http.MethodPut, "replicas/"+kvsp.ResourceID(r.Holder)+"/"+r.BlockKey.String(), body)
	if st != http.StatusOK && st != http.StatusCreated {
		return st, nil
	}
	var got kvsp.ReplicaRecord
	if err := kvsp.Decode(out, &got); err != nil {
		x.t.Fatalf("publish answer: %v", err)
	}
	return st, &got
}

// lookup asks for ks as id and returns the answer (fatal unless 200).
func (x *bubbleIS) lookup(id string, ks []kvsp.BlockKey) *kvsp.LookupResponse {
	x.t.Helper()
	body, _ := kvsp.Marshal(&kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: ks})
	st, out := x.do(id, http.MethodPost, "lookup", body)
	if st != http.StatusOK {
		x.t.Fatalf("lookup: %d %s", st, out)
	}
	var resp kvsp.LookupResponse
	if err := kvsp.Decode(out, &resp); err != nil {
		x.t.Fatalf("lookup answer: %v", err)
	}
	return &resp
}

// chain returns the keys k0..k(n-1) of a prompt (rec's key scheme).
func chain(first, n int) []kvsp.BlockKey {
	out := make([]kvsp.BlockKey, n)
	for i := range out {
		out[i] = kvsp.BlockKey{byte(first + i), 1}
	}
	return out
}

// TestF6_ReplicaTTLRefreshAndCap (RELIABILITY.md F6; R-IS-4, R-IS-5,
// R-IS-6, R-IS-15, R-OPS-1): on virtual time, in the IS behind its real
// handler stack with the memory backend,
//   - a ttl_ms above the IS cap is capped: the answer echoes the cap, the
//     record is present at cap-1 ms and absent at cap+1 ms, and swept;
//   - a record refreshed every ttl/3 outlives many TTLs, while one published
//     at the same time and not refreshed is gone after one TTL; once
//     refreshes stop, it is present until ttl-1 ms after the last refresh
//     and absent at ttl+1 ms;
//   - in an n-key chain whose key k alone was not refreshed, lookup
//     matched is n before k expires and k after, although the keys after k
//     are alive: the prefix stops at the first expired key.
func TestF6_ReplicaTTLRefreshAndCap(t *testing.T) {
	srv, certs := newBubbleServer(t, pol2, kvsptest.Holder1, kvsptest.ClientA)
	const capTTL = 30 * time.Second
	synctest.Test(t, func(t *testing.T) {
		mem := index.NewMemory(time.Second)
		defer mem.Close()
		svc, err := index.New(index.Config{MaxTTL: capTTL, MaxLookupKeys: 64}, mem)
		if err != nil {
			t.Fatal(err)
		}
		if err := svc.Mount(srv.Mount("/is/")); err != nil {
			t.Fatal(err)
		}
		is := &bubbleIS{t: t, h: srv.Handler(), certs: certs}
		const hold, cl = kvsptest.Holder1, kvsptest.ClientA
		present := func(k byte) bool {
			t.Helper()
			resp := is.lookup(cl, chain(int(k), 1))
			return resp.Matched == 1
		}

		// The cap.
		{
			st, got := is.publish(hold, rec(h1, 1, 600000))
			if st != http.StatusCreated || got.TTLMs != uint64(capTTL/time.Millisecond) {
				t.Fatalf("publish ttl_ms=600000 with a %v cap: %d %+v", capTTL, st, got)
			}
			time.Sleep(capTTL - time.Millisecond)
			resp := is.lookup(cl, chain(1, 1))
			if resp.Matched != 1 || resp.Replicas[0][0].TTLMs != 1 {
				t.Fatalf("at cap-1ms: %+v, want present with 1 ms left", resp)
			}
			time.Sleep(2 * time.Millisecond)
			if present(1) {
				t.Fatal("at cap+1ms: present; the cap is not enforced (it lives its asked 600 s)")
			}
			time.Sleep(time.Second) // a sweep
			synctest.Wait()
			if n := mem.Len(); n != 0 {
				t.Fatalf("%d records left after the cap expired", n)
			}
			// A refresh is capped too.
			is.publish(hold, rec(h1, 1, 1000))
			if st, got := is.publish(hold, rec(h1, 1, 600000)); st != http.StatusOK || got.TTLMs != uint64(capTTL/time.Millisecond) {
				t.Fatalf("refresh with ttl_ms=600000: %d %+v", st, got)
			}
			time.Sleep(capTTL + time.Millisecond)
			if present(1) {
				t.Fatal("a refreshed record outlived the cap")
			}
		}

		// Refresh every ttl/3.
		{
			const ttl = 3 * time.Second
			ms := uint64(ttl / time.Millisecond)
			is.publish(hold, rec(h1, 2, ms)) // refreshed
			is.publish(hold, rec(h1, 3, ms)) // not refreshed
			start := time.Now()
			for i := 1; i <= 12; i++ { // four TTLs
				time.Sleep(ttl / 3)
				if st, got := is.publish(hold, rec(h1, 2, ms)); st != http.StatusOK || got.TTLMs != ms {
					t.Fatalf("refresh %d: %d %+v, want 200 (not created again) with ttl_ms %d", i, st, got, ms)
				}
				if !present(2) {
					t.Fatalf("refreshed record absent after %v", time.Since(start))
				}
				if time.Since(start) >= ttl && present(3) {
					t.Fatalf("unrefreshed record present after %v (ttl %v)", time.Since(start), ttl)
				}
			}
			if time.Since(start) < 4*ttl || present(3) {
				t.Fatal("the refresh loop did not outlive the TTL")
			}
			time.Sleep(ttl - time.Millisecond) // refreshes stop
			if !present(2) {
				t.Fatal("absent before ttl after the last refresh")
			}
			time.Sleep(2 * time.Millisecond)
			if present(2) {
				t.Fatal("present after ttl since the last refresh")
			}
		}

		// The chain stops at the first expired key.
		{
			const n, k, ttl = 8, 3, 3 * time.Second
			ks := chain(10, n)
			for i := range n {
				r := rec(h1, byte(10+i), uint64(ttl/time.Millisecond))
				if st, _ := is.publish(hold, r); st != http.StatusCreated {
					t.Fatalf("publish k%d: %d", i, st)
				}
			}
			time.Sleep(ttl / 3)
			for i := range n {
				if i != k {
					is.publish(hold, rec(h1, byte(10+i), uint64(ttl/time.Millisecond)))
				}
			}
			time.Sleep(ttl - ttl/3 - time.Millisecond)
			if resp := is.lookup(cl, ks); resp.Matched != n {
				t.Fatalf("before k%d expires: matched %d, want %d", k, resp.Matched, n)
			}
			time.Sleep(2 * time.Millisecond)
			resp := is.lookup(cl, ks)
			if resp.Matched != k || len(resp.Replicas) != k {
				t.Fatalf("k%d expired: matched %d (%d entries), want %d", k, resp.Matched, len(resp.Replicas), k)
			}
			for i, reps := range resp.Replicas {
				if reps[0].BlockKey != ks[i] {
					t.Fatalf("entry %d is for another key", i)
				}
			}
			if tail := is.lookup(cl, ks[k+1:]); tail.Matched != n-k-1 {
				t.Fatalf("the keys after k%d: matched %d, want %d (alive: only the gap cuts the prefix)", k, tail.Matched, n-k-1)
			}
		}
	})
}

// F7 fixtures: a small model geometry and blocks of it.
var (
	f7Geom   = container.Geometry{Layers: 4, BlockTokens: 4, KVHeads: 2, HeadDim: 8, Elem: container.BF16}
	f7Compat = kvsp.CompatID{7}
)

func f7Block(seed byte) ([]byte, *container.Block) {
	h, err := container.NewHeader(container.CodecRaw, 0, f7Geom.Layers, f7Geom)
	if err != nil {
		panic(err)
	}
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	for l := range f7Geom.Layers {
		k := bytes.Repeat([]byte{seed, byte(l), 0x3f, 0x00}, int(f7Geom.RawSectionLen()/4))
		w.WriteLayer(k, k)
	}
	if _, err := w.Close(); err != nil {
		panic(err)
	}
	b, err := container.OpenBlock(buf.Bytes(), f7Geom)
	if err != nil {
		panic(err)
	}
	return buf.Bytes(), b
}

// f7Consumer loads a prompt's prefix as an instance does: lookup, then a
// GET of each matched block from its replicas in turn; a 404 is a miss
// (R-IS-10): the next replica is tried and, when none is left, the rest of
// the prefix is recomputed. Only other failures reach the user.
type f7Consumer struct {
	is      *client.Index
	holders map[string]*client.Holder // holder base URI -> where it is served now
	asked   int
	hits    int
}

func (c *f7Consumer) load(ctx context.Context, ks []kvsp.BlockKey) (matched, loaded int, err error) {
	resp, err := c.is.Lookup(ctx, &kvsp.LookupRequest{ScopeID: scope, CompatID: f7Compat, BlockKeys: ks})
	if err != nil {
		return 0, 0, err
	}
	c.asked += len(ks)
	for i, reps := range resp.Replicas {
		got := false
		for _, r := range reps {
			h, ok := c.holders[r.Holder]
			if !ok {
				continue
			}
			s, err := h.GetBlock(ctx, client.BlockRef{Compat: f7Compat, Scope: scope, Key: ks[i]}, f7Geom,
				client.GetOptions{LayerDigests: digestsOf(r.LayerDigests), ReplicaCodec: uint16(r.Codec)})
			if errors.Is(err, kvsp.ErrNotFound) {
				continue // a stale record: a miss, not an error
			}
			if err != nil {
				return resp.Matched, loaded, err
			}
			for {
				if _, err = s.Next(); err != nil {
					break
				}
			}
			s.Close()
			if err != io.EOF {
				return resp.Matched, loaded, err
			}
			got = true
			break
		}
		if !got {
			break // recompute from here
		}
		loaded++
	}
	c.hits += loaded
	return resp.Matched, loaded, nil
}

func digestsOf(ds []kvsp.LayerDigest) []container.Digest {
	out := make([]container.Digest, len(ds))
	for i, d := range ds {
		out[i] = container.Digest(d)
	}
	return out
}

// TestF7_StaleIndexAfterHolderWipe (RELIABILITY.md F7; R-IS-4, R-IS-10,
// R-IS-19): a holder (package holder, publishing through its IS client)
// loses its tier and restarts empty under the same base URI.
//   - Crash (no withdrawal): lookups during the old records' TTL may still
//     return them, but the restarted holder answers the GET 404, which the
//     consumer treats as a miss: no error, nothing loaded. Every stale
//     record is gone from lookups at wipe+TTL and from the index (its
//     size, swept) by wipe+2xTTL: no phantom records. Once the blocks are
//     stored again the hit ratio is back to 1.
//   - Orderly wipe (Close): the holder withdraws its records, so there is
//     no stale window at all: lookups miss and the index is empty at once.
func TestF7_StaleIndexAfterHolderWipe(t *testing.T) {
	const ttl = time.Second
	pol := kvsptest.Policy
	p := kvsptest.NewPKI(t)
	mem := index.NewMemory(50 * time.Millisecond)
	defer mem.Close()
	svc, err := index.New(index.Config{MaxTTL: ttl, MaxLookupKeys: 64}, mem)
	if err != nil {
		t.Fatal(err)
	}
	isSrv := kvsptest.StartServer(t, p, kvsptest.Options{Policy: pol}, func(s *server.Server) {
		if err := svc.Mount(s.Mount("/is/")); err != nil {
			t.Fatal(err)
		}
	})
	newClient := func(id string) *client.Client {
		c, err := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(id)), Attempts: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		return c
	}
	hc := newClient(kvsptest.Holder1) // the holder's identity towards the IS
	// startHolder starts a holder process with an empty tier, under h1's
	// base URI, on a server (and port) of its own.
	startHolder := func() (*holder.Holder, *client.Holder) {
		h, err := holder.New(holder.Config{Base: h1, Geometries: map[kvsp.CompatID]container.Geometry{f7Compat: f7Geom},
			Capacity: 1 << 20, ReadMbitPerS: 400000, Index: hc.Index(isSrv.URL("/is/")), RecordTTL: ttl,
			LeaseQuota: holder.LeaseQuota{Octets: 1 << 20, MaxTTL: 10 * time.Second, MaxLeases: 4}})
		if err != nil {
			t.Fatal(err)
		}
		srv := kvsptest.StartServer(t, p, kvsptest.Options{Policy: pol}, func(s *server.Server) {
			if err := h.Mount(s.Mount("/h1/")); err != nil {
				t.Fatal(err)
			}
		})
		return h, newClient(kvsptest.ClientA).Holder(srv.URL("/h1/"))
	}
	ctx := context.Background()
	ks := chain(0x40, 4)
	store := func(hc *client.Holder) {
		t.Helper()
		for i, k := range ks {
			data, blk := f7Block(byte(i))
			if err := hc.PutBlock(ctx, client.BlockRef{Compat: f7Compat, Scope: scope, Key: k}, bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
				t.Fatal(err)
			}
		}
	}
	cons := &f7Consumer{is: newClient(kvsptest.ClientA).Index(isSrv.URL("/is/")), holders: map[string]*client.Holder{}}
	waitMatched := func(want int) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			resp, err := cons.is.Lookup(ctx, &kvsp.LookupRequest{ScopeID: scope, CompatID: f7Compat, BlockKeys: ks})
			if err == nil && resp.Matched == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("lookup: %v %v, want matched %d", resp, err, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	ratio := func() float64 {
		r := float64(cons.hits) / float64(cons.asked)
		cons.hits, cons.asked = 0, 0
		return r
	}

	// Before: every block is found and loaded.
	ha, ca := startHolder()
	cons.holders[h1] = ca
	store(ca)
	waitMatched(len(ks))
	if m, n, err := cons.load(ctx, ks); err != nil || m != len(ks) || n != len(ks) {
		t.Fatalf("before the wipe: matched %d loaded %d: %v", m, n, err)
	}
	if r := ratio(); r != 1 {
		t.Fatalf("hit ratio before the wipe %.2f", r)
	}

	// Crash: the tier is lost with the process, nothing is withdrawn.
	dead, cancel := context.WithCancel(ctx)
	cancel()
	ha.Close(dead) // stops its publisher; a cancelled context withdraws nothing
	wiped := time.Now()
	hb, cb := startHolder()
	hbOpen := true
	defer func() {
		if hbOpen {
			hb.Close(ctx)
		}
	}()
	cons.holders[h1] = cb
	if _, err := cb.GetBlock(ctx, client.BlockRef{Compat: f7Compat, Scope: scope, Key: ks[0]}, f7Geom, client.GetOptions{}); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("GET from the wiped holder: %v, want 404 (kvsp.ErrNotFound)", err)
	}
	stale := 0
	for time.Since(wiped) < ttl-200*time.Millisecond {
		m, n, err := cons.load(ctx, ks)
		if err != nil {
			t.Fatalf("a stale record reached the user as an error: %v", err)
		}
		if n != 0 {
			t.Fatalf("loaded %d blocks from a wiped holder", n)
		}
		if m > 0 {
			stale++
		}
		time.Sleep(50 * time.Millisecond)
	}
	if stale == 0 {
		t.Fatal("no lookup saw the stale records: the crash path was not exercised")
	}
	time.Sleep(time.Until(wiped.Add(ttl + time.Millisecond)))
	if m, _, err := cons.load(ctx, ks); err != nil || m != 0 {
		t.Fatalf("at wipe+TTL: matched %d (%v): the stale records outlive their TTL", m, err)
	}
	if r := ratio(); r != 0 {
		t.Fatalf("hit ratio while the holder is empty %.2f", r)
	}
	time.Sleep(time.Until(wiped.Add(2 * ttl)))
	if n := mem.Len(); n != 0 {
		t.Fatalf("index size %d at wipe+2xTTL: phantom records", n)
	}
	t.Logf("crash: %d stale lookups, all misses without error; index empty at wipe+2xTTL", stale)

	// Recovery: the recomputed blocks are stored again; hits are back.
	store(cb)
	waitMatched(len(ks))
	if m, n, err := cons.load(ctx, ks); err != nil || m != len(ks) || n != len(ks) {
		t.Fatalf("after recovery: matched %d loaded %d: %v", m, n, err)
	}
	if r := ratio(); r != 1 {
		t.Fatalf("hit ratio after recovery %.2f", r)
	}

	// Orderly wipe: the holder withdraws on the way out; no stale window.
	hbOpen = false
	if err := hb.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if m, n, err := cons.load(ctx, ks); err != nil || m != 0 || n != 0 {
		t.Fatalf("after an orderly wipe: matched %d loaded %d (%v), want 0: not withdrawn", m, n, err)
	}
	if n := mem.Len(); n != 0 {
		t.Fatalf("index size %d after an orderly wipe, want 0", n)
	}
}

// S8 identities: h3 is a holder not trusted for the test scope; agent
// publishes for h1 by delegation (it speaks for h1's base URI).
const (
	h3Base  = "https://127.0.0.1/h3/"
	h3ID    = "spiffe://kvsp.test/holder/h3"
	agentID = "spiffe://kvsp.test/holder/agent"
	h2ID    = "spiffe://kvsp.test/holder/h2"
	h2Base  = "https://127.0.0.1/h2/"
	polS8   = pol2 + `  - {id: "` + h3ID + `", roles: [holder], speaks_for: ["` + h3Base + `"], scopes: [bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb]}
  - {id: "` + agentID + `", roles: [holder], speaks_for: ["` + h1 + `"], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + producerID + `", roles: [instance], speaks_for: ["` + producerBase + `"], scopes: [` + kvsptest.Scope + `]}
`
	// producerID is an instance that states the digests of the blocks
	// it computes (producer digests, S13).
	producerID   = "spiffe://kvsp.test/ii/producer"
	producerBase = "https://127.0.0.1/ii1/"
)

// isFixture is an IS on a TLS server with its own registry.
type isFixture struct {
	t   *testing.T
	pki *kvsptest.PKI
	srv *kvsptest.Server
	reg *prometheus.Registry
}

func startIS(t *testing.T, cfg index.Config, b index.Backend, policy string) *isFixture {
	f := &isFixture{t: t, pki: kvsptest.NewPKI(t), reg: prometheus.NewRegistry()}
	cfg.Registerer = f.reg
	svc, err := index.New(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	f.srv = kvsptest.StartServer(t, f.pki, kvsptest.Options{Policy: policy}, func(s *server.Server) {
		if err := svc.Mount(s.Mount("/is/")); err != nil {
			t.Fatal(err)
		}
	})
	return f
}

func (f *isFixture) client(id string) *client.Index {
	c, err := client.New(client.Config{TLS: f.pki.ClientTLS(f.pki.Leaf(id)), Attempts: 1})
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(c.Close)
	return c.Index(f.srv.URL("/is/"))
}

// rejected is kvsp_index_publish_rejected_total{reason}.
func (f *isFixture) rejected(reason string) float64 {
	f.t.Helper()
	mfs, err := f.reg.Gather()
	if err != nil {
		f.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "kvsp_index_publish_rejected_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestS8_UntrustedHolderPublishRefused (RELIABILITY.md S8, the IS half;
// R-IS-2, R-IS-3, A-28; spec "Cache poisoning"):
//   - a holder identity not trusted for scope S publishing a record for S
//     gets 403 kvsp-scope-denied, and nothing is stored (lookups miss, the
//     index is empty);
//   - a record whose holder is not the caller is refused with 403, unless
//     the caller is delegated (speaks for that base URI); a path naming
//     the caller over a body naming another holder is refused too;
//   - a delegated identity publishes for h1 (201, found by lookups), and is
//     itself refused for a holder it does not speak for, or a scope it is
//     not in;
//   - an untrusted holder cannot withdraw another's record;
//   - every refusal is counted by reason;
//   - with producer digests, a trusted holder publishing other bytes
//     (another digest, self-consistent) for a key is refused with 409 and
//     lookups return only the producer's digest; the same digest from
//     another holder is a true replica and accepted.
func TestS8_UntrustedHolderPublishRefused(t *testing.T) {
	ctx := context.Background()
	mem := index.NewMemory(time.Second)
	defer mem.Close()
	f := startIS(t, index.Config{MaxTTL: time.Minute, MaxLookupKeys: 8}, mem, polS8)
	a := f.client(kvsptest.ClientA)
	stored := func(k byte) int {
		t.Helper()
		resp, err := a.Lookup(ctx, &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: chain(int(k), 1)})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Matched
	}
	status := func(err error) int {
		var p *kvsp.Problem
		if errors.As(err, &p) {
			return p.Status
		}
		return 0
	}

	// An untrusted holder, publishing its own record for S.
	h3 := f.client(h3ID)
	_, _, err := h3.Publish(ctx, rec(h3Base, 1, 60000))
	if !errors.Is(err, kvsp.ErrScopeDenied) || status(err) != 403 {
		t.Fatalf("holder not trusted for the scope: %v, want 403 kvsp-scope-denied", err)
	}
	if stored(1) != 0 || mem.Len() != 0 {
		t.Fatalf("the refused record was stored (matched %d, index size %d)", stored(1), mem.Len())
	}
	// A trusted holder, publishing a record in h1's name.
	h2 := f.client(h2ID)
	if _, _, err := h2.Publish(ctx, rec(h1, 2, 60000)); !errors.Is(err, kvsp.ErrForbidden) || status(err) != 403 {
		t.Fatalf("h2 publishing for h1: %v, want 403", err)
	}
	if stored(2) != 0 || mem.Len() != 0 {
		t.Fatal("a record in another holder's name was stored")
	}
	// The same, with the path naming the caller and the body h1.
	body, _ := kvsp.Marshal(rec(h1, 2, 60000))
	tr := &http.Transport{TLSClientConfig: f.pki.ClientTLS(f.pki.Leaf(h2ID))}
	hc := kvsptest.HTTPClient(t, tr)
	req, _ := http.NewRequest(http.MethodPut, f.srv.URL("/is/replicas/"+kvsp.ResourceID(h2Base)+"/"+kvsp.BlockKey{2, 1}.String()), bytes.NewReader(body))
	req.Header.Set("Content-Type", kvsp.MediaType)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 && resp.StatusCode != 403 {
		t.Fatalf("path naming h2, record naming h1: %d, want 400 or 403", resp.StatusCode)
	}
	if stored(2) != 0 || mem.Len() != 0 {
		t.Fatal("a record in another holder's name was stored through a path naming the caller")
	}
	// A holder delegated for h1's base (positive check: the refusals above
	// are about trust, not a broken publish).
	agent := f.client(agentID)
	got, created, err := agent.Publish(ctx, rec(h1, 3, 60000))
	if err != nil || !created || got.Holder != h1 {
		t.Fatalf("delegated publish for h1: %+v %v %v", got, created, err)
	}
	if lr, err := a.Lookup(ctx, &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: chain(3, 1)}); err != nil || lr.Matched != 1 || lr.Replicas[0][0].Holder != h1 {
		t.Fatalf("the delegated record: %+v %v", lr, err)
	}
	if _, _, err := agent.Publish(ctx, rec(h2Base, 4, 60000)); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("delegate publishing for a base it does not speak for: %v", err)
	}
	// h1-other speaks for h1 too, but is not trusted for S.
	if _, _, err := f.client("spiffe://kvsp.test/holder/h1-other").Publish(ctx, rec(h1, 4, 60000)); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Fatalf("delegate outside the scope: %v", err)
	}
	// An untrusted holder cannot withdraw it.
	if err := h3.Withdraw(ctx, h1, kvsp.BlockKey{3, 1}); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("h3 withdrawing h1's record: %v", err)
	}
	if stored(3) != 1 || stored(4) != 0 || mem.Len() != 1 {
		t.Fatalf("after the refusals: index size %d, want only the delegated record", mem.Len())
	}
	for reason, want := range map[string]float64{"scope": 2, "holder": 2, "path": 1} {
		if got := f.rejected(reason); got != want {
			t.Errorf("publish_rejected_total{reason=%q} = %v, want %v", reason, got, want)
		}
	}

	// Producer digests: other bytes under a self-consistent digest. The
	// first holder to publish is not trusted because it was first: no
	// record is accepted before the producer states its digest (S13).
	mem2 := index.NewMemory(time.Second)
	defer mem2.Close()
	g := startIS(t, index.Config{MaxTTL: time.Minute, MaxLookupKeys: 8, ProducerDigests: true}, mem2, polS8)
	if _, _, err := g.client(kvsptest.Holder1).Publish(ctx, rec(h1, 5, 60000)); !errors.Is(err, kvsp.ErrConflict) || status(err) != 409 || !strings.Contains(err.Error(), "no producer") {
		t.Fatalf("a record before its producer's statement: %v, want 409", err)
	}
	stmt := &kvsp.ProducerRecord{BlockKey: kvsp.BlockKey{5, 1}, ScopeID: scope, CompatID: kvsp.CompatID{1}, Producer: producerBase, Digest: kvsp.Digest{1}, TTLMs: 60000}
	if _, err := g.client(h2ID).StateDigest(ctx, stmt); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("a holder stating a producer's digest: %v, want 403", err)
	}
	other := *stmt
	other.Producer = h2Base
	if _, err := g.client(producerID).StateDigest(ctx, &other); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("a producer stating for a base it does not speak for: %v, want 403", err)
	}
	if _, err := g.client(producerID).StateDigest(ctx, stmt); err != nil {
		t.Fatal(err)
	}
	// The producer's digest beside layer digests that do not hash to it
	// (consumers verify layers against those): 400.
	forged := rec(h1, 5, 60000)
	forged.LayerDigests = make([]kvsp.LayerDigest, 32) // one per layer of its residency, the producer's digest unexplained
	if _, _, err := g.client(kvsptest.Holder1).Publish(ctx, forged); !errors.Is(err, kvsp.ErrInvalid) || status(err) != 400 {
		t.Fatalf("the producer's digest with layer digests of its own: %v, want 400", err)
	}
	if _, _, err := g.client(kvsptest.Holder1).Publish(ctx, rec(h1, 5, 60000)); err != nil {
		t.Fatal(err)
	}
	wrong := rec(h2Base, 5, 60000)
	wrong.Digest = kvsp.Digest{0xee}
	if _, _, err := g.client(h2ID).Publish(ctx, wrong); !errors.Is(err, kvsp.ErrConflict) || status(err) != 409 {
		t.Fatalf("another digest for the producer's key: %v, want 409", err)
	}
	if _, _, err := g.client(h2ID).Publish(ctx, rec(h2Base, 5, 60000)); err != nil {
		t.Fatalf("a true replica (the producer's digest) from h2: %v", err)
	}
	lr, err := g.client(kvsptest.ClientA).Lookup(ctx, &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: chain(5, 1)})
	if err != nil || lr.Matched != 1 || len(lr.Replicas[0]) != 2 {
		t.Fatalf("lookup: %+v %v", lr, err)
	}
	for _, r := range lr.Replicas[0] {
		if r.Digest != (kvsp.Digest{1}) {
			t.Fatalf("a replica with another digest than the producer's: %+v", r)
		}
	}
	if got := g.rejected("digest"); got != 1 {
		t.Errorf("publish_rejected_total{reason=digest} = %v, want 1", got)
	}
}

// probeCounter counts every call that reaches the backend. Its lookups of
// keys that exist cost hitCost more, as a shared store's do (records to
// transfer and decode): a timing oracle for a service that probed before
// authorizing, which the S9 test must not find.
type probeCounter struct {
	index.Backend
	calls   atomic.Int64
	hitCost time.Duration
}

func (p *probeCounter) Put(ctx context.Context, r *kvsp.ReplicaRecord, ttl time.Duration, pin index.PutOptions) (bool, error) {
	p.calls.Add(1)
	return p.Backend.Put(ctx, r, ttl, pin)
}

func (p *probeCounter) Delete(ctx context.Context, holder string, k kvsp.BlockKey, authorize func(*kvsp.ReplicaRecord) error) error {
	p.calls.Add(1)
	return p.Backend.Delete(ctx, holder, k, authorize)
}

func (p *probeCounter) Lookup(ctx context.Context, s kvsp.ScopeID, c kvsp.CompatID, ks []kvsp.BlockKey, res *index.Result) error {
	p.calls.Add(1)
	err := p.Backend.Lookup(ctx, s, c, ks, res)
	if len(res.Replicas) > 0 {
		time.Sleep(p.hitCost)
	}
	return err
}

// TestS9_NoAuthorizationOracleInLookups (RELIABILITY.md S9, the IS half;
// R-SEC-6, A-11): 2,000 lookups by a client not authorized for the scope,
// half for keys that have records and half for keys that do not, sent in
// interleaved pairs (random order within a pair) over one connection.
//   - All are 403 kvsp-scope-denied with the same problem body (no content
//     oracle), and authorization comes before any probe: the backend
//     counts 0 calls (a paired authorized lookup first shows the keys do
//     exist and that the counter counts).
//   - The two latency distributions are indistinguishable: two-sample
//     Kolmogorov-Smirnov p > 0.01, though the backend makes a hit cost
//     200 us more, so a service that probed first would be seen (the test
//     also checks it can see such a difference: the same samples shifted
//     by a quarter of their median give p < 0.01).
func TestS9_NoAuthorizationOracleInLookups(t *testing.T) {
	pairs, warm := 1000, 50
	if s := os.Getenv("KVSP_S9_PAIRS"); s != "" { // a longer variant
		pairs, _ = strconv.Atoi(s)
	}
	ctx := context.Background()
	mem := index.NewMemory(time.Second)
	defer mem.Close()
	pc := &probeCounter{Backend: mem, hitCost: 200 * time.Microsecond}
	f := startIS(t, index.Config{MaxTTL: time.Hour, MaxLookupKeys: 8}, pc, pol2)
	exists := func(i int) kvsp.BlockKey { return kvsp.BlockKey{0xe0, byte(i), byte(i >> 8), 1} }
	absent := func(i int) kvsp.BlockKey { return kvsp.BlockKey{0xa0, byte(i), byte(i >> 8), 1} }
	for i := range pairs + warm {
		r := rec(h1, 0, 3600000)
		r.BlockKey = exists(i)
		if _, err := mem.Put(ctx, r, time.Hour, index.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Paired positive check: the keys exist for an authorized client, and
	// its lookup reaches the backend.
	resp, err := f.client(kvsptest.ClientA).Lookup(ctx, &kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: []kvsp.BlockKey{exists(7)}})
	if err != nil || resp.Matched != 1 || pc.calls.Load() != 1 {
		t.Fatalf("authorized lookup: %+v %v, %d backend calls", resp, err, pc.calls.Load())
	}
	pc.calls.Store(0)

	body := func(k kvsp.BlockKey) []byte {
		b, err := kvsp.Marshal(&kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: []kvsp.BlockKey{k}})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	hc := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: f.pki.ClientTLS(f.pki.Leaf("spiffe://kvsp.test/client/b"))})
	url := f.srv.URL("/is/lookup")
	var problems [2]*kvsp.Problem
	send := func(b []byte, which int) float64 {
		req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
		req.Header.Set("Content-Type", kvsp.MediaType)
		start := time.Now()
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		out, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		d := time.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		p := client.ProblemFrom(&http.Response{StatusCode: resp.StatusCode, Header: resp.Header, Body: io.NopCloser(bytes.NewReader(out))})
		var prob *kvsp.Problem
		if resp.StatusCode != 403 || !errors.As(p, &prob) || !errors.Is(p, kvsp.ErrScopeDenied) {
			t.Fatalf("unauthorized lookup: %d %s", resp.StatusCode, out)
		}
		prob.Instance = "" // the request id
		if problems[which] == nil {
			problems[which] = prob
		} else if !reflect.DeepEqual(prob, problems[which]) {
			t.Fatalf("problem bodies differ between requests: %+v %+v", prob, problems[which])
		}
		return float64(d) / float64(time.Microsecond)
	}
	rng := rand.New(rand.NewPCG(9, 9))
	var hit, miss []float64
	for i := range pairs + warm {
		eb, ab := body(exists(i)), body(absent(i))
		var e, a float64
		if rng.IntN(2) == 0 {
			e, a = send(eb, 0), send(ab, 1)
		} else {
			a, e = send(ab, 1), send(eb, 0)
		}
		if i >= warm {
			hit, miss = append(hit, e), append(miss, a)
		}
	}
	if n := pc.calls.Load(); n != 0 {
		t.Errorf("%d backend calls during %d unauthorized lookups, want 0 (authorize before any probe)", n, 2*(pairs+warm))
	}
	if !reflect.DeepEqual(problems[0], problems[1]) {
		t.Errorf("the problem for existing keys differs from that for absent ones: %+v / %+v", problems[0], problems[1])
	}
	d, p := kvsptest.KSTwoSample(hit, miss)
	med := func(x []float64) float64 { y := slices.Clone(x); slices.Sort(y); return y[len(y)/2] }
	t.Logf("%d+%d unauthorized lookups: median %.0f / %.0f us (existing / absent keys); KS D %.4f p %.4f; backend calls %d",
		len(hit), len(miss), med(hit), med(miss), d, p, pc.calls.Load())
	if p <= 0.01 {
		t.Errorf("latencies for existing and absent keys differ: KS D %.4f p %.4g (want p > 0.01): a timing oracle", d, p)
	}
	shifted := slices.Clone(miss)
	for i := range shifted {
		shifted[i] += med(miss) / 4
	}
	if _, ps := kvsptest.KSTwoSample(hit, shifted); ps >= 0.01 {
		t.Errorf("the test cannot see a shift of a quarter of the median (p %.4g): too few or too noisy samples", ps)
	}
	figures.Report(t, figures.Row{Row: "S9", Inputs: int64(len(hit) + len(miss)),
		Held:   fmt.Sprintf("%d+%d unauthorized lookups of existing and absent keys: 0 backend calls, latencies indistinguishable (KS p %.2f)", len(hit), len(miss), p),
		Detail: map[string]float64{"lookups": float64(len(hit) + len(miss)), "ks_p": p, "backend_calls": float64(pc.calls.Load())}})
}

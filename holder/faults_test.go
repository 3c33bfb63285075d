package holder_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestL4_ConcurrentPutGetOneKey (RELIABILITY L4, R-BLK-14, A-4): 16
// clients PUT different bytes for one key with If-None-Match: * while 16
// GET it: exactly one PUT wins, the others get 412, and every GET sees
// 404 or the whole winning block, verified, never torn bytes.
func TestL4_ConcurrentPutGetOneKey(t *testing.T) {
	f := start(t, 1<<20)
	hc := f.hold[kvsptest.ClientA]
	blocks := make([][]byte, 16)
	digests := map[container.Digest]int{}
	for i := range blocks {
		var blk *container.Block
		blocks[i], blk = makeBlock(uint64(100+i), 0, 4)
		digests[blk.ContainerDigest()] = i
	}
	// Every PUT that gets past the holder's early existence check waits
	// there, so that several reach the store at once and the store alone
	// must let one win.
	t.Cleanup(failpoint.Reset)
	failpoint.Enable("holder/put-checked", "16*sleep(200ms)")
	var wg sync.WaitGroup
	var mu sync.Mutex
	won, lost := -1, 0
	seen := map[int]int{} // winner index -> GETs that saw it
	misses := 0
	for i := range 16 {
		wg.Go(func() {
			_, blk := makeBlock(uint64(100+i), 0, 4)
			err := hc.PutBlock(context.Background(), ref(40), bytes.NewReader(blocks[i]), int64(len(blocks[i])), blk.ContainerDigest())
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				if won >= 0 {
					t.Errorf("two PUTs won: %d and %d", won, i)
				}
				won = i
			case errors.Is(err, client.ErrExists):
				lost++
			default:
				t.Errorf("PUT %d: %v", i, err)
			}
		})
		wg.Go(func() {
			// 20 GETs, and on until one has seen the block (the PUTs wait
			// 200 ms at the failpoint), within 10 s.
			sawIt := func() bool { mu.Lock(); defer mu.Unlock(); return won >= 0 && seen[won] > 0 }
			for n, deadline := 0, time.Now().Add(10*time.Second); n < 20 || !sawIt() && time.Now().Before(deadline); n++ {
				if n >= 20 {
					time.Sleep(2 * time.Millisecond)
				}
				s, err := hc.GetBlock(context.Background(), ref(40), geom, client.GetOptions{})
				if errors.Is(err, kvsp.ErrNotFound) {
					mu.Lock()
					misses++
					mu.Unlock()
					continue
				}
				if err != nil {
					t.Errorf("GET: %v", err)
					return
				}
				var got bytes.Buffer
				hdr, _ := s.Reader.Header()
				var h [4096]byte
				got.Write(hdr.Append(h[:0]))
				for {
					l, err := s.Next()
					if err != nil {
						if err.Error() != "EOF" {
							t.Errorf("GET body: %v", err)
						}
						break
					}
					got.Write(l.K)
					got.Write(l.V)
				}
				s.Close()
				blk, err := container.OpenBlock(got.Bytes(), geom)
				if err != nil {
					t.Errorf("a GET saw a torn block: %v", err)
					continue
				}
				idx, ok := digests[blk.ContainerDigest()]
				if !ok || !bytes.Equal(got.Bytes(), blocks[idx]) {
					t.Error("a GET saw bytes no client PUT")
					continue
				}
				mu.Lock()
				seen[idx]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if hits := failpoint.Hits("holder/put-checked"); hits < 2 {
		t.Fatalf("%d PUTs got past the early check; the store's own check was not raced", hits)
	}
	if won < 0 || lost != 15 {
		t.Fatalf("winner %d, %d PUTs refused with 412; want one winner and 15", won, lost)
	}
	if seen[won] == 0 {
		t.Fatal("no GET saw the winning block")
	}
	for idx := range seen {
		if idx != won {
			t.Fatalf("a GET saw PUT %d's bytes; PUT %d won", idx, won)
		}
	}
	t.Logf("PUT %d won; GETs: %d saw it, %d missed before it landed", won, seen[won], misses)
}

// TestF3_LeaseExpiresDuringSlowGET (RELIABILITY F3): a GET stopped
// half-way (the failpoint holder/get-midway pauses the handler before it
// reads the rest of the block's memory), its lease expired and its block
// evicted meanwhile by PUTs that take the freed memory, still delivers
// the whole block, every layer verified: the holder keeps the streamed
// buffer until the stream ends.
func TestF3_LeaseExpiresDuringSlowGET(t *testing.T) {
	t.Cleanup(failpoint.Reset)
	data, blk := bigBlock(3)
	f := start(t, 2*int64(len(data)), func(c *holder.Config) {
		c.Geometries = map[kvsp.CompatID]container.Geometry{compat: geom, bigCompat: bigGeom}
		c.LeaseQuota.Octets = 1 << 30
	})
	hc := f.hold[kvsptest.ClientA]
	bref := func(k byte) client.BlockRef { r := ref(k); r.Compat = bigCompat; return r }
	if err := hc.PutBlock(context.Background(), bref(1), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	if _, err := hc.Lease(context.Background(), &kvsp.LeaseRequest{ScopeID: scope, CompatID: bigCompat, BlockKeys: []kvsp.BlockKey{bref(1).Key}, TTLMs: 300}); err != nil {
		t.Fatal(err)
	}
	failpoint.Enable("holder/get-midway", "1*pause")
	evicted := make(chan error, 1)
	go func() { // once the stream has stopped half-way: the lease ends, the block is evicted
		defer failpoint.Disable("holder/get-midway")
		for failpoint.Hits("holder/get-midway") == 0 {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(350 * time.Millisecond)
		for k := byte(4); k < 7; k++ {
			d, b := bigBlock(k)
			if err := hc.PutBlock(context.Background(), bref(k), bytes.NewReader(d), int64(len(d)), b.ContainerDigest()); err != nil {
				evicted <- err
				return
			}
		}
		_, err := hc.GetBlock(context.Background(), bref(1), bigGeom, client.GetOptions{})
		if !errors.Is(err, kvsp.ErrNotFound) {
			err = fmt.Errorf("the block was not evicted: %v", err)
		} else {
			err = nil
		}
		evicted <- err
	}()
	slow, _ := client.New(client.Config{TLS: f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA)), Attempts: 1})
	defer slow.Close()
	s, err := slow.Holder(f.srv.URL("/h1/")).GetBlock(context.Background(), bref(1), bigGeom, client.GetOptions{LayerDigests: blk.LayerDigests()})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var got bytes.Buffer
	for i := 0; ; i++ {
		l, err := s.Next()
		if err != nil {
			if err != io.EOF {
				t.Fatalf("after %d layers: %v", i, err)
			}
			break
		}
		got.Write(l.K)
		got.Write(l.V)
	}
	if err := <-evicted; err != nil {
		t.Fatal(err)
	}
	_, hl, _ := container.ParseHeader(data, bigGeom)
	if want := data[hl:]; !bytes.Equal(got.Bytes(), want) {
		t.Fatal("the slow GET delivered other bytes")
	}
}

// TestB4_PathAndQueryParsing (RELIABILITY B4, R-HTTP-*, A-16): malformed
// block paths and queries get 400 or 404 problem details, never another
// resource's bytes, and the holder keeps serving.
func TestB4_PathAndQueryParsing(t *testing.T) {
	f := start(t, 1<<20)
	data, blk := makeBlock(7, 0, 4)
	r := ref(0xab) // a key with hex letters
	if err := f.hold[kvsptest.ClientA].PutBlock(context.Background(), r, bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	good := path(r)
	c, s, k := r.Compat.String(), r.Scope.String(), r.Key.String()
	const sameOr404 = -1 // a path the server cleans, redirecting to this very block
	for p, want := range map[string]int{
		"/h1/blocks/" + c + "/" + strings.ToUpper(s) + "/" + k: 400, // hex ids are lower case
		"/h1/blocks/" + c + "/" + s + "/" + strings.ToUpper(k): 400,
		"/h1/blocks/" + c[:62] + "/" + s + "/" + k:             400, // wrong lengths
		"/h1/blocks/" + c + "/" + s[:30] + "/" + k:             400,
		"/h1/blocks/" + c + "/" + s + "/" + k + "00":           400,
		"/h1/blocks/" + c + "%2F" + s + "/" + k:                404, // an escaped slash is not a separator
		"/h1/blocks/" + c + "/" + s + "/../" + s + "/" + k:     sameOr404,
		"/h1/blocks/" + c + "/" + s + "/" + k + "/extra":       404,
		"/h1/blocks/" + c + "/" + s:                            404,
		good + "?layers=5-2":                                   400,
		good + "?layers=0-":                                    400,
		good + "?layers=0-1e30":                                400,
		good + "?layers=-1-2":                                  400,
		good + "?layers=%2B1-2":                                400,
		good + "?layers=3-4":                                   404, // past the end: kvsp-layers-unavailable
		good + "?codec=0xFFFF":                                 400,
		good + "?codec=65536":                                  400,
	} {
		st, hdr, body := f.raw(t, kvsptest.ClientA, "GET", p, nil, nil)
		if want == sameOr404 {
			if (st == 200 && bytes.Equal(body, data)) || st == 404 {
				continue
			}
			want = 404
		}
		if st != want || !strings.Contains(hdr.Get("Content-Type"), "problem+json") || bytes.Contains(body, data[len(data)-64:]) {
			t.Errorf("%s: %d %s %.120q", p, st, hdr.Get("Content-Type"), body)
		}
	}
	if st, _, body := f.raw(t, kvsptest.ClientA, "GET", good, nil, nil); st != 200 || !bytes.Equal(body, data) {
		t.Fatalf("the holder stopped serving: %d", st)
	}
}

// TestS5_CrossScopeIsolationPaired (RELIABILITY S5, R-BLK-13, R-BLK-19,
// R-IS-*): an identity without scope S is refused every way into S (GET,
// PUT, lease, lookup), before any probe; the paired positive check shows
// the same requests succeed for an identity of S, so the test cannot pass
// with the cache off.
func TestS5_CrossScopeIsolationPaired(t *testing.T) {
	f := start(t, 1<<20)
	data, blk := makeBlock(9, 0, 4)
	if err := f.hold[kvsptest.ClientA].PutBlock(context.Background(), ref(9), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	other := f.hold["spiffe://kvsp.test/client/nosc"] // scope bbbb… only
	if _, err := other.GetBlock(context.Background(), ref(9), geom, client.GetOptions{}); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Errorf("GET into another scope: %v", err)
	}
	if _, err := other.GetBlock(context.Background(), ref(99), geom, client.GetOptions{}); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Errorf("GET of an absent block of another scope: %v (not 403: an existence oracle)", err)
	}
	if err := other.PutBlock(context.Background(), ref(98), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Errorf("PUT into another scope: %v", err)
	}
	if _, err := other.Lease(context.Background(), &kvsp.LeaseRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{ref(9).Key}, TTLMs: 1000}); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Errorf("lease in another scope: %v", err)
	}
	oc, _ := client.New(client.Config{TLS: f.pki.ClientTLS(f.pki.Leaf("spiffe://kvsp.test/client/nosc"))})
	defer oc.Close()
	if _, err := oc.Index(f.srv.URL("/is/")).Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{ref(9).Key}}); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Errorf("lookup in another scope: %v", err)
	}
	// The same keys under the identity's own scope: no B replica.
	bScope, _ := kvsp.ParseScopeID(strings.Repeat("b", 32))
	if r, err := oc.Index(f.srv.URL("/is/")).Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: bScope, CompatID: compat, BlockKeys: []kvsp.BlockKey{ref(9).Key}}); err != nil || r.Matched != 0 {
		t.Errorf("A's keys under B's scope: %+v %v", r, err)
	}
	// Paired positive: a second identity of the scope gets it all.
	b := f.hold["spiffe://kvsp.test/client/b"]
	s, err := b.GetBlock(context.Background(), ref(9), geom, client.GetOptions{LayerDigests: blk.LayerDigests()})
	if err != nil {
		t.Fatalf("the paired positive GET: %v", err)
	}
	s.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := f.is.Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{ref(9).Key}})
		if err == nil && r.Matched == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the paired positive lookup: %+v %v", r, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestL1_LeaseQuotaFairness (RELIABILITY L1, R-LS-6, R-PF-13): a client
// that leases until its quota answers 429 kvsp-lease-quota (with
// Retry-After) does not take anything from another client, whose leases
// and GETs go on; releasing gives the first its quota back.
func TestL1_LeaseQuotaFairness(t *testing.T) {
	f := start(t, 1<<20) // quota: 2 leases, 3 blocks' octets per client
	ctx := context.Background()
	x, y := f.hold[kvsptest.ClientA], f.hold["spiffe://kvsp.test/client/b"]
	for i := byte(1); i <= 4; i++ {
		data, blk := makeBlock(uint64(i), 0, 4)
		if err := x.PutBlock(ctx, ref(i), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
	}
	lease := func(h *client.Holder, k byte) (*kvsp.LeaseResponse, error) {
		return h.Lease(ctx, &kvsp.LeaseRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{ref(k).Key}, TTLMs: 5000})
	}
	var held []string
	for k := byte(1); ; k++ {
		l, err := lease(x, k)
		if err != nil {
			if !errors.Is(err, kvsp.ErrLeaseQuota) {
				t.Fatalf("lease %d: %v, want 429 kvsp-lease-quota", k, err)
			}
			break
		}
		held = append(held, l.Lease)
		if k > 10 {
			t.Fatal("no quota")
		}
	}
	st, hdr, _ := f.raw(t, kvsptest.ClientA, "POST", "/h1/leases", map[string]string{"Content-Type": kvsp.MediaType},
		[]byte(`{"scope_id":"`+scope.String()+`","compat_id":"`+compat.String()+`","block_keys":["`+ref(4).Key.String()+`"],"ttl_ms":5000}`))
	if st != 429 || hdr.Get("Retry-After") == "" {
		t.Fatalf("over the quota: %d, Retry-After %q", st, hdr.Get("Retry-After"))
	}
	var yHeld []string
	for k := byte(1); k <= 2; k++ { // the other client is untouched
		l, err := lease(y, k)
		if err != nil {
			t.Fatalf("the other client's lease %d: %v", k, err)
		}
		yHeld = append(yHeld, l.Lease)
		s, err := y.GetBlock(ctx, ref(k), geom, client.GetOptions{})
		if err != nil {
			t.Fatalf("the other client's GET: %v", err)
		}
		s.Close()
	}
	for _, id := range yHeld {
		if err := y.ReleaseLease(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	// Y's service while X hammers the lease API past its quota: every
	// request of Y succeeds, and its p99 stays within 3x (+20 ms) of
	// its p99 before.
	yRound := func() (time.Duration, error) {
		start := time.Now()
		l, err := lease(y, 3)
		if err != nil {
			return 0, err
		}
		s, err := y.GetBlock(ctx, ref(3), geom, client.GetOptions{})
		if err != nil {
			return 0, err
		}
		for {
			if _, err := s.Next(); err != nil {
				s.Close()
				if !errors.Is(err, io.EOF) {
					return 0, err
				}
				break
			}
		}
		return time.Since(start), y.ReleaseLease(ctx, l.Lease)
	}
	p99 := func(n int) time.Duration {
		var ds []time.Duration
		for range n {
			d, err := yRound()
			if err != nil {
				t.Fatalf("the other client: %v", err)
			}
			ds = append(ds, d)
		}
		slices.Sort(ds)
		return ds[len(ds)*99/100]
	}
	before := p99(200)
	stop := make(chan struct{})
	var flood sync.WaitGroup
	var refused atomic.Int64
	for range 4 {
		flood.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := lease(x, 4); errors.Is(err, kvsp.ErrLeaseQuota) {
					refused.Add(1)
				}
			}
		})
	}
	during := p99(200)
	close(stop)
	flood.Wait()
	t.Logf("Y's p99: %v before, %v while X was refused %d leases", before, during, refused.Load())
	if refused.Load() == 0 {
		t.Fatal("X's flood was never refused: the measurement proves nothing")
	}
	if during > 3*before+20*time.Millisecond {
		t.Fatalf("Y's p99 went from %v to %v under X's flood", before, during)
	}
	// The TTL cap: a lease asked for longer than the holder grants is
	// refused with the limit (429 kvsp-lease-quota, max_ttl_ms).
	_, err := y.Lease(ctx, &kvsp.LeaseRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{ref(2).Key}, TTLMs: 1 << 40})
	var p *kvsp.Problem
	if !errors.Is(err, kvsp.ErrLeaseQuota) || !errors.As(err, &p) || p.Extensions["max_ttl_ms"] == nil {
		t.Fatalf("a lease of 2^40 ms: %v, want 429 kvsp-lease-quota with max_ttl_ms", err)
	}
	if err := x.ReleaseLease(ctx, held[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := lease(x, 4); err != nil {
		t.Fatalf("after a release: %v", err)
	}
}

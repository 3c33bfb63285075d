package instance_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestL2_Soak (RELIABILITY L2): a mixed workload on the whole system over
// mutual TLS on loopback — block PUTs and verified GETs, leases (released,
// or left to expire), IS lookups, the holders' publishes and refreshes,
// top-p sessions with their placements, prefetches, checkpoints and
// status records — for KVSP_L2_DURATION (a few seconds in make test, 30
// minutes in make soak, under -race there). Then the clients stop and two
// record TTLs pass, and what the warm-up left is compared with what the
// load left: the IS holds exactly one record per block the holders hold
// (stored and not evicted, by their counters: a block the warm-up did
// not happen to store, under a loaded machine, the load may store; an
// equal count before and after failed make chaos that way), the PC no
// session (each was forgotten after its
// retention), no lease is live and no octet is leased; goroutines are
// within 2 of their level and open files within 1; the live heap (what
// the objects still reachable hold, after three collections) within 5%
// (7% for a run of seconds);
// and every record the IS returns is served by its holder (no expired or
// phantom records).
//
// The live heap, not the heap in use: the spans in use also count what
// the allocator keeps of partly filled spans, which grows under -race
// with no object more (at 7bca845 and aa0ac39 the nightly's 30-minute
// soak ended with the heap in use up 5.5% and 5.6%, while a 5-minute
// soak under -race had the live heap up 0.7% and its objects fewer).
//
// The warm-up is a tenth of the load, at least 3 s, because the state
// that is bounded but not full after a few seconds fills at the pace of
// new header values, not of operations. At 176309d, with 3 s of warm-up,
// the 30-minute soak ended with the live heap up 7.8% (5.7 to 6.1 MiB).
// Heap profiles at the warm-up's level and every 4 minutes of a 12-minute
// soak under -race (KVSP_L2_HEAP, KVSP_L2_HEAP_EVERY; up 2.6% in all),
// diffed, put what grew in two places: the HPACK dynamic tables (hpack's
// addEntry, 81 KiB after the warm-up, 145 at 4 minutes, 156 at 8, 172 at
// 12; at most 4 KiB of fields per direction per connection, RFC 7541
// section 4.2, filled by a new Date every second and by the paths and
// leases of the requests) and the PC's session map at its peak (Go maps
// keep their buckets; placeOn's insert, 11 KiB then 48-70 KiB). Both
// bounded: without -race, 15 minutes and 4,101,197 operations left the
// live heap 0.8% lower than the warm-up did (6.1 to 6.0 MiB). With a
// tenth of warm-up, the nightly at a923fd7 (3 minutes, then 30 and
// 1,223,781 operations under -race) ended with the live heap up 1.1%,
// 65 KiB of it the same two, diffed from make soak's profiles.
//
// The 5%, measured on the heap in use at 4 s runs: with a 1 s warm-up it
// rose by 10.3-12.4% over 5 runs (about 1 MiB of 9.3), and by 2.2-2.3%
// over 2 runs of 16 s (3 s of warm-up): pools and maps still filling, not
// a leak (four times the operations left less). With 3 s of warm-up,
// 5 runs of 4 s rose by 0.6-2.3%, 2 under -race by 0.6-0.7%. The
// agent never forgetting a finished directive (a mutation of make
// mutants) rose by 18.6%, about 2 MiB, which the former tolerance of
// max(5%, 4 MiB) let pass.
func TestL2_Soak(t *testing.T) {
	const leaseTTL = time.Second // a lease's life: a GET outlasting it on a busy machine finds it expired
	dur := 4 * time.Second
	if d, err := time.ParseDuration(os.Getenv("KVSP_L2_DURATION")); err == nil && d > 0 {
		dur = d
	}
	const ttl = 2 * time.Second
	holderReg := prometheus.NewRegistry()
	w := newRig(t, rigOptions{recordTTL: ttl, holderReg: holderReg, sessionRetention: ttl})
	w.runAgents(t, "/ii1/")
	ctx := context.Background()
	runCtx, stopRun := context.WithCancel(ctx) // the PC's sweep: migrations, forgetting finished sessions
	runDone := make(chan struct{})
	go func() { w.ctl.Run(runCtx, 100*time.Millisecond); close(runDone) }()
	defer func() { stopRun(); <-runDone }()

	// 64 blocks: the set the load reads and writes (the store saturates
	// during the warm-up, so the heap can come back to its level).
	prompts := make([][]uint32, 16)
	var keys []kvsp.BlockKey
	for i := range prompts {
		prompts[i] = prompt(4)
		for j := range prompts[i] {
			prompts[i][j] += uint32(i) << 20
		}
		ks, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, prompts[i])
		keys = append(keys, ks...)
	}
	type blk struct {
		ref client.BlockRef
		b   []byte
		d   container.Digests
	}
	blocks := make([]blk, len(keys))
	for i := range prompts {
		for j := range 4 {
			b, d := w.blockBytes(t, prompts[i], j)
			blocks[i*4+j] = blk{client.BlockRef{Compat: w.compat, Scope: w.scopeKey.ID(), Key: keys[i*4+j]}, b, d}
		}
	}
	var ops, failures, quota, expired atomic.Int64
	var firstErr atomic.Pointer[error]
	fail := func(err error) {
		failures.Add(1)
		firstErr.CompareAndSwap(nil, &err)
	}
	// load runs the clients for d, and on past it (for at most most)
	// until they have done minOps operations.
	load := func(d time.Duration, minOps int64, most time.Duration) {
		begin, first := time.Now(), ops.Load()
		more := func() bool {
			el := time.Since(begin)
			return el < d || (ops.Load()-first < minOps && el < most)
		}
		var wg sync.WaitGroup
		for g := range 6 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(g), 2))
				for more() {
					b := blocks[rng.IntN(len(blocks))]
					var err error
					switch g {
					case 0: // PUT (the first one stores; later ones are 412)
						err = w.src.PutBlock(ctx, b.ref, bytes.NewReader(b.b), int64(len(b.b)), b.d.Container)
						if errors.Is(err, client.ErrExists) {
							err = nil
						}
					case 1, 2: // lease, verified GET, release (or leave it to expire)
						var ls *kvsp.LeaseResponse
						asked := time.Now()
						ls, err = w.src.Lease(ctx, &kvsp.LeaseRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: []kvsp.BlockKey{b.ref.Key}, TTLMs: uint64(leaseTTL.Milliseconds())})
						if errors.Is(err, kvsp.ErrNotFound) {
							err = nil // not stored yet
							break
						}
						if errors.Is(err, kvsp.ErrLeaseQuota) {
							// A quarter of the leases are left to expire:
							// on a fast machine they pass the client's
							// quota (256 at once), which then holds.
							quota.Add(1)
							err = nil
							break
						}
						if err == nil {
							err = getVerified(ctx, w.src, b.ref, w, b.d)
							if rng.IntN(4) != 0 {
								rerr := w.src.ReleaseLease(ctx, ls.Lease)
								if errors.Is(rerr, kvsp.ErrNotFound) && time.Since(asked) > leaseTTL {
									// The GET outlasted the lease (a busy
									// machine): it expired, as it must.
									// Sooner, a lease not found is a failure.
									expired.Add(1)
									rerr = nil
								}
								if err == nil {
									err = rerr
								}
							}
						}
					case 3: // lookups
						_, err = w.front.Index(w.isURL).Lookup(ctx, &kvsp.LookupRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: keys[:16]})
					default: // sessions: place, prefetch, generate, checkpoints
						// One seed per prompt: the generated blocks the
						// instance offloads repeat, so the holders' caches
						// fill during the warm-up and the heap can settle.
						k := rng.IntN(len(prompts))
						q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: prompts[k], MaxTokens: 24,
							Sampler: &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: uint64(k) << 40}}
						sctx, cancel := context.WithTimeout(ctx, 20*time.Second)
						n := 0
						_, err = w.front.RunSession(sctx, w.front.Controller(w.url("/pc/")), q, 50*time.Millisecond, func(uint64, uint32) error { n++; return nil })
						cancel()
						if err == nil && n != 24 {
							err = errors.New("a session ended short")
						}
					}
					ops.Add(1)
					if err != nil {
						fail(err)
					}
				}
			})
		}
		wg.Wait()
	}
	level := func() (goroutines, files int, heap uint64) { // heap: live octets
		for range 3 {
			runtime.GC()
		}
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		fds, _ := os.ReadDir("/proc/self/fd")
		return runtime.NumGoroutine(), len(fds), ms.HeapAlloc
	}
	settle := func() { time.Sleep(2*ttl + 500*time.Millisecond) } // leases and records expire
	// Warm-up: every block stored, connections open, pools and HPACK
	// tables filled.
	// On a busy machine 3 s are a few hundred operations (four soaks at
	// once under -race: about 400, where one alone does 2,000-3,000) and
	// leave the live heap 4.7-6.4% short of its level: the warm-up goes
	// on to 1,500 operations, for at most 20 s.
	start := time.Now()
	warm := max(3*time.Second, dur/10)
	load(warm, 1500, warm+20*time.Second)
	t.Logf("warm-up: %d operations in %v", ops.Load(), time.Since(start))
	settle()
	g0, f0, h0 := level()
	// The goroutines' baseline is the quietest of a few samples: an HTTP/2
	// connection's idle handler workers end a second after a burst (the
	// warm-up's last, a refresh pass's), and a baseline taken while they
	// still wait would hide as many leaked goroutines.
	for range 8 {
		time.Sleep(250 * time.Millisecond)
		g, _, _ := level()
		g0 = min(g0, g)
	}
	// KVSP_L2_HEAP: heap profiles at the warm-up's level (PATH.0), every
	// KVSP_L2_HEAP_EVERY of the load (PATH.t1, ...: in-flight requests
	// included) and at the end (PATH), for go tool pprof -diff_base.
	if p, e := os.Getenv("KVSP_L2_HEAP"), os.Getenv("KVSP_L2_HEAP_EVERY"); p != "" {
		writeHeapProfile(t, p+".0")
		if e != "" {
			every, err := time.ParseDuration(e)
			if err != nil || every <= 0 {
				t.Fatalf("KVSP_L2_HEAP_EVERY=%q: not a duration", e)
			}
			tick := time.NewTicker(every)
			stopProf := make(chan struct{})
			var profiling sync.WaitGroup
			defer func() { tick.Stop(); close(stopProf); profiling.Wait() }()
			profiling.Go(func() {
				for i := 1; ; i++ {
					select {
					case <-stopProf:
						return
					case <-tick.C:
					}
					runtime.GC()
					runtime.GC()
					writeHeapProfile(t, fmt.Sprintf("%s.t%d", p, i))
				}
			})
		}
	}
	// The IS's records are exactly the blocks the holders hold (every
	// block stored and not evicted or dropped), at both levels: a block
	// the warm-up did not happen to store may be stored by the load.
	held := func() int {
		m := func(name string) float64 { return kvsptest.MetricSum(t, holderReg, name, nil) }
		return int(m("kvsp_holder_puts_total") - m("kvsp_holder_evictions_total") - m("kvsp_holder_digest_failures_total"))
	}
	r0, held0 := w.mem.Len(), held()
	start = time.Now()
	load(dur, 0, dur)
	t.Logf("load: %v", time.Since(start))
	n := ops.Load()
	settle()
	g1, f1, h1 := level()
	// A holder's publisher runs a pass of up to 16 concurrent updates at
	// every refresh (a third of the record TTL): goroutines that end with
	// the pass, not a leak. A leak stays; the pass is over within a
	// second or two.
	for deadline := time.Now().Add(3 * time.Second); g1 > g0+2 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		g1, f1, h1 = level()
	}
	if p := os.Getenv("KVSP_L2_HEAP"); p != "" {
		writeHeapProfile(t, p)
	}
	r1, held1, sessions := w.mem.Len(), held(), len(w.ctl.Sessions())
	t.Logf("%d operations in %v, %d failed, %d leases refused by the client's quota, %d expired before their release; goroutines %d -> %d, open files %d -> %d, live heap %.1f -> %.1f MiB (%+.2f%%), IS records %d -> %d (blocks held %d -> %d), PC sessions %d",
		n, dur, failures.Load(), quota.Load(), expired.Load(), g0, g1, f0, f1, float64(h0)/(1<<20), float64(h1)/(1<<20), 100*(float64(h1)/float64(h0)-1), r0, r1, held0, held1, sessions)
	if f := failures.Load(); f > 0 {
		t.Fatalf("%d of %d operations failed, the first: %v", f, n, *firstErr.Load())
	}
	if g1 > g0+2 {
		t.Errorf("goroutines did not come back: %d after, %d before", g1, g0)
	}
	if f1 > f0+1 {
		t.Errorf("open files did not come back: %d after, %d before", f1, f0)
	}
	// 5%, and 7% for a run of seconds: on a machine busy with other
	// packages' tests a 4 s run has measured +5.3% (fresh-clone CI at
	// 532c64c, 2,236 operations of warm-up) where alone they measure
	// -1.1% to +2.3%, and the mutant that never forgets a directive +8.6%
	// to +9.5% (6 runs under -race).
	tol := 5
	if dur < time.Minute {
		tol = 7
	}
	if h1 > h0+h0*uint64(tol)/100 {
		t.Errorf("the live heap did not come back: %d after, %d before (+%.1f%%, at most %d%%)", h1, h0, 100*(float64(h1)/float64(h0)-1), tol)
	}
	if r0 != held0 || r1 != held1 {
		t.Errorf("the IS holds %d records after the warm-up and %d after the load, where the holders hold %d and %d blocks", r0, r1, held0, held1)
	}
	if sessions != 0 {
		t.Errorf("the PC still has %d sessions after their retention", sessions)
	}
	if v := kvsptest.MetricSum(t, holderReg, "kvsp_holder_active_leases", nil); v != 0 {
		t.Errorf("%v leases live after the load and their TTL", v)
	}
	if v := kvsptest.MetricSum(t, holderReg, "kvsp_holder_leased_bytes", nil); v != 0 {
		t.Errorf("%v octets leased after the load and their TTL", v)
	}
	// Every record the IS returns is served by its holder.
	for i := 0; i < len(keys); i += 4 {
		resp, err := w.front.Index(w.isURL).Lookup(ctx, &kvsp.LookupRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: keys[i : i+4]})
		if err != nil {
			t.Fatal(err)
		}
		for j, reps := range resp.Replicas {
			for _, r := range reps {
				d := blocks[i+j].d
				if err := getVerified(ctx, w.front.Holder(r.Holder), blocks[i+j].ref, w, d); err != nil {
					t.Errorf("block %d listed at %s: %v", i+j, r.Holder, err)
				}
			}
		}
	}
	figures.Report(t, figures.Row{Row: "L2", Requests: n,
		Held: fmt.Sprintf("%v of mixed load: %d operations, 0 failed; goroutines %d -> %d, open files %d -> %d, live heap %.1f -> %.1f MiB, 0 live leases, no record without its block",
			dur.Round(time.Second), n, g0, g1, f0, f1, float64(h0)/(1<<20), float64(h1)/(1<<20)),
		Detail: map[string]float64{"seconds": dur.Seconds(), "operations": float64(n), "heap_growth_pct": 100 * (float64(h1)/float64(h0) - 1)}})
}

// getVerified GETs a block and checks every layer and the whole.
func getVerified(ctx context.Context, h *client.Holder, ref client.BlockRef, w *rig, d container.Digests) error {
	s, err := h.GetBlock(ctx, ref, w.g, client.GetOptions{LayerDigests: d.Layers, ReplicaCodec: container.CodecRaw})
	if err != nil {
		return err
	}
	defer s.Close()
	for {
		if _, err := s.Next(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// writeHeapProfile writes the heap profile to path.
func writeHeapProfile(t *testing.T, path string) {
	f, err := os.Create(path)
	if err != nil {
		t.Error(err)
		return
	}
	defer f.Close()
	if err := pprof.WriteHeapProfile(f); err != nil {
		t.Error(err)
	}
}

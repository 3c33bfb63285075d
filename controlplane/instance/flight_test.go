package instance_test

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestDirectivesForTheSameBlocksFetchThemOnce (R-PF-2): directives that
// arrive together for the same prefix (a burst of requests sharing it,
// placed on one instance) fetch each block once: the later ones wait for
// the transfer in flight instead of starting their own, and all of them
// complete with the block resident and the engine's own bytes. With each
// directive fetching for itself, the holder serves every block once per
// directive (and the lookups, leases and GETs of a burst multiply until
// the directives miss their deadlines).
func TestDirectivesForTheSameBlocksFetchThemOnce(t *testing.T) {
	holderReg := prometheus.NewRegistry()
	// Each block GET takes 300 ms at the holder (requests in parallel):
	// the first transfers are in flight while the other directives are
	// accepted (one after another on a connection already open, a few ms
	// each).
	slow := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/h1/blocks/") {
				time.Sleep(300 * time.Millisecond)
			}
			h.ServeHTTP(rw, r)
		})
	}
	w := newRig(t, rigOptions{noStore: true, holderReg: holderReg, wrap: slow})
	// Two blocks, and the rig's four transfer slots: at least two
	// directives load a block at once (its transfer led by one, waited for
	// by the others); a directive that waits for a slot instead may find
	// the blocks resident.
	keys := w.fill(t, prompt(2), 2)
	src := w.url("/h1/")
	const n = 4
	gets0 := kvsptest.MetricSum(t, holderReg, "kvsp_holder_gets_total", nil)
	w.pc.PrefetchStatus(context.Background(), kvsp.NewUUID()) // 404: the connection is open
	ids := make([]kvsp.UUID, n)
	for i := range ids {
		d := w.directive(keys, func(int) []string { return []string{src} }, 5000)
		ids[i] = d.Directive
		if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range ids {
		if st := w.wait(t, id); st.State != kvsp.PrefetchComplete || !slices.Equal(st.Loaded, keys) {
			t.Fatalf("directive %s: %s, %d of %d loaded", id, st.State, len(st.Loaded), len(keys))
		}
	}
	w.engineHolds(t, keys)
	if got := kvsptest.MetricSum(t, holderReg, "kvsp_holder_gets_total", nil) - gets0; got != float64(len(keys)) {
		t.Errorf("%v GETs for %d directives of %d blocks, want one per block", got, n, len(keys))
	}
	fetched := kvsptest.MetricSum(t, w.reg, "kvsp_instance_prefetch_blocks_total", map[string]string{"outcome": "loaded"})
	shared := kvsptest.MetricSum(t, w.reg, "kvsp_instance_prefetch_blocks_total", map[string]string{"outcome": "shared"})
	if fetched != float64(len(keys)) || shared < float64(len(keys)) || fetched+shared > float64(n*len(keys)) {
		t.Errorf("blocks fetched %v, shared %v: want %d fetched, each also waited for by another directive (shared)", fetched, shared, len(keys))
	}
}

// TestBlocksPastAFailedOneAreDropped (R-PF-*, A-18): a directive whose
// first block cannot be loaded (its only source does not have it) loads
// the blocks after it, which started at once, and then lists them as
// failed and drops them: past a gap in the chain they cannot be used, and
// what a directive lists as failed is not resident. With the drop
// removed, the two loaded blocks stay.
func TestBlocksPastAFailedOneAreDropped(t *testing.T) {
	// The first block's lease or GET fails (no holder there: 404) once the two
	// after it are loaded (at most 10 s: on a busy machine a fixed delay
	// could end before they are).
	var reg atomic.Pointer[prometheus.Registry]
	loaded := func() float64 {
		if r := reg.Load(); r != nil {
			return kvsptest.MetricSumFrom(r, "kvsp_instance_prefetch_blocks_total", map[string]string{"outcome": "loaded"})
		}
		return 0
	}
	// The block's own lease at /nowhere/ (after its group's lease there
	// failed) waits too: answered at once, its 404 could fail the
	// directive before the two after it started.
	var posts atomic.Int32
	late := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			if strings.HasPrefix(r.URL.Path, "/nowhere/") && (r.Method == http.MethodGet || posts.Add(1) > 1) {
				for end := time.Now().Add(10 * time.Second); loaded() < 2 && time.Now().Before(end); {
					time.Sleep(5 * time.Millisecond)
				}
			}
			h.ServeHTTP(rw, r)
		})
	}
	w := newRig(t, rigOptions{noStore: true, wrap: late})
	reg.Store(w.reg)
	keys := w.fill(t, prompt(3), 3)
	nowhere := w.url("/nowhere/")
	d := w.directive(keys, func(i int) []string {
		if i == 0 {
			return []string{nowhere}
		}
		return []string{w.url("/h1/")}
	}, 5000)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	st := w.wait(t, d.Directive)
	if st.State != kvsp.PrefetchFailed || len(st.Loaded) != 0 || !slices.Equal(st.Failed, keys) {
		t.Fatalf("%s, loaded %d, failed %d: want failed, every block listed failed", st.State, len(st.Loaded), len(st.Failed))
	}
	if got := kvsptest.MetricSum(t, w.reg, "kvsp_instance_prefetch_blocks_total", map[string]string{"outcome": "loaded"}); got != 2 {
		t.Fatalf("%v blocks fetched, want the two after the gap (else this test proves nothing)", got)
	}
	for i, k := range keys {
		if w.eng.KV().Has(k) {
			t.Errorf("block %d, listed failed, is resident", i)
		}
	}
}

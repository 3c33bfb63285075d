package instance_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
)

// TestDirectiveDeadlineReleasesTransferSlots (issue 47: a minute into a
// longer workload, every directive failed and fetching stopped for good).
// A directive whose deadline has passed when its loop asks for a transfer
// slot finds both ready, the slot and the deadline; taking the slot and
// then stopping for the deadline kept it, and once the agent's Workers
// slots were all lost no directive loaded a block again. Here 40
// directives reach their loop past their deadline (1 ms, shorter than
// their lookup of layer digests, which the IS answers in 5 ms); afterwards
// no slot is held, and a directive with time loads its blocks.
func TestDirectiveDeadlineReleasesTransferSlots(t *testing.T) {
	slowIS := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { time.Sleep(5 * time.Millisecond); h.ServeHTTP(w, r) })
	}
	w := newRig(t, rigOptions{wrapIS: slowIS})
	ctx := context.Background()
	keys := w.fill(t, prompt(4), 4)
	src := func(int) []string { return []string{w.url("/h1/")} }
	for range 40 {
		d := w.directive(keys, src, 1)
		if _, err := w.pc.Prefetch(ctx, d); err != nil {
			t.Fatal(err)
		}
		w.wait(t, d.Directive)
	}
	if busy := gaugeValue(t, w, "kvsp_instance_transfer_slots_busy"); busy != 0 {
		t.Fatalf("%v transfer slots held after every directive ended", busy)
	}
	// Each directive that did not load its blocks is counted under its
	// reason: its deadline, here.
	notAll := metric(t, w.reg, "kvsp_instance_directives_total", "state", "failed") + metric(t, w.reg, "kvsp_instance_directives_total", "state", "partial")
	if n := metric(t, w.reg, "kvsp_instance_directive_failures_total", "reason", "deadline"); notAll == 0 || n != notAll ||
		metric(t, w.reg, "kvsp_instance_directive_failures_total") != notAll {
		t.Fatalf("%v directives failed or partial, %v counted at their deadline, %v under any reason", notAll, n, metric(t, w.reg, "kvsp_instance_directive_failures_total"))
	}
	other := prompt(5)
	other[0] += 1000 // another prefix: other blocks
	fresh := w.fill(t, other, 5)
	d := w.directive(fresh, src, 5000)
	if _, err := w.pc.Prefetch(ctx, d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete {
		t.Fatalf("a directive after those past their deadline: %+v", st)
	}
	w.engineHolds(t, fresh[:5])
}

// gaugeValue reads a gauge of the rig's agent.
func gaugeValue(t *testing.T, w *rig, name string) float64 {
	t.Helper()
	mfs, err := w.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}

// TestStatusLinksAreMeasured (issue 47: the cost model's inputs are what
// the instance measures now). h1 is configured at 20 µs; made to answer
// its GETs 30 ms late, the instance's status reports the round trip its
// transfers took, and the PC's estimate, and so the directive's
// deadline, follow it.
func TestStatusLinksAreMeasured(t *testing.T) {
	const delay = 30 * time.Millisecond
	slow := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/h1/") && strings.Contains(r.URL.Path, "/blocks/") {
				time.Sleep(delay)
			}
			h.ServeHTTP(rw, r)
		})
	}
	w := newRig(t, rigOptions{wrap: slow})
	h1 := w.url("/h1/")
	rtt := func() uint64 {
		for _, l := range w.agent.Status().Links {
			if l.Holder == h1 {
				return l.RTTUs
			}
		}
		t.Fatalf("no link to h1 in %+v", w.agent.Status().Links)
		return 0
	}
	if got := rtt(); got != 20 {
		t.Fatalf("before any transfer: %d µs to h1, want the configured 20", got)
	}
	keys := w.fill(t, prompt(4), 4)
	d := w.directive(keys, func(int) []string { return []string{h1} }, 10000)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete {
		t.Fatalf("directive: %+v", st)
	}
	if got := rtt(); got < uint64(delay.Microseconds()) {
		t.Fatalf("after four GETs each %v late: %d µs to h1 in the status", delay, got)
	}
}

// TestTransfersUnderWayLandAfterTheDeadline (issue 47: a prefetch that
// arrives after the engine has started on the prompt still serves the
// blocks not yet computed). h1 answers GETs 150 ms late; the directive's
// deadline is 50 ms. At the deadline the directive ends (failed: nothing
// loaded by then, as the spec says) and the request it was sent for may
// start; the four transfers already under way go on within the lease and
// land: their blocks become resident for the prefill to join, are counted
// late, and give back their transfer slots.
func TestTransfersUnderWayLandAfterTheDeadline(t *testing.T) {
	slow := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/h1/") && strings.Contains(r.URL.Path, "/blocks/") {
				time.Sleep(150 * time.Millisecond)
			}
			h.ServeHTTP(rw, r)
		})
	}
	w := newRig(t, rigOptions{wrap: slow})
	keys := w.fill(t, prompt(4), 4)
	d := w.directive(keys, func(int) []string { return []string{w.url("/h1/")} }, 50)
	d.LeaseMs = 5000
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchFailed || len(st.Failed) != 4 {
		t.Fatalf("at its deadline: %+v, want failed with every block listed", st)
	}
	for end := time.Now().Add(10 * time.Second); metric(t, w.reg, "kvsp_instance_prefetch_blocks_total", "outcome", "late") < 4; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%v of 4 blocks landed late", metric(t, w.reg, "kvsp_instance_prefetch_blocks_total", "outcome", "late"))
		}
	}
	w.engineHolds(t, keys[:4])
	for end := time.Now().Add(10 * time.Second); gaugeValue(t, w, "kvsp_instance_transfer_slots_busy") != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("transfer slots still held after the late transfers ended")
		}
	}
}

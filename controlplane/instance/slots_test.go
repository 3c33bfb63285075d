package instance_test

import (
	"context"
	"net/http"
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

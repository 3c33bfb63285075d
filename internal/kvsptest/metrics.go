package kvsptest

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// MetricSum is the sum of the counter or gauge series of metric name in
// reg whose labels include match (nil: every series). A metric that is
// not registered fails the test (a check of it would prove nothing); a
// series not created yet counts 0.
func MetricSum(t testing.TB, reg prometheus.Gatherer, name string, match map[string]string) float64 {
	t.Helper()
	v, found, err := metricSum(reg, name, match)
	if err != nil {
		t.Fatal(err)
	}
	if !found {
		t.Fatalf("no metric %s registered", name)
	}
	return v
}

// MetricSumFrom is MetricSum for a goroutine other than the test's (a
// handler): it fails nothing, and a metric with no series yet counts 0.
func MetricSumFrom(reg prometheus.Gatherer, name string, match map[string]string) float64 {
	v, _, _ := metricSum(reg, name, match)
	return v
}

func metricSum(reg prometheus.Gatherer, name string, match map[string]string) (float64, bool, error) {
	mfs, err := reg.Gather()
	if err != nil {
		return 0, false, err
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var v float64
	series:
		for _, m := range mf.GetMetric() {
			for k, want := range match {
				found := false
				for _, l := range m.GetLabel() {
					if l.GetName() == k && l.GetValue() == want {
						found = true
					}
				}
				if !found {
					continue series
				}
			}
			v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
		return v, true, nil
	}
	return 0, false, nil
}

// WaitFor polls cond until it holds, failing the test after 10 s: for
// what another goroutine records after the client has its answer (a
// request counted once its handler returns, a block offloaded).
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not reached within 10 s: %s", what)
		}
	}
}

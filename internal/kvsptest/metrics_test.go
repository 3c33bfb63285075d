package kvsptest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestMetricSum(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total"}, []string{"tier"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g"})
	reg.MustRegister(c, g)
	c.WithLabelValues("host").Add(2)
	c.WithLabelValues("disk").Add(3)
	g.Set(7)
	if v := MetricSum(t, reg, "c_total", nil); v != 5 {
		t.Fatalf("all series: %v", v)
	}
	if v := MetricSum(t, reg, "c_total", map[string]string{"tier": "disk"}); v != 3 {
		t.Fatalf("disk: %v", v)
	}
	if v := MetricSum(t, reg, "c_total", map[string]string{"tier": "device"}); v != 0 {
		t.Fatalf("no such series: %v", v)
	}
	if v := MetricSum(t, reg, "g", nil); v != 7 {
		t.Fatalf("gauge: %v", v)
	}
}

package server

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the HTTP metrics of a Server, registered on the Registerer of
// its Config (never package-level collectors).
type metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	bytes    *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsp_http_requests_total", Help: "HTTP requests by route and status.",
		}, []string{"route", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvsp_http_request_duration_seconds", Help: "HTTP request duration by route.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 4, 10),
		}, []string{"route"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsp_http_response_bytes_total", Help: "Response body octets by route.",
		}, []string{"route"}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.duration, m.bytes)
	}
	return m
}

func (m *metrics) observe(route, method string, status int, d time.Duration, n int64) {
	if status == 0 {
		status = 200
	}
	m.requests.WithLabelValues(route, strconv.Itoa(status)).Inc()
	m.duration.WithLabelValues(route).Observe(d.Seconds())
	m.bytes.WithLabelValues(route).Add(float64(n))
}

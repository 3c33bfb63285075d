package server

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the HTTP metrics of a Server, registered on the Registerer of
// its Config (never package-level collectors).
type metrics struct {
	requests   *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	bytes      *prometheus.CounterVec
	handshakes *prometheus.CounterVec
	aborted    *prometheus.CounterVec
	slow       *prometheus.CounterVec
	panics     *prometheus.CounterVec
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
		handshakes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsp_tls_handshake_failures_total", Help: "TLS handshakes refused or broken off, by kind (certificate, protocol, aborted, other).",
		}, []string{"kind"}),
		aborted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsp_http_aborted_responses_total", Help: "Responses cut after they started (the client reset the stream, or the handler failed mid-body), by route.",
		}, []string{"route"}),
		slow: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsp_http_slow_reader_responses_total", Help: "Responses cut because their client did not read them at the minimum rate (min_write_rate after write_grace_ms: an HTTP/2 or HTTP/3 stream reset, an HTTP/1.1 connection closed), by route.",
		}, []string{"route"}),
		panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvsp_http_handler_panics_total", Help: "Handlers that panicked (answered 500, or cut if the response had started), by route.",
		}, []string{"route"}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.duration, m.bytes, m.handshakes, m.aborted, m.slow, m.panics)
	}
	return m
}

// routeMetrics are a route's series, looked up once when the route is
// mounted rather than by label values (a hash and a map under a lock)
// on every request.
type routeMetrics struct {
	m        *metrics
	route    string
	ok       prometheus.Counter // requests answered 200
	duration prometheus.Observer
	bytes    prometheus.Counter
	slow     prometheus.Counter // responses cut for a slow reader
}

func (m *metrics) forRoute(route string) *routeMetrics {
	return &routeMetrics{m: m, route: route, ok: m.requests.WithLabelValues(route, "200"),
		duration: m.duration.WithLabelValues(route), bytes: m.bytes.WithLabelValues(route), slow: m.slow.WithLabelValues(route)}
}

func (rm *routeMetrics) observe(status int, d time.Duration, n int64) {
	if status == 0 || status == 200 {
		rm.ok.Inc()
	} else {
		rm.m.requests.WithLabelValues(rm.route, strconv.Itoa(status)).Inc()
	}
	rm.duration.Observe(d.Seconds())
	rm.bytes.Add(float64(n))
}

package holder

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
)

// metrics of a holder (R-OPS-5: lease rejections and digest failures among
// them), registered on the Registerer of its Config.
type metrics struct {
	gets, getMisses, puts, putRejected prometheus.Counter
	getsRefused, getsCut               prometheus.Counter
	slowBodies                         prometheus.Counter
	evictions, demotions, corrupt      prometheus.Counter
	leaseRejected                      prometheus.Counter
	bytesServed                        *prometheus.CounterVec
	servedBy                           sync.Map // servedKey -> prometheus.Counter
	inFlight                           prometheus.Gauge
	device                             *prometheus.GaugeVec
	// publish: index updates that failed, by why (unreachable: no
	// answer; unavailable: 429 or 5xx, both retried; refused: another
	// 4xx, dropped), and those waiting.
	publishFailures *prometheus.CounterVec
	publishPending  prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) *metrics {
	c := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_holder_" + name, Help: help})
	}
	m := &metrics{
		gets:          c("gets_total", "Block GETs served."),
		getMisses:     c("get_misses_total", "Block GETs of blocks not held."),
		getsRefused:   c("gets_refused_total", "Block GETs refused (429) because their client's GETs under way held its read allowance (max_read_per_client) of memory beyond the host tier."),
		getsCut:       c("gets_cut_total", "Block GETs cut because their block left host memory while their client's GETs held more than its read allowance beyond the host tier."),
		puts:          c("puts_total", "Blocks stored."),
		putRejected:   c("puts_rejected_total", "Block PUTs refused (invalid, digest mismatch, existing, incompatible)."),
		slowBodies:    c("slow_bodies_total", "Block PUT bodies cut for arriving below the minimum rate (408)."),
		evictions:     c("evictions_total", "Blocks evicted."),
		demotions:     c("demotions_total", "Blocks demoted to a slower tier (device to host, host to local-storage)."),
		corrupt:       c("digest_failures_total", "Stored blocks that failed verification (dropped and withdrawn)."),
		leaseRejected: c("lease_rejections_total", "Lease requests refused by quota."),
		bytesServed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_holder_bytes_served_total",
			Help: "Block octets sent, by the tier they were read from (device, host, local-storage, engine: an attached engine's pages) and protocol (HTTP/1.1, HTTP/2.0, HTTP/3.0, KVSP-BULK/1, rdma)."}, []string{"tier", "proto"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsp_holder_inflight_put_bytes",
			Help: "Octets of block PUTs being received (memory held by requests in flight)."}),
		device: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvsp_holder_device_tier",
			Help: "1 for the device tier's device; stand_in is true for the nogpu host-memory stand-in."}, []string{"device", "stand_in"}),
		publishFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_holder_publish_failures_total",
			Help: "Index updates (publish, refresh, withdraw) that failed, by why: unreachable (no answer) and unavailable (429, 5xx) are retried with backoff; refused (another 4xx) are dropped."}, []string{"why"}),
		publishPending: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsp_holder_publish_pending",
			Help: "Index updates waiting to be sent (a backlog that grows while the IS is unreachable)."}),
	}
	for _, why := range []string{"unreachable", "unavailable", "refused"} {
		m.publishFailures.WithLabelValues(why) // each series exists from the start, at 0
	}
	if reg != nil {
		reg.MustRegister(m.gets, m.getMisses, m.getsRefused, m.getsCut, m.puts, m.putRejected, m.slowBodies, m.evictions, m.demotions, m.corrupt, m.leaseRejected, m.bytesServed, m.inFlight, m.device, m.publishFailures, m.publishPending)
	}
	return m
}

type servedKey struct {
	tier  kvsp.Tier
	proto string
}

// served is bytesServed's counter of a tier and protocol, looked up by
// label values once per pair rather than on every GET.
func (m *metrics) served(t kvsp.Tier, proto string) prometheus.Counter {
	k := servedKey{t, proto}
	if c, ok := m.servedBy.Load(k); ok {
		return c.(prometheus.Counter)
	}
	c := m.bytesServed.WithLabelValues(string(t), proto)
	m.servedBy.Store(k, c)
	return c
}

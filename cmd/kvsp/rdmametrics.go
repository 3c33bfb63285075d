package main

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp/rdma"
)

// registerTargetMetrics exports a holder's RDMA registration cache: what
// it keeps registered, and how often exposures found their memory
// registered already.
func registerTargetMetrics(reg prometheus.Registerer, t *rdma.Target) error {
	return registerAll(reg,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_rdma_registered_bytes",
			Help: "Octets of holder memory kept registered for RDMA (memory windows are bound over them per read)."},
			func() float64 { return float64(t.CacheStats().HeldBytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_holder_rdma_registrations_total",
			Help: "Registrations of holder memory for RDMA made by the cache (the rest of the reads reused one)."},
			func() float64 { return float64(t.CacheStats().Registrations) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_holder_rdma_registration_hits_total",
			Help: "RDMA reads whose memory was registered already."},
			func() float64 { return float64(t.CacheStats().Hits) }),
	)
}

// registerReaderMetrics exports an instance's RDMA receive buffers.
func registerReaderMetrics(reg prometheus.Registerer, r *rdma.Reader) error {
	return registerAll(reg,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_instance_rdma_pool_bytes",
			Help: "Octets of receive buffers kept registered for RDMA reads."},
			func() float64 { return float64(r.PoolStats().HeldBytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_instance_rdma_registrations_total",
			Help: "Registrations of receive memory for RDMA reads (pool growth, and reads beyond the pool)."},
			func() float64 { return float64(r.PoolStats().Registered) }),
	)
}

func registerAll(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/rdma"
)

// TestRDMAMetrics: the holder's registration cache and the instance's
// receive pool, as kvsp serve exports them, follow what the transfers do
// (here on the in-process fabric: kvsp serve itself needs a verbs device).
func TestRDMAMetrics(t *testing.T) {
	f := rdma.NewFabric()
	target := rdma.NewTarget(f.Provider("holder"))
	defer target.Close()
	r := rdma.NewReader(f.Provider("instance"))
	defer r.Close()
	reg := prometheus.NewRegistry()
	if err := registerTargetMetrics(reg, target); err != nil {
		t.Fatal(err)
	}
	if err := registerReaderMetrics(reg, r); err != nil {
		t.Fatal(err)
	}
	ep, _ := r.Endpoint("h")
	remote, err := target.Accept(ep)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Connect("h", ep, remote); err != nil {
		t.Fatal(err)
	}
	mem := bytes.Repeat([]byte("kv"), 1<<16)
	for range 3 {
		addr, rkey, release, err := target.Expose(ep, mem, mem[:1<<16])
		if err != nil {
			t.Fatal(err)
		}
		buf, rel, _ := r.Buffer(1 << 16)
		if err := r.Read(context.Background(), "h", buf, addr, rkey); err != nil {
			t.Fatal(err)
		}
		rel()
		release()
	}
	for name, want := range map[string]float64{
		"kvsp_holder_rdma_registered_bytes":        float64(len(mem)),
		"kvsp_holder_rdma_registrations_total":     1,
		"kvsp_holder_rdma_registration_hits_total": 2,
		"kvsp_instance_rdma_pool_bytes":            1 << 16,
		"kvsp_instance_rdma_registrations_total":   1,
	} {
		if got := kvsptest.MetricSum(t, reg, name, nil); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
}

//go:build cgo && !nogpu

package gpu

/*
#include "../csrc/kvsp_cuda.h"
*/
import "C"

import (
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVML (libnvidia-ml.so.1, loaded by go-nvml at Init) is initialised once
// per process; without it Telemetry falls back to CUDA's memory figures.
var (
	nvmlOnce sync.Once
	nvmlOK   bool
)

// Telemetry reads the device's memory use and host link through NVML,
// matching the CUDA device by its PCI bus id.
func (d *Device) Telemetry() (Telemetry, error) {
	nvmlOnce.Do(func() { nvmlOK = nvml.Init() == nvml.SUCCESS })
	if nvmlOK {
		var bus [64]C.char
		if C.kvsp_cuda_pci_bus_id(d.h(), &bus[0], C.int(len(bus))) == 0 {
			if h, ret := nvml.DeviceGetHandleByPciBusId(strings.ToLower(C.GoString(&bus[0]))); ret == nvml.SUCCESS {
				t := Telemetry{Source: "nvml"}
				// Under MIG the handle is the whole GPU's, not this
				// instance's slice: its memory comes from CUDA then, as
				// when NVML cannot tell.
				mig, _, migRet := h.GetMigMode()
				if m, ret := h.GetMemoryInfo(); ret == nvml.SUCCESS && (migRet != nvml.SUCCESS || mig != nvml.DEVICE_MIG_ENABLE) {
					t.MemoryUsed, t.MemoryTotal = int64(m.Used), int64(m.Total)
				} else {
					free, total, err := d.MemInfo()
					if err != nil {
						return Telemetry{}, err
					}
					t.MemoryUsed, t.MemoryTotal, t.Source = total-free, total, "nvml+cuda"
				}
				// The link's rate is its maximum: an idle GPU drops to a
				// lower generation to save power, which says nothing of
				// what a transfer gets.
				gen, r1 := h.GetMaxPcieLinkGeneration()
				width, r2 := h.GetMaxPcieLinkWidth()
				if r1 == nvml.SUCCESS && r2 == nvml.SUCCESS {
					t.LinkMbitPerS = pcieMbitPerS(gen, width)
				}
				if v, ret := h.GetPcieThroughput(nvml.PCIE_UTIL_TX_BYTES); ret == nvml.SUCCESS {
					t.TxKBps = v
				}
				if v, ret := h.GetPcieThroughput(nvml.PCIE_UTIL_RX_BYTES); ret == nvml.SUCCESS {
					t.RxKBps = v
				}
				return t, nil
			}
		}
	}
	free, total, err := d.MemInfo()
	if err != nil {
		return Telemetry{}, err
	}
	return Telemetry{MemoryUsed: total - free, MemoryTotal: total, Source: "cuda"}, nil
}

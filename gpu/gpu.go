// Package gpu is kvsp's access to accelerator memory: device buffers that a
// holder's device tier stores blocks in, pinned host memory (allocated, or
// Go memory registered), streams, and the host<->device copies that store
// and serve them, with a double-buffered Stager that overlaps device copies
// with the host's work.
//
// Three builds share the API. With cgo (the default), CUDA through a thin
// shim of ours over the driver API (csrc/kvsp_cuda.c) that loads
// libcuda.so.1 with dlopen: the binary starts anywhere, and where no driver
// or device exists Open returns ErrNoDevice saying which. With -tags nogpu
// (CI's CPU fallback), a stand-in that keeps "device" buffers in host
// memory and says so (StandIn, Name), so the device tier's data path runs
// and is tested everywhere. Without cgo and without nogpu, Open returns
// ErrNoDevice. No C pointer leaves the package; memory is freed by explicit
// Free/Close, never by finalizers.
package gpu

import "errors"

// ErrNoDevice: no accelerator is available to this process.
var ErrNoDevice = errors.New("gpu: no device")

// ErrOutOfMemory: the device cannot hold the allocation.
var ErrOutOfMemory = errors.New("gpu: out of device memory")

// ErrNotSupported: the device, its driver or the allocation cannot do
// what was asked (a dma-buf export for GPUDirect RDMA).
var ErrNotSupported = errors.New("gpu: not supported here")

// Info describes an opened device.
type Info struct {
	// Name is the device's name; the stand-in's says it is one.
	Name string
	// StandIn is true for the nogpu host-memory stand-in.
	StandIn bool
	// Memory is the device's total memory in octets (the stand-in: the
	// limit it was opened with).
	Memory int64
}

// Pinned is host memory the device can copy to and from asynchronously:
// a HostBuffer (allocated pinned) or Registered Go memory.
type Pinned interface {
	Bytes() []byte
}

// Telemetry is what the device reports of itself: memory use (for an
// instance's kv_utilization and the holder's metrics) and its host link
// (PCIe: the rate of a link between this node's holder and instance).
type Telemetry struct {
	MemoryUsed, MemoryTotal int64
	// LinkMbitPerS is the host link's rate at its maximum generation and
	// width (0: unknown); TxKBps and RxKBps its recent throughput.
	LinkMbitPerS   uint64
	TxKBps, RxKBps uint32
	// Source says where the figures come from: "nvml", "nvml+cuda" (the
	// memory from CUDA: a MIG instance, or NVML could not tell), "cuda"
	// (memory only: NVML is missing), or "stand-in".
	Source string
}

// pcieMbitPerS is the data rate of a PCIe link of generation gen and
// width lanes, after line encoding (8b/10b up to gen 2, 128b/130b from
// gen 3; gen 6's FLIT mode carries 236 of 256 octets).
func pcieMbitPerS(gen, width int) uint64 {
	var perLane float64 // Mbit/s of payload per lane
	switch gen {
	case 1:
		perLane = 2500.0 * 8 / 10
	case 2:
		perLane = 5000.0 * 8 / 10
	case 3:
		perLane = 8000.0 * 128 / 130
	case 4:
		perLane = 16000.0 * 128 / 130
	case 5:
		perLane = 32000.0 * 128 / 130
	case 6:
		perLane = 64000.0 * 236 / 256
	default:
		return 0
	}
	return uint64(perLane * float64(width))
}

// IPCHandle lets another process on the node use a buffer (an engine's KV
// pool, exported to the holder and the agent). A CUDA build fills CUDA
// (cuIpcGetMemHandle); the nogpu stand-in, whose shared buffers live in a
// memfd, fills FD, which travels over a Unix socket (SCM_RIGHTS).
type IPCHandle struct {
	CUDA [64]byte
	FD   int
}

// IPC kinds, as Device.IPCKind names them.
const (
	IPCCUDA  = "cuda-ipc"
	IPCMemfd = "memfd"
)

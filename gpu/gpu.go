// Package gpu is kvsp's access to accelerator memory: device buffers that a
// holder's device tier stores blocks in, and the host<->device copies that
// store and serve them. Builds with -tags nogpu (CI's CPU fallback) get a
// stand-in that keeps "device" buffers in host memory behind the same API
// and says so (StandIn, Name), so the device tier's data path runs and is
// tested everywhere. Other builds use the CUDA driver (the GPU issue); where
// no driver or device exists, Open returns ErrNoDevice.
package gpu

import "errors"

// ErrNoDevice: no accelerator is available to this process.
var ErrNoDevice = errors.New("gpu: no device")

// ErrOutOfMemory: the device cannot hold the allocation.
var ErrOutOfMemory = errors.New("gpu: out of device memory")

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

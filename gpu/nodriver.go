//go:build !cgo && !nogpu

package gpu

import "fmt"

// Device is an accelerator. This build has no cgo, so no CUDA driver
// binding: Open reports ErrNoDevice, and a holder configured with a device
// tier refuses to start rather than pretend.
type Device struct{}

// Open opens device ordinal.
func Open(ordinal int) (*Device, error) {
	return nil, fmt.Errorf("%w: device %d: this build has no cgo, so no CUDA driver binding (build with cgo, or with -tags nogpu for the host-memory stand-in)", ErrNoDevice, ordinal)
}

// Info describes the device.
func (d *Device) Info() Info { return Info{} }

// Close releases the device.
func (d *Device) Close() error { return nil }

// Buffer is device memory.
type Buffer struct{}

// Alloc allocates n octets of device memory.
func (d *Device) Alloc(n int64) (*Buffer, error) { return nil, ErrNoDevice }

// Len returns the buffer's size.
func (b *Buffer) Len() int64 { return 0 }

// CopyIn copies src to the buffer at off (host to device).
func (b *Buffer) CopyIn(off int64, src []byte) error { return ErrNoDevice }

// CopyOut copies from the buffer at off to dst (device to host).
func (b *Buffer) CopyOut(dst []byte, off int64) error { return ErrNoDevice }

// Free releases the buffer.
func (b *Buffer) Free() {}

// DevicePtr is the buffer's device address.
func (b *Buffer) DevicePtr() uint64 { return 0 }

// HostBytes is nil: no memory.
func (b *Buffer) HostBytes() []byte { return nil }

// Dmabuf exports the buffer for GPUDirect RDMA.
func (b *Buffer) Dmabuf() (fd int, off, size uint64, err error) { return -1, 0, 0, ErrNoDevice }

// MemInfo returns the device's memory.
func (d *Device) MemInfo() (free, total int64, err error) { return 0, 0, ErrNoDevice }

// CopyFrom copies device to device.
func (b *Buffer) CopyFrom(off int64, src *Buffer, srcOff, n int64) error { return ErrNoDevice }

// HostBuffer is pinned host memory.
type HostBuffer struct{}

// AllocHost allocates pinned host memory.
func (d *Device) AllocHost(n int64) (*HostBuffer, error) { return nil, ErrNoDevice }

// Bytes is the buffer's memory.
func (h *HostBuffer) Bytes() []byte { return nil }

// Free releases the buffer.
func (h *HostBuffer) Free() {}

// Registered is registered Go memory.
type Registered struct{}

// Register registers b.
func (d *Device) Register(b []byte) (*Registered, error) { return nil, ErrNoDevice }

// Bytes is the registered memory.
func (r *Registered) Bytes() []byte { return nil }

// Unregister undoes Register.
func (r *Registered) Unregister() {}

// Stream is a device stream.
type Stream struct{}

// NewStream creates a stream.
func (d *Device) NewStream() (*Stream, error) { return nil, ErrNoDevice }

// Sync waits for the stream.
func (s *Stream) Sync() error { return ErrNoDevice }

// Close destroys the stream.
func (s *Stream) Close() error { return nil }

// CopyOutAsync queues a device to host copy.
func (b *Buffer) CopyOutAsync(dst Pinned, dstOff, off, n int64, s *Stream) error { return ErrNoDevice }

// CopyInAsync queues a host to device copy.
func (b *Buffer) CopyInAsync(off int64, src Pinned, srcOff, n int64, s *Stream) error {
	return ErrNoDevice
}

// Telemetry reads the device's figures.
func (d *Device) Telemetry() (Telemetry, error) { return Telemetry{}, ErrNoDevice }

// IPCKind is how buffers are shared: none in this build.
func (d *Device) IPCKind() string { return "" }

// AllocShared allocates shareable device memory.
func (d *Device) AllocShared(n int64) (*Buffer, error) { return nil, ErrNoDevice }

// Export returns the buffer's IPC handle.
func (b *Buffer) Export() (IPCHandle, error) { return IPCHandle{FD: -1}, ErrNoDevice }

// Import maps another process's buffer.
func (d *Device) Import(h IPCHandle, off, n int64) (*Buffer, error) { return nil, ErrNoDevice }

// Gather copies a sequence's tokens from a paged pool into sections.
func (d *Device) Gather(dst, pool *Buffer, p Paged, table []int32, first, tokens int, s *Stream) error {
	return ErrNoDevice
}

// Scatter copies sections into a sequence's tokens in a paged pool.
func (d *Device) Scatter(pool, src *Buffer, p Paged, table []int32, first, tokens int, s *Stream) error {
	return ErrNoDevice
}

// Sync waits for the device's work.
func (d *Device) Sync() error { return ErrNoDevice }

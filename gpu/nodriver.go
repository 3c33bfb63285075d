//go:build !nogpu

package gpu

import "fmt"

// Device is an accelerator. This build has no driver binding yet (the GPU
// issue adds CUDA through cgo): Open reports ErrNoDevice, and a holder
// configured with a device tier refuses to start rather than pretend.
type Device struct{}

// Open opens device ordinal.
func Open(ordinal int) (*Device, error) {
	return nil, fmt.Errorf("%w: device %d: this build has no CUDA driver binding (build with -tags nogpu for the host-memory stand-in)", ErrNoDevice, ordinal)
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

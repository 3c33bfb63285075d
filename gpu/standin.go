//go:build nogpu

package gpu

import (
	"fmt"
	"sync"
)

// Device is the stand-in device: buffers in host memory, allocations
// bounded by the limit it was opened with.
type Device struct {
	limit int64
	mu    sync.Mutex
	used  int64
}

// StandInMemory is the stand-in device's memory size.
const StandInMemory = 8 << 30

// Open opens device ordinal (the stand-in has one: ordinal 0).
func Open(ordinal int) (*Device, error) {
	if ordinal != 0 {
		return nil, fmt.Errorf("%w: ordinal %d (the nogpu stand-in has device 0 only)", ErrNoDevice, ordinal)
	}
	return &Device{limit: StandInMemory}, nil
}

// Info describes the device.
func (d *Device) Info() Info {
	return Info{Name: "host-memory stand-in (built with -tags nogpu)", StandIn: true, Memory: d.limit}
}

// Close releases the device.
func (d *Device) Close() error { return nil }

// Buffer is device memory.
type Buffer struct {
	d    *Device
	mem  []byte
	once sync.Once
}

// Alloc allocates n octets of device memory.
func (d *Device) Alloc(n int64) (*Buffer, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n < 0 || d.used+n > d.limit {
		return nil, fmt.Errorf("%w: %d octets asked, %d free", ErrOutOfMemory, n, d.limit-d.used)
	}
	d.used += n
	return &Buffer{d: d, mem: make([]byte, n)}, nil
}

// Len returns the buffer's size.
func (b *Buffer) Len() int64 { return int64(len(b.mem)) }

// CopyIn copies src to the buffer at off (host to device).
func (b *Buffer) CopyIn(off int64, src []byte) error {
	if off < 0 || off+int64(len(src)) > int64(len(b.mem)) {
		return fmt.Errorf("gpu: copy of %d octets at %d outside a %d-octet buffer", len(src), off, len(b.mem))
	}
	copy(b.mem[off:], src)
	return nil
}

// CopyOut copies len(dst) octets from the buffer at off to dst (device to
// host).
func (b *Buffer) CopyOut(dst []byte, off int64) error {
	if off < 0 || off+int64(len(dst)) > int64(len(b.mem)) {
		return fmt.Errorf("gpu: copy of %d octets at %d outside a %d-octet buffer", len(dst), off, len(b.mem))
	}
	copy(dst, b.mem[off:])
	return nil
}

// Free releases the buffer; later calls do nothing.
func (b *Buffer) Free() {
	b.once.Do(func() {
		b.d.mu.Lock()
		b.d.used -= int64(len(b.mem))
		b.d.mu.Unlock()
		b.mem = nil
	})
}

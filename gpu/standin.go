//go:build nogpu

package gpu

import (
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
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

// Buffer is device memory: Go memory, or a shared mapping of a memfd
// (AllocShared, Import).
type Buffer struct {
	d        *Device
	mem      []byte
	mapped   []byte // an imported buffer's whole mapping (mem may start inside it)
	fd       int    // the memfd of a shared buffer, -1 otherwise
	imported bool   // mapped from another process's export: not counted
	once     sync.Once
}

// Alloc allocates n octets of device memory.
func (d *Device) Alloc(n int64) (*Buffer, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n < 0 || d.used+n > d.limit {
		return nil, fmt.Errorf("%w: %d octets asked, %d free", ErrOutOfMemory, n, d.limit-d.used)
	}
	d.used += n
	return &Buffer{d: d, mem: make([]byte, n), fd: -1}, nil
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

// Free releases the buffer (unmapping a shared one); later calls do
// nothing.
func (b *Buffer) Free() {
	b.once.Do(func() {
		if !b.imported {
			b.d.mu.Lock()
			b.d.used -= int64(len(b.mem))
			b.d.mu.Unlock()
		}
		if b.fd >= 0 {
			if b.mapped != nil {
				unix.Munmap(b.mapped)
			} else {
				unix.Munmap(b.mem)
			}
			unix.Close(b.fd)
		}
		b.mem = nil
	})
}

// DevicePtr is the buffer's address: the stand-in's memory is the host's.
func (b *Buffer) DevicePtr() uint64 {
	if len(b.mem) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b.mem[0])))
}

// HostBytes is the stand-in's memory (a NIC registers it as host memory).
func (b *Buffer) HostBytes() []byte { return b.mem }

// Dmabuf: the stand-in has no dma-buf; HostBytes is its memory.
func (b *Buffer) Dmabuf() (fd int, off, size uint64, err error) {
	return -1, 0, 0, fmt.Errorf("%w: the stand-in's memory is host memory (HostBytes)", ErrNotSupported)
}

// IPCKind is how the stand-in's buffers are shared: memfd.
func (d *Device) IPCKind() string { return IPCMemfd }

// AllocShared allocates n octets in a memfd, mapped shared, so another
// process that receives the descriptor (Export) maps the same memory.
func (d *Device) AllocShared(n int64) (*Buffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("gpu: allocation of %d octets", n)
	}
	d.mu.Lock()
	if d.used+n > d.limit {
		d.mu.Unlock()
		return nil, fmt.Errorf("%w: %d octets asked, %d free", ErrOutOfMemory, n, d.limit-d.used)
	}
	d.used += n
	d.mu.Unlock()
	fd, err := unix.MemfdCreate("kvsp-pool", unix.MFD_CLOEXEC)
	if err == nil {
		err = unix.Ftruncate(fd, n)
	}
	var mem []byte
	if err == nil {
		mem, err = unix.Mmap(fd, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err != nil {
		if fd > 0 {
			unix.Close(fd)
		}
		d.mu.Lock()
		d.used -= n
		d.mu.Unlock()
		return nil, fmt.Errorf("gpu: shared allocation: %w", err)
	}
	return &Buffer{d: d, mem: mem, fd: fd}, nil
}

// Export returns the buffer's memfd (the caller sends it, the buffer keeps
// it).
func (b *Buffer) Export() (IPCHandle, error) {
	if b.fd < 0 || b.imported {
		return IPCHandle{FD: -1}, fmt.Errorf("gpu: only a buffer from AllocShared can be exported")
	}
	return IPCHandle{FD: b.fd}, nil
}

// Import maps n octets from off of the memfd h.FD (received from the
// exporter); the buffer owns the descriptor and closes it on Free.
func (d *Device) Import(h IPCHandle, off, n int64) (*Buffer, error) {
	var st unix.Stat_t
	if err := unix.Fstat(h.FD, &st); err != nil {
		return nil, fmt.Errorf("gpu: import: %w", err)
	}
	if n <= 0 || off < 0 || off > st.Size || n > st.Size-off {
		return nil, fmt.Errorf("gpu: import of %d octets at %d from a %d-octet memfd", n, off, st.Size)
	}
	mapped, err := unix.Mmap(h.FD, 0, int(off+n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("gpu: import: %w", err)
	}
	return &Buffer{d: d, mem: mapped[off:], mapped: mapped, fd: h.FD, imported: true}, nil
}

// MemInfo returns the stand-in's free and total memory.
func (d *Device) MemInfo() (free, total int64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.limit - d.used, d.limit, nil
}

// CopyFrom copies n octets of src at srcOff to the buffer at off.
func (b *Buffer) CopyFrom(off int64, src *Buffer, srcOff, n int64) error {
	if off < 0 || n < 0 || off+n > int64(len(b.mem)) || srcOff < 0 || srcOff+n > int64(len(src.mem)) {
		return fmt.Errorf("gpu: device copy of %d octets outside a buffer", n)
	}
	copy(b.mem[off:off+n], src.mem[srcOff:])
	return nil
}

// HostBuffer is the stand-in's "pinned" host memory: ordinary memory.
type HostBuffer struct{ mem []byte }

// AllocHost allocates n octets of host memory.
func (d *Device) AllocHost(n int64) (*HostBuffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("gpu: pinned allocation of %d octets", n)
	}
	return &HostBuffer{mem: make([]byte, n)}, nil
}

// Bytes is the buffer's memory.
func (h *HostBuffer) Bytes() []byte { return h.mem }

// Free releases the buffer.
func (h *HostBuffer) Free() { h.mem = nil }

// Registered is Go memory "registered" with the stand-in (nothing to do).
type Registered struct{ mem []byte }

// Register registers b.
func (d *Device) Register(b []byte) (*Registered, error) {
	if len(b) == 0 {
		return nil, fmt.Errorf("gpu: registration of empty memory")
	}
	return &Registered{mem: b}, nil
}

// Bytes is the registered memory.
func (r *Registered) Bytes() []byte { return r.mem }

// Unregister undoes Register.
func (r *Registered) Unregister() {}

// Stream is the stand-in's stream: its copies run at once.
type Stream struct{}

// NewStream creates a stream.
func (d *Device) NewStream() (*Stream, error) { return &Stream{}, nil }

// Sync waits for the stream's work (done already).
func (s *Stream) Sync() error { return nil }

// Close destroys the stream.
func (s *Stream) Close() error { return nil }

// CopyOutAsync copies n octets at off to dst at dstOff (at once).
func (b *Buffer) CopyOutAsync(dst Pinned, dstOff, off, n int64, s *Stream) error {
	mem := dst.Bytes()
	if dstOff < 0 || n < 0 || dstOff+n > int64(len(mem)) {
		return fmt.Errorf("gpu: %d octets at %d outside a %d-octet host buffer", n, dstOff, len(mem))
	}
	return b.CopyOut(mem[dstOff:dstOff+n], off)
}

// CopyInAsync copies n octets of src at srcOff to the buffer at off (at
// once).
func (b *Buffer) CopyInAsync(off int64, src Pinned, srcOff, n int64, s *Stream) error {
	mem := src.Bytes()
	if srcOff < 0 || n < 0 || srcOff+n > int64(len(mem)) {
		return fmt.Errorf("gpu: %d octets at %d outside a %d-octet host buffer", n, srcOff, len(mem))
	}
	return b.CopyIn(off, mem[srcOff:srcOff+n])
}

// Telemetry reports the stand-in's memory use; it has no host link.
func (d *Device) Telemetry() (Telemetry, error) {
	free, total, _ := d.MemInfo()
	return Telemetry{MemoryUsed: total - free, MemoryTotal: total, Source: "stand-in"}, nil
}

// Gather copies tokens [first, first+tokens) of a sequence from the paged
// pool into dst as kvsp-layout-1 sections (for each layer, K then V).
func (d *Device) Gather(dst, pool *Buffer, p Paged, table []int32, first, tokens int, s *Stream) error {
	if err := p.check(pool.Len(), dst.Len(), table, first, tokens); err != nil {
		return err
	}
	p.offsets(table, first, tokens, func(po, so int64) { copy(dst.mem[so:so+int64(p.RowBytes)], pool.mem[po:]) })
	return nil
}

// Scatter copies kvsp-layout-1 sections from src into tokens [first,
// first+tokens) of a sequence in the paged pool.
func (d *Device) Scatter(pool, src *Buffer, p Paged, table []int32, first, tokens int, s *Stream) error {
	if err := p.check(pool.Len(), src.Len(), table, first, tokens); err != nil {
		return err
	}
	p.offsets(table, first, tokens, func(po, so int64) { copy(pool.mem[po:po+int64(p.RowBytes)], src.mem[so:]) })
	return nil
}

// Sync waits for the device's work (the stand-in's is done already).
func (d *Device) Sync() error { return nil }

// offsets calls fn with the pool and section offsets of every row of the
// copy, in section order (what csrc/kvsp_gather.cu's kernels do, one row per thread block).
func (p Paged) offsets(table []int32, first, tokens int, fn func(poolOff, secOff int64)) {
	for y := 0; y < 2*p.Layers; y++ {
		layer, kv := int64(y>>1), int64(y&1)
		for x := range tokens {
			t := first + x
			poolOff := layer*p.LayerStride + kv*p.VOffset + int64(table[t/p.PageTokens])*p.PageStride + int64(t%p.PageTokens)*int64(p.RowBytes)
			fn(poolOff, (int64(y)*int64(tokens)+int64(x))*int64(p.RowBytes))
		}
	}
}

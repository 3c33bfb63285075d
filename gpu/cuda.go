//go:build cgo && !nogpu

package gpu

/*
#cgo CFLAGS: -O2 -std=gnu11
#cgo LDFLAGS: -ldl -lpthread
#include <stdlib.h>
#include "../csrc/kvsp_cuda.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The CUDA build: the driver API through csrc/kvsp_cuda.c, which loads
// libcuda.so.1 with dlopen. Where no driver or device exists, Open
// returns ErrNoDevice with the reason.

// cudaError is a CUDA driver error (CUresult) or one of the shim's.
type cudaError struct {
	op   string
	code int
}

func (e *cudaError) Error() string {
	return fmt.Sprintf("gpu: %s: %s (CUDA error %d)", e.op, C.GoString(C.kvsp_cuda_error(C.int(e.code))), e.code)
}

// Is maps out-of-memory (CUDA_ERROR_OUT_OF_MEMORY, 2) to ErrOutOfMemory
// and a missing driver to ErrNoDevice.
func (e *cudaError) Is(target error) bool {
	switch target {
	case ErrOutOfMemory:
		return e.code == 2
	case ErrNoDevice:
		return e.code == C.KVSP_CUDA_NO_DRIVER || e.code == 100 /* CUDA_ERROR_NO_DEVICE */ || e.code == 101 /* INVALID_DEVICE */
	case ErrNotSupported:
		return e.code == C.KVSP_CUDA_NOT_SUPPORTED || e.code == 801 /* CUDA_ERROR_NOT_SUPPORTED */
	}
	return false
}

func check(op string, rc C.int) error {
	if rc == 0 {
		return nil
	}
	return &cudaError{op: op, code: int(rc)}
}

// Device is an accelerator: its primary context, retained while open
// (each Device of an ordinal retains it: closing one leaves the others').
type Device struct {
	ord    C.int
	handle atomic.Int32 // ord while open, -1 after Close: the shim refuses it
	info   Info
	mu     sync.Mutex
	open   bool
	kern   kernels // the paged gather/scatter module, loaded on first use
}

// h is the ordinal the device's calls pass: -1 once closed, so that
// memory, streams and modules of a closed Device fail with "not opened"
// instead of acting in a context opened again since.
func (d *Device) h() C.int { return C.int(d.handle.Load()) }

// Open opens device ordinal. The first call loads the driver.
func Open(ordinal int) (*Device, error) {
	var msg [256]C.char
	if rc := C.kvsp_cuda_load(&msg[0], C.size_t(len(msg))); rc != 0 {
		return nil, fmt.Errorf("%w: %s", ErrNoDevice, C.GoString(&msg[0]))
	}
	var n C.int
	if err := check("cuDeviceGetCount", C.kvsp_cuda_device_count(&n)); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoDevice, err)
	}
	if ordinal < 0 || ordinal >= int(n) {
		return nil, fmt.Errorf("%w: ordinal %d (this machine has %d CUDA devices)", ErrNoDevice, ordinal, int(n))
	}
	var name [256]C.char
	var total C.size_t
	if err := check("open", C.kvsp_cuda_open(C.int(ordinal), &name[0], C.int(len(name)), &total)); err != nil {
		return nil, err
	}
	d := &Device{ord: C.int(ordinal), open: true, info: Info{Name: C.GoString(&name[0]), Memory: int64(total)}}
	d.handle.Store(int32(ordinal))
	return d, nil
}

// Info describes the device.
func (d *Device) Info() Info { return d.info }

// MemInfo returns the device's free and total memory.
func (d *Device) MemInfo() (free, total int64, err error) {
	var f, t C.size_t
	err = check("cuMemGetInfo", C.kvsp_cuda_mem_info(d.h(), &f, &t))
	return int64(f), int64(t), err
}

// Sync waits for all the device's work (every stream).
func (d *Device) Sync() error { return check("cuCtxSynchronize", C.kvsp_cuda_sync(d.h())) }

// Close releases the device's context (once). Buffers must be freed first.
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.open {
		return nil
	}
	d.open = false
	if d.kern.scratch != nil {
		d.kern.scratch.Free()
	}
	if d.kern.mod != nil {
		C.kvsp_cuda_module_unload(d.ord, d.kern.mod)
	}
	d.handle.Store(-1)
	return check("close", C.kvsp_cuda_close(d.ord))
}

// Buffer is device memory.
type Buffer struct {
	d        *Device
	ptr      C.uint64_t
	n        int64
	imported bool       // mapped from another process: Free unmaps
	base     C.uint64_t // an imported buffer's mapping (ptr may be inside it)
	once     sync.Once
}

// Alloc allocates n octets of device memory.
func (d *Device) Alloc(n int64) (*Buffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("gpu: allocation of %d octets", n)
	}
	var p C.uint64_t
	if err := check("cuMemAlloc", C.kvsp_cuda_alloc(d.h(), &p, C.size_t(n))); err != nil {
		return nil, err
	}
	return &Buffer{d: d, ptr: p, n: n}, nil
}

// Len returns the buffer's size.
func (b *Buffer) Len() int64 { return b.n }

func (b *Buffer) span(off, n int64) error {
	if off < 0 || n < 0 || off+n > b.n {
		return fmt.Errorf("gpu: copy of %d octets at %d outside a %d-octet buffer", n, off, b.n)
	}
	return nil
}

// CopyIn copies src to the buffer at off (host to device), returning once
// the octets are in device memory (visible to every stream).
func (b *Buffer) CopyIn(off int64, src []byte) error {
	if err := b.span(off, int64(len(src))); err != nil || len(src) == 0 {
		return err
	}
	return check("cuMemcpyHtoD", C.kvsp_cuda_htod(b.d.h(), b.ptr+C.uint64_t(off), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

// CopyOut fills dst from the buffer at off (device to host, synchronous).
func (b *Buffer) CopyOut(dst []byte, off int64) error {
	if err := b.span(off, int64(len(dst))); err != nil || len(dst) == 0 {
		return err
	}
	return check("cuMemcpyDtoH", C.kvsp_cuda_dtoh(b.d.h(), unsafe.Pointer(&dst[0]), b.ptr+C.uint64_t(off), C.size_t(len(dst))))
}

// CopyFrom copies n octets of src at srcOff to the buffer at off (device
// to device), returning once done.
func (b *Buffer) CopyFrom(off int64, src *Buffer, srcOff, n int64) error {
	if err := b.span(off, n); err != nil {
		return err
	}
	if err := src.span(srcOff, n); err != nil {
		return err
	}
	return check("cuMemcpyDtoD", C.kvsp_cuda_dtod(b.d.h(), b.ptr+C.uint64_t(off), src.ptr+C.uint64_t(srcOff), C.size_t(n)))
}

// Free releases the buffer; later calls do nothing.
func (b *Buffer) Free() {
	b.once.Do(func() {
		if b.imported {
			C.kvsp_cuda_ipc_close(b.d.h(), b.base)
			return
		}
		C.kvsp_cuda_free(b.d.h(), b.ptr)
	})
}

// DevicePtr is the buffer's address in the device's address space: what
// a NIC reads at once the buffer is registered for GPUDirect RDMA.
func (b *Buffer) DevicePtr() uint64 { return uint64(b.ptr) }

// HostBytes is the buffer's memory when it is host memory: nil for device
// memory.
func (b *Buffer) HostBytes() []byte { return nil }

// Dmabuf exports the buffer for GPUDirect RDMA as a dma-buf: fd (the
// caller closes it once registered), the buffer's offset in it and the
// dma-buf's length (the host-page-aligned range around the buffer).
// ErrNotSupported where the device, the driver or the allocation's
// alignment does not allow it.
func (b *Buffer) Dmabuf() (fd int, off, size uint64, err error) {
	var cfd C.int
	var coff, csize C.uint64_t
	if err := check("cuMemGetHandleForAddressRange", C.kvsp_cuda_dmabuf(b.d.h(), b.ptr, C.size_t(b.n), &cfd, &coff, &csize)); err != nil {
		return -1, 0, 0, err
	}
	return int(cfd), uint64(coff), uint64(csize), nil
}

// HostBuffer is pinned (page-locked) host memory, allocated by the driver:
// the host side of asynchronous copies.
type HostBuffer struct {
	d    *Device
	p    unsafe.Pointer
	mem  []byte
	once sync.Once
}

// AllocHost allocates n octets of pinned host memory.
func (d *Device) AllocHost(n int64) (*HostBuffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("gpu: pinned allocation of %d octets", n)
	}
	var p unsafe.Pointer
	if err := check("cuMemHostAlloc", C.kvsp_cuda_host_alloc(d.h(), &p, C.size_t(n))); err != nil {
		return nil, err
	}
	return &HostBuffer{d: d, p: p, mem: unsafe.Slice((*byte)(p), n)}, nil
}

// Bytes is the buffer's memory (valid until Free).
func (h *HostBuffer) Bytes() []byte { return h.mem }

// Free releases the buffer; later calls do nothing.
func (h *HostBuffer) Free() {
	h.once.Do(func() {
		C.kvsp_cuda_host_free(h.d.h(), h.p)
		h.mem = nil
	})
}

// Registered is Go memory registered with the driver as pinned, so it can
// be the host side of asynchronous copies (pooled block buffers). The
// memory is pinned for the Go runtime too (runtime.Pinner) until
// Unregister.
type Registered struct {
	d      *Device
	mem    []byte
	pinner runtime.Pinner
	once   sync.Once
}

// Register pins and registers b (non-empty) until Unregister.
func (d *Device) Register(b []byte) (*Registered, error) {
	if len(b) == 0 {
		return nil, errors.New("gpu: registration of empty memory")
	}
	r := &Registered{d: d, mem: b}
	r.pinner.Pin(&b[0])
	if err := check("cuMemHostRegister", C.kvsp_cuda_host_register(d.h(), unsafe.Pointer(&b[0]), C.size_t(len(b)))); err != nil {
		r.pinner.Unpin()
		return nil, err
	}
	return r, nil
}

// Bytes is the registered memory.
func (r *Registered) Bytes() []byte { return r.mem }

// Unregister undoes Register; later calls do nothing.
func (r *Registered) Unregister() {
	r.once.Do(func() {
		C.kvsp_cuda_host_unregister(r.d.h(), unsafe.Pointer(&r.mem[0]))
		r.pinner.Unpin()
	})
}

// Stream is a CUDA stream: copies on one stream run in order, streams
// overlap.
type Stream struct {
	d *Device
	s unsafe.Pointer
}

// NewStream creates a stream.
func (d *Device) NewStream() (*Stream, error) {
	var s unsafe.Pointer
	if err := check("cuStreamCreate", C.kvsp_cuda_stream_create(d.h(), &s)); err != nil {
		return nil, err
	}
	return &Stream{d: d, s: s}, nil
}

// Sync waits for the stream's work.
func (s *Stream) Sync() error {
	return check("cuStreamSynchronize", C.kvsp_cuda_stream_sync(s.d.h(), s.s))
}

// Close destroys the stream.
func (s *Stream) Close() error {
	return check("cuStreamDestroy", C.kvsp_cuda_stream_destroy(s.d.h(), s.s))
}

// CopyOutAsync queues a copy of n octets at off to dst at dstOff (device
// to pinned host) on s; dst must stay untouched until s is synced.
func (b *Buffer) CopyOutAsync(dst Pinned, dstOff, off, n int64, s *Stream) error {
	mem := dst.Bytes()
	if err := b.span(off, n); err != nil {
		return err
	}
	if dstOff < 0 || dstOff+n > int64(len(mem)) {
		return fmt.Errorf("gpu: %d octets at %d outside a %d-octet host buffer", n, dstOff, len(mem))
	}
	if n == 0 {
		return nil
	}
	return check("cuMemcpyDtoHAsync", C.kvsp_cuda_dtoh_async(b.d.h(), unsafe.Pointer(&mem[dstOff]), b.ptr+C.uint64_t(off), C.size_t(n), s.s))
}

// CopyInAsync queues a copy of n octets of src at srcOff to the buffer at
// off (pinned host to device) on s.
func (b *Buffer) CopyInAsync(off int64, src Pinned, srcOff, n int64, s *Stream) error {
	mem := src.Bytes()
	if err := b.span(off, n); err != nil {
		return err
	}
	if srcOff < 0 || srcOff+n > int64(len(mem)) {
		return fmt.Errorf("gpu: %d octets at %d outside a %d-octet host buffer", n, srcOff, len(mem))
	}
	if n == 0 {
		return nil
	}
	return check("cuMemcpyHtoDAsync", C.kvsp_cuda_htod_async(b.d.h(), b.ptr+C.uint64_t(off), unsafe.Pointer(&mem[srcOff]), C.size_t(n), s.s))
}

// IPCKind is how this build's buffers are shared between processes.
func (d *Device) IPCKind() string { return IPCCUDA }

// AllocShared allocates device memory another process can import (every
// CUDA allocation can be).
func (d *Device) AllocShared(n int64) (*Buffer, error) { return d.Alloc(n) }

// Export returns the buffer's IPC handle.
func (b *Buffer) Export() (IPCHandle, error) {
	var h IPCHandle
	h.FD = -1
	if b.imported {
		return h, errors.New("gpu: an imported buffer cannot be exported again")
	}
	var raw [C.KVSP_CUDA_IPC_HANDLE_SIZE]C.uchar
	if err := check("cuIpcGetMemHandle", C.kvsp_cuda_ipc_get(b.d.h(), b.ptr, &raw[0])); err != nil {
		return h, err
	}
	for i := range h.CUDA {
		h.CUDA[i] = byte(raw[i])
	}
	return h, nil
}

// Import maps another process's exported allocation and returns n octets
// of it from off (within the allocation's real size, which the driver
// reports: an engine's pool need not start at its allocation's base);
// Free unmaps it (the exporter keeps the memory).
func (d *Device) Import(h IPCHandle, off, n int64) (*Buffer, error) {
	var raw [C.KVSP_CUDA_IPC_HANDLE_SIZE]C.uchar
	for i := range h.CUDA {
		raw[i] = C.uchar(h.CUDA[i])
	}
	var p C.uint64_t
	var size C.size_t
	if err := check("cuIpcOpenMemHandle", C.kvsp_cuda_ipc_open(d.h(), &raw[0], &p, &size)); err != nil {
		return nil, err
	}
	if n <= 0 || off < 0 || off > int64(size) || n > int64(size)-off {
		C.kvsp_cuda_ipc_close(d.h(), p)
		return nil, fmt.Errorf("gpu: import of %d octets at %d from a %d-octet allocation", n, off, int64(size))
	}
	return &Buffer{d: d, ptr: p + C.uint64_t(off), base: p, n: n, imported: true}, nil
}

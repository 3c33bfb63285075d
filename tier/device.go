package tier

import (
	"errors"
	"io"
	"sync"

	"github.com/kvsp/kvsp/gpu"
)

// Device is the device tier's memory: an accelerator opened through
// package gpu (under -tags nogpu, its host-memory stand-in, which says so in
// Name and StandIn).
type Device struct {
	d       *gpu.Device
	stagers chan *gpu.Stager // idle, for WriteRange
	inUse   chan struct{}    // a slot per stager in use: pinned staging is bounded

	kmu sync.Mutex  // the kernels' stream, one gather at a time
	ks  *gpu.Stream // nil until the first
}

// StagingSize is the device-to-host copy unit of WriteRange: large enough
// to amortise a copy's launch, small enough that copying overlaps sending.
const StagingSize = 1 << 20

// maxIdleStagers bounds the pinned staging memory kept between GETs
// (2 x StagingSize each); maxStagers bounds the stagers in use at once
// (more device reads wait for one).
const (
	maxIdleStagers = 16
	maxStagers     = 64
)

// DeviceBuffer is a region of device memory.
type DeviceBuffer interface {
	Len() int64
	// CopyIn copies src to the buffer at off (host to device).
	CopyIn(off int64, src []byte) error
	// CopyOut fills dst from the buffer at off (device to host).
	CopyOut(dst []byte, off int64) error
	Free()
	// For GPUDirect RDMA (package rdma registers it): the buffer's device
	// address, its memory when it is host memory (the stand-in), and its
	// export as a dma-buf.
	DevicePtr() uint64
	HostBytes() []byte
	Dmabuf() (fd int, off, size uint64, err error)
}

// OpenDevice opens the accelerator of the given ordinal.
func OpenDevice(ordinal int) (*Device, error) {
	d, err := gpu.Open(ordinal)
	if err != nil {
		return nil, err
	}
	return &Device{d: d, stagers: make(chan *gpu.Stager, maxIdleStagers), inUse: make(chan struct{}, maxStagers)}, nil
}

// DeviceTelemetry is a device's own report of its memory and host link
// (NVML on a GPU).
type DeviceTelemetry = gpu.Telemetry

// Telemetry reads the device's report.
func (d *Device) Telemetry() (DeviceTelemetry, error) { return d.d.Telemetry() }

// Name names the device.
func (d *Device) Name() string { return d.d.Info().Name }

// StandIn reports the nogpu host-memory stand-in.
func (d *Device) StandIn() bool { return d.d.Info().StandIn }

// Alloc allocates n octets of device memory.
func (d *Device) Alloc(n int64) (DeviceBuffer, error) { return d.d.Alloc(n) }

// stager takes an idle stager, or makes one, once fewer than maxStagers
// are in use.
func (d *Device) stager() (*gpu.Stager, error) {
	d.inUse <- struct{}{}
	select {
	case st := <-d.stagers:
		return st, nil
	default:
		st, err := d.d.NewStager(StagingSize)
		if err != nil {
			<-d.inUse
		}
		return st, err
	}
}

// idle returns a stager to the pool (or frees it when the pool is full).
func (d *Device) idle(st *gpu.Stager) {
	select {
	case d.stagers <- st:
	default:
		st.Close()
	}
	<-d.inUse
}

// WriteRange writes n octets of buf at off to w through a double-buffered
// pinned stager: the device copy of the next piece runs while this one is
// written, so the range leaves in order with no copy beyond the staging.
func (d *Device) WriteRange(w io.Writer, buf DeviceBuffer, off, n int64) (int64, error) {
	return d.WriteRegions(w, buf, []Region{{Off: off, Len: n}})
}

// Region is a span of a device buffer.
type Region = gpu.Region

// WriteRegions writes the regions of buf, in order, to w through the
// double-buffered pinned staging.
func (d *Device) WriteRegions(w io.Writer, buf DeviceBuffer, regions []Region) (int64, error) {
	gb, ok := buf.(*gpu.Buffer)
	if !ok {
		return 0, errors.New("tier: not a buffer of this device")
	}
	st, err := d.stager()
	if err != nil {
		return 0, err
	}
	defer d.idle(st)
	var total int64
	err = st.WriteTo(gb, regions, func(p []byte) error {
		k, err := w.Write(p)
		total += int64(k)
		return err
	})
	return total, err
}

// IPCKind is how this device's memory is shared between processes
// (gpu.IPCCUDA or gpu.IPCMemfd).
func (d *Device) IPCKind() string { return d.d.IPCKind() }

// Import maps n octets from off of another process's memory: a CUDA IPC
// handle's allocation, or a memfd (fd, which the buffer owns from here
// on). Free unmaps it.
func (d *Device) Import(handle []byte, fd int, off, n int64) (DeviceBuffer, error) {
	h := gpu.IPCHandle{FD: fd}
	if len(handle) > 0 {
		if len(handle) != len(h.CUDA) {
			return nil, errors.New("tier: an IPC handle of the wrong size")
		}
		copy(h.CUDA[:], handle)
	}
	return d.d.Import(h, off, n)
}

// Uploader copies octets into device buffers through double-buffered
// pinned staging: each Write returns once its copy is queued, so the
// caller receives the next octets while it runs. One goroutine at a time.
type Uploader struct {
	d   *Device
	st  *gpu.Stager
	err error
}

// Uploader takes an uploader; Close gives it back.
func (d *Device) Uploader() (*Uploader, error) {
	st, err := d.stager()
	if err != nil {
		return nil, err
	}
	return &Uploader{d: d, st: st}, nil
}

// Write queues the copy of p to buf at off.
func (u *Uploader) Write(buf DeviceBuffer, off int64, p []byte) error {
	if u.err != nil {
		return u.err
	}
	gb, ok := buf.(*gpu.Buffer)
	if !ok {
		u.err = errors.New("tier: not a buffer of this device")
		return u.err
	}
	for len(p) > 0 {
		n := min(len(p), int(u.st.Size()))
		if u.err = u.st.Upload(gb, off, p[:n]); u.err != nil {
			return u.err
		}
		off, p = off+int64(n), p[n:]
	}
	return nil
}

// Close waits for the queued copies and returns the first error of any
// Write or copy.
func (u *Uploader) Close() error {
	if err := u.st.Flush(); u.err == nil {
		u.err = err
	}
	u.d.idle(u.st)
	return u.err
}

// Paged is an engine pool's layout on the device (gpu.Paged).
type Paged = gpu.Paged

// Gather copies tokens [first, first+tokens) of a sequence, whose pages
// table lists, from an engine's paged pool into dst as kvsp-layout-1
// sections (each layer's K, then V), with the device's gather kernel.
func (d *Device) Gather(dst, pool DeviceBuffer, p Paged, table []int32, first, tokens int) error {
	gd, ok1 := dst.(*gpu.Buffer)
	gp, ok2 := pool.(*gpu.Buffer)
	if !ok1 || !ok2 {
		return errors.New("tier: not a buffer of this device")
	}
	d.kmu.Lock()
	defer d.kmu.Unlock()
	if d.ks == nil {
		s, err := d.d.NewStream()
		if err != nil {
			return err
		}
		d.ks = s
	}
	return d.d.Gather(gd, gp, p, table, first, tokens, d.ks)
}

// Close releases the device and its staging memory.
func (d *Device) Close() error {
	d.kmu.Lock()
	if d.ks != nil {
		d.ks.Close()
		d.ks = nil
	}
	d.kmu.Unlock()
	for {
		select {
		case st := <-d.stagers:
			st.Close()
		default:
			return d.d.Close()
		}
	}
}

package tier

import "github.com/kvsp/kvsp/gpu"

// Device is the device tier's memory: an accelerator opened through
// package gpu (under -tags nogpu, its host-memory stand-in, which says so in
// Name and StandIn).
type Device struct {
	d *gpu.Device
}

// DeviceBuffer is a region of device memory.
type DeviceBuffer interface {
	Len() int64
	// CopyIn copies src to the buffer at off (host to device).
	CopyIn(off int64, src []byte) error
	// CopyOut fills dst from the buffer at off (device to host).
	CopyOut(dst []byte, off int64) error
	Free()
}

// OpenDevice opens the accelerator of the given ordinal.
func OpenDevice(ordinal int) (*Device, error) {
	d, err := gpu.Open(ordinal)
	if err != nil {
		return nil, err
	}
	return &Device{d: d}, nil
}

// Name names the device.
func (d *Device) Name() string { return d.d.Info().Name }

// StandIn reports the nogpu host-memory stand-in.
func (d *Device) StandIn() bool { return d.d.Info().StandIn }

// Alloc allocates n octets of device memory.
func (d *Device) Alloc(n int64) (DeviceBuffer, error) { return d.d.Alloc(n) }

// Close releases the device.
func (d *Device) Close() error { return d.d.Close() }

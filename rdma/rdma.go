// Package rdma moves block octets by one-sided RDMA READ: a holder
// registers the octets of a block (or of a layer range) for remote read,
// tells an authorized client where they are over HTTPS (address, rkey,
// length; the holder's POST rdma/reads), and the client's RC queue pair
// reads them into its own registered buffer, with no holder CPU in the
// data path. The client then verifies every layer digest as for an HTTP
// GET.
//
// Two providers implement the same interfaces: Verbs, libibverbs through
// cgo under the opt-in build tag rdma (a machine without RDMA devices gets
// a clear error: ibv_get_device_list fails there with ENOSYS), and
// Loopback, an in-process fabric with the semantics the transfer logic
// relies on (rkey and bounds checks, deregistration, connection state),
// for tests and for machines without RDMA. Without the tag, Verbs returns
// ErrNotBuilt; default builds never need libibverbs.
package rdma

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Errors of the transfer path.
var (
	// ErrNotBuilt: this binary was built without -tags rdma (or cgo).
	ErrNotBuilt = errors.New("rdma: built without RDMA support (build with -tags rdma and cgo, with libibverbs-dev)")
	// ErrNoDevice: no RDMA device on this machine.
	ErrNoDevice = errors.New("rdma: no RDMA device")
	// ErrRemoteAccess: the peer refused the read (unknown or deregistered
	// rkey, out of the region's bounds, no remote-read access):
	// IBV_WC_REM_ACCESS_ERR.
	ErrRemoteAccess = errors.New("rdma: remote access error")
	// ErrNotConnected: the queue pair has no peer yet, or lost it.
	ErrNotConnected = errors.New("rdma: queue pair not connected")
	// ErrLocalLength: the local buffer cannot take the read.
	ErrLocalLength = errors.New("rdma: local buffer too small for the read")
	// ErrNoWindows: the device has no type 2 memory windows.
	ErrNoWindows = errors.New("rdma: the device has no type 2 memory windows")
)

// Region is registered memory a peer may read.
type Region struct {
	Addr uint64
	RKey uint32
	Len  uint64
}

// Endpoint is what a peer needs to connect an RC queue pair to this one.
type Endpoint struct {
	LID uint16
	QPN uint32 // 24 bits
	PSN uint32 // 24 bits
	GID [16]byte
}

// String encodes e as "v1.lid.qpn.psn.gid" (hex), the form the HTTPS
// exchange carries.
func (e Endpoint) String() string {
	return fmt.Sprintf("v1.%04x.%06x.%06x.%s", e.LID, e.QPN, e.PSN, hex.EncodeToString(e.GID[:]))
}

// ParseEndpoint parses String's form.
func ParseEndpoint(s string) (Endpoint, error) {
	var e Endpoint
	f := strings.Split(s, ".")
	if len(f) != 5 || f[0] != "v1" || len(f[1]) != 4 || len(f[2]) != 6 || len(f[3]) != 6 || len(f[4]) != 32 {
		return e, &EndpointError{fmt.Errorf("rdma: endpoint %q: want v1.lid.qpn.psn.gid in hex", s)}
	}
	lid, err1 := strconv.ParseUint(f[1], 16, 16)
	qpn, err2 := strconv.ParseUint(f[2], 16, 24)
	psn, err3 := strconv.ParseUint(f[3], 16, 24)
	_, err4 := hex.Decode(e.GID[:], []byte(f[4]))
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return e, &EndpointError{fmt.Errorf("rdma: endpoint %q: %w", s, err)}
	}
	e.LID, e.QPN, e.PSN = uint16(lid), uint32(qpn), uint32(psn)
	return e, nil
}

// EndpointError is an endpoint that does not parse: the peer's input is
// wrong (a holder answers 400), unlike the other failures of Accept.
type EndpointError struct{ err error }

func (e *EndpointError) Error() string { return e.err.Error() }
func (e *EndpointError) Unwrap() error { return e.err }

// Invalid marks the error as bad input.
func (e *EndpointError) Invalid() bool { return true }

// Access says what a registration allows beyond local use.
type Access uint8

const (
	// AccessLocal: the local queue pairs' work requests only (a read's
	// destination).
	AccessLocal Access = 0
	// AccessRemoteRead: any connected peer may read it with the MR's
	// rkey, until the MR is closed.
	AccessRemoteRead Access = 1
	// AccessWindows: memory windows may be bound over it (QP.Bind); peers
	// read through those only, each one peer's and revocable.
	AccessWindows Access = 2
)

// DeviceMemory is accelerator memory a provider registers for GPUDirect
// RDMA: a NIC then reads the device's memory with no host copy. It is
// what gpu.Buffer provides, named by its methods (rdma imports no project
// package): its address in the device's address space, its memory when
// it is host memory (the nogpu stand-in), and its export as a dma-buf.
type DeviceMemory = interface {
	DevicePtr() uint64
	HostBytes() []byte
	Dmabuf() (fd int, off, size uint64, err error)
	Len() int64
}

// Provider is an RDMA implementation on one device.
type Provider interface {
	// Name names the device ("mlx5_0", "loopback:holder").
	Name() string
	// Register registers buf with access. The buffer must stay alive and
	// unmoved until the MR is closed.
	Register(buf []byte, access Access) (MR, error)
	// RegisterDevice registers n octets at off of device memory
	// (GPUDirect RDMA: a dma-buf of the accelerator's memory, or the
	// stand-in's host memory); its Region's addresses are the device's.
	// The memory must stay allocated until the MR is closed.
	RegisterDevice(m DeviceMemory, off, n uint64, access Access) (MR, error)
	// NewQP creates an RC queue pair, ready to Connect.
	NewQP() (QP, error)
	// HasWindows reports whether the device has type 2 memory windows.
	HasWindows() bool
	Close() error
}

// MR is registered memory.
type MR interface {
	// Region is what a peer needs to read it (Len: the whole buffer).
	Region() Region
	Close() error
}

// QP is a reliable-connected queue pair.
type QP interface {
	// Endpoint is this side's, for the peer's Connect.
	Endpoint() Endpoint
	// Connect brings the pair to ready-to-send with remote as its peer.
	Connect(remote Endpoint) error
	// Read reads src.Len octets at src (the peer's memory) into dst
	// (registered here) at offset off, and returns once they are there.
	Read(ctx context.Context, dst MR, off uint64, src Region) error
	// Bind binds a memory window (type 2) over n octets at addr of mr
	// (registered with AccessWindows): this pair's peer, and only it, may
	// read them with the window's rkey until it is invalidated.
	// ErrNoWindows when the device has none.
	Bind(mr MR, addr, n uint64) (Window, error)
	Close() error
}

// Window is a memory window bound for one peer.
type Window interface {
	// RKey is the key the peer reads with.
	RKey() uint32
	// Invalidate revokes the key and returns once a peer can no longer
	// read through it. After an error the queue pair must be closed
	// (which ends the window too).
	Invalidate() error
}

// Package udpbuf opens UDP sockets for QUIC bulk transfer with large
// kernel buffers, and reports what the kernel actually granted: a QUIC
// receiver whose socket buffer overflows drops packets, and every drop
// costs a loss-recovery round trip and a congestion-window cut.
package udpbuf

import (
	"fmt"
	"net"
	"syscall"
)

// DefaultSize is the buffer asked for by default: about two bandwidth-delay
// products of a 25 Gbit/s link with a 1 ms round trip.
const DefaultSize = 8 << 20

// maxSize keeps requests within the kernel's int arithmetic (it doubles
// them).
const maxSize = 1 << 30

// Report is what a socket asked for and got. The figures are the kernel's
// own (getsockopt SO_RCVBUF/SO_SNDBUF; Linux doubles what it is asked, to
// account for its bookkeeping, and caps at net.core.rmem_max/wmem_max
// unless the process has CAP_NET_ADMIN).
type Report struct {
	Want          int
	Receive, Send int
}

// Capped reports whether the kernel granted less than was asked.
func (r Report) Capped() bool { return r.Receive < r.Want || r.Send < r.Want }

func (r Report) String() string {
	s := fmt.Sprintf("UDP socket buffers: receive %d KiB, send %d KiB (asked %d KiB)", r.Receive>>10, r.Send>>10, r.Want>>10)
	if r.Capped() {
		s += ": capped by the kernel; raise net.core.rmem_max and net.core.wmem_max (sysctl) to at least the size asked"
	}
	return s
}

// Listen opens a UDP socket on addr ("host:port"; port 0 picks one) with
// buffers of size octets asked for (DefaultSize when 0).
func Listen(addr string, size int) (*net.UDPConn, Report, error) {
	ua, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return nil, Report{}, fmt.Errorf("udpbuf: %w", err)
	}
	c, err := net.ListenUDP("udp", ua)
	if err != nil {
		return nil, Report{}, fmt.Errorf("udpbuf: %w", err)
	}
	r, err := Tune(c, size)
	if err != nil {
		c.Close()
		return nil, Report{}, err
	}
	return c, r, nil
}

// Tune asks for size octets of receive and send buffer on c (DefaultSize
// when 0), past the system's cap where the process is allowed to, and
// reports what the kernel granted.
func Tune(c *net.UDPConn, size int) (Report, error) {
	if size <= 0 {
		size = DefaultSize
	}
	size = min(size, maxSize)
	r := Report{Want: size}
	// Errors are ignored: what counts is what the kernel reports after.
	c.SetReadBuffer(size)
	c.SetWriteBuffer(size)
	rc, err := c.SyscallConn()
	if err != nil {
		return r, fmt.Errorf("udpbuf: %w", err)
	}
	var gerr error
	err = rc.Control(func(fd uintptr) {
		get := func() {
			if r.Receive, gerr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF); gerr != nil {
				return
			}
			r.Send, gerr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF)
		}
		if get(); gerr == nil && r.Capped() {
			force(fd, size) // with CAP_NET_ADMIN
			get()
		}
	})
	if err == nil {
		err = gerr
	}
	if err != nil {
		return r, fmt.Errorf("udpbuf: reading the socket buffer sizes: %w", err)
	}
	return r, nil
}

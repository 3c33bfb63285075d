package sockio

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
)

// Conn is a *net.TCPConn whose Read and Write are raw system calls (see
// the package comment). Its other methods are the TCPConn's: deadlines,
// Close, and ReadFrom and WriteTo (splice and sendfile, for plain TCP;
// crypto/tls calls Read and Write).
type Conn struct {
	*net.TCPConn
	raw syscall.RawConn

	rmu     sync.Mutex // one Read at a time, as net.Conn allows several callers
	rbuf    []byte     // the Read in progress
	rn      int
	rerr    syscall.Errno
	readFn  func(uintptr) bool // c.read, bound once: no closure per call
	wmu     sync.Mutex
	wbuf    []byte // the Write in progress; wn of it written
	wn      int
	werr    syscall.Errno
	writeFn func(uintptr) bool
}

// New wraps tc.
func New(tc *net.TCPConn) (*Conn, error) {
	raw, err := tc.SyscallConn()
	if err != nil {
		return nil, err
	}
	c := &Conn{TCPConn: tc, raw: raw}
	c.readFn, c.writeFn = c.read, c.write
	return c, nil
}

// Read reads as net.Conn's Read does: it waits in the network poller
// (with the read deadline) until the socket has data, then makes one raw
// read(2).
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rmu.Lock()
	c.rbuf, c.rn, c.rerr = p, 0, 0
	err := c.raw.Read(c.readFn)
	n, errno := c.rn, c.rerr
	c.rbuf = nil
	c.rmu.Unlock()
	switch {
	case err != nil:
		return n, err
	case errno != 0:
		return 0, c.opError("read", errno)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

func (c *Conn) read(fd uintptr) bool {
	for {
		n, errno := sysRead(fd, c.rbuf)
		switch errno {
		case 0:
			c.rn = n
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false // wait in the poller
		}
		c.rerr = errno
		return true
	}
}

// Write writes all of p as net.Conn's Write does: raw write(2)s while the
// socket takes them, waiting in the network poller (with the write
// deadline) while its send buffer is full.
func (c *Conn) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.wmu.Lock()
	c.wbuf, c.wn, c.werr = p, 0, 0
	err := c.raw.Write(c.writeFn)
	n, errno := c.wn, c.werr
	c.wbuf = nil
	c.wmu.Unlock()
	switch {
	case err != nil:
		return n, err
	case errno != 0:
		return n, c.opError("write", errno)
	}
	return n, nil
}

func (c *Conn) write(fd uintptr) bool {
	for c.wn < len(c.wbuf) {
		n, errno := sysWrite(fd, c.wbuf[c.wn:])
		switch errno {
		case 0:
			c.wn += n
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false // wait in the poller for room
		default:
			c.werr = errno
			return true
		}
	}
	return true
}

// opError is the error net.Conn's Read and Write return for errno.
func (c *Conn) opError(op string, errno syscall.Errno) error {
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: os.NewSyscallError(op, errno)}
}

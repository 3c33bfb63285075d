// Package sockio serves a TCP connection's reads and writes without the
// Go runtime's system-call hand-off.
//
// A Go program's read and write system calls go through the runtime's
// entersyscall, and the first one after the whole process has been idle
// wakes the runtime's monitor thread (sysmon) from its deep sleep and
// resets its polling interval to 20 µs, where it stays for at least 1 ms
// (50 polls) before it backs off. A server streaming a block to a client
// that reads at its own pace goes idle and wakes several times per block
// (each time the socket's send buffer fills), so the monitor wakes about
// ten times per 2 MiB block: half of the server's context switches, and a
// few percent of its CPU per GB (BenchmarkVersusNginx's server-switches/op,
// and scripts/perf-h2.sh).
//
// On a non-blocking socket a read or a write never waits in the kernel:
// when the socket has no data or no room it returns EAGAIN, and the
// goroutine waits in the network poller as net.Conn's own Read and Write
// do. Such calls need nothing the hand-off provides (another thread to run
// the goroutine's P while it is in the kernel), so Conn makes them as raw
// system calls through syscall.RawConn, and the monitor sleeps on. The
// poller, deadlines and Close are net.TCPConn's own.
//
// What the monitor does is unchanged otherwise: it wakes for the next
// timer (a deadline, a lease's expiry), for garbage collection and for any
// other system call, and while any P is busy it polls as before. Only the
// socket reads and writes no longer reset it to 20 µs polling. A raw call
// keeps its goroutine's P for the call's length (microseconds: a write
// copies at most the socket's free buffer and returns), where entersyscall
// would let the monitor hand the P to another thread after 20 µs.
package sockio

import (
	"net"
)

// Wrap returns c as a *Conn where it is a *net.TCPConn on a system Conn
// serves, else c itself: for a dialer's connections (an http.Transport's
// DialContext).
func Wrap(c net.Conn) net.Conn {
	if tc, ok := c.(*net.TCPConn); ok {
		if rc, err := New(tc); err == nil {
			return rc
		}
	}
	return c
}

// Listener wraps the TCP connections a listener accepts in Conn.
type Listener struct{ net.Listener }

// Accept returns the next connection, a *Conn where it is a
// *net.TCPConn on a system Conn serves.
func (l Listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return Wrap(c), nil
}

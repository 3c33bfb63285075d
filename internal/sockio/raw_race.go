//go:build linux && race

package sockio

import (
	"errors"
	"syscall"
)

// Built with the race detector, Conn reads and writes with syscall.Read
// and syscall.Write, through entersyscall: their annotations tell the
// detector that what a goroutine reads from a socket was written after
// the writer's earlier memory operations, which is how it knows a server
// handler's writes happen before the test that reads its response (raw
// calls carry no annotation, and every such hand-off in a test whose
// client and server share a process would be reported as a race). The
// rest of Conn (the poller, EAGAIN, partial writes, deadlines) is the
// same; only the monitor thread is woken as plain sockets wake it, and
// TestRawCallsLeaveTheMonitorAsleep skips.
const raceBuild = true

func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	n, err := syscall.Read(int(fd), p)
	return max(n, 0), errno(err)
}

func sysWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	n, err := syscall.Write(int(fd), p)
	return max(n, 0), errno(err)
}

func errno(err error) syscall.Errno {
	var e syscall.Errno
	if err != nil && !errors.As(err, &e) {
		return syscall.EIO
	}
	return e
}

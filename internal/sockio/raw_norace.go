//go:build linux && !race

package sockio

import (
	"syscall"
	"unsafe"
)

const raceBuild = false

// sysRead and sysWrite are read(2) and write(2) as raw system calls, with
// no entersyscall (see the package comment). p is not empty.
func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	n, _, errno := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), errno
}

func sysWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	n, _, errno := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), errno
}

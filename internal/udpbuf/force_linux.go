package udpbuf

import "syscall"

// force asks past net.core.rmem_max/wmem_max (CAP_NET_ADMIN only; an
// error otherwise, which the caller sees as the sizes it reads back).
func force(fd uintptr, size int) {
	syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUFFORCE, size)
	syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUFFORCE, size)
}

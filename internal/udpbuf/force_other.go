//go:build !linux

package udpbuf

func force(uintptr, int) {}

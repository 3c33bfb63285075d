//go:build !linux

package sockio

import (
	"errors"
	"net"
)

// Conn is net.TCPConn where the raw system calls are not implemented.
type Conn struct{ *net.TCPConn }

// New reports that Conn is not available on this system; Listener then
// returns the connections as they are.
func New(tc *net.TCPConn) (*Conn, error) {
	return nil, errors.New("sockio: raw reads and writes are implemented on Linux only")
}

package server

import (
	"crypto/tls"
	"net"
	"net/http"
)

// NetConnForTest is the TCP connection r came on (under its TLS), as the
// server's ConnContext recorded it; nil if there is none.
func NetConnForTest(r *http.Request) net.Conn {
	if c, ok := r.Context().Value(connKey).(*tls.Conn); ok {
		return c.NetConn()
	}
	return nil
}

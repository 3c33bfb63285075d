package client

import (
	"crypto/tls"
	"testing"

	"github.com/quic-go/quic-go"
)

// TestHTTP3Windows: HTTP/3 clients take block-sized receive windows
// unless told otherwise (quic-go's 512 KiB start stalls each 2 MiB block
// a round trip per window update), over every connection; an explicit
// configuration (here quic-go's stock one) is used as given.
func TestHTTP3Windows(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg  *quic.Config
		want uint64
	}{
		"default": {nil, 4 << 20},
		"stock":   {&quic.Config{}, 0},
	} {
		c, err := New(Config{TLS: &tls.Config{}, HTTP3: true, QUICConns: 3, QUICConfig: tc.cfg})
		if err != nil {
			t.Fatal(err)
		}
		rr := c.hc.Transport.(*roundRobin)
		if len(rr.trs) != 3 {
			t.Fatalf("%s: %d connections", name, len(rr.trs))
		}
		for _, tr := range rr.trs {
			if got := tr.QUICConfig.InitialStreamReceiveWindow; got != tc.want {
				t.Errorf("%s: initial stream window %d, want %d", name, got, tc.want)
			}
		}
		c.Close()
	}
}

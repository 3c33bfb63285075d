package holder_test

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"

	"github.com/quic-go/quic-go"

	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/pki"
	"github.com/kvsp/kvsp/quicbulk"
)

// BenchmarkQUICBound: what quic-go itself carries on this machine, the
// ceiling of any QUIC transport of the same blocks (HTTP/3 and quicbulk
// alike): each stream asks for one 2 MiB block by index and the server
// writes it from memory, over loopback mutual TLS with quicbulk's
// configuration, on 1 and 4 connections from 8 concurrent streams.
// "raw": the client only reads; "verify": it also hashes the octets twice
// with SHA-256, the work of verifying a container's digest and its layer
// digests. Compare BenchmarkGet's bulk and h3 lines with "verify": what a
// transport adds beyond QUIC and the verification is the gap to it.
func BenchmarkQUICBound(b *testing.B) {
	bf := newBenchFixture(b, 0)
	data := bf.data
	const alpn = "kvsp-bench-raw"
	srvLeaf := bf.pki.Issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/server"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	roots := x509.NewCertPool()
	roots.AddCert(bf.pki.CA.Cert)
	stls := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{srvLeaf.TLSCertificate()},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: roots, NextProtos: []string{alpn}}
	ln, err := quic.ListenAddr("127.0.0.1:0", stls, quicbulk.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	var served sync.WaitGroup
	defer served.Wait()
	defer ln.Close()
	served.Go(func() {
		for {
			conn, err := ln.Accept(context.Background())
			if err != nil {
				return
			}
			served.Go(func() {
				for {
					str, err := conn.AcceptStream(context.Background())
					if err != nil {
						return
					}
					served.Go(func() {
						var idx [4]byte
						if _, err := io.ReadFull(str, idx[:]); err == nil {
							str.Write(data)
						}
						str.Close()
					})
				}
			})
		}
	})
	for _, mode := range []string{"raw", "verify"} {
		for _, conns := range []int{1, 4} {
			b.Run(fmt.Sprintf("%s/conns=%d/clients=8", mode, conns), func(b *testing.B) {
				ctls := bf.pki.ClientTLS(bf.pki.Leaf(kvsptest.ClientA))
				ctls.NextProtos = []string{alpn}
				var cs []*quic.Conn
				for range conns {
					c, err := quic.DialAddr(context.Background(), ln.Addr().String(), ctls, quicbulk.DefaultConfig())
					if err != nil {
						b.Fatal(err)
					}
					defer c.CloseWithError(0, "")
					cs = append(cs, c)
				}
				b.SetBytes(int64(len(data)))
				b.ReportAllocs()
				b.ResetTimer()
				var wg sync.WaitGroup
				work := make(chan int)
				for range 8 {
					wg.Go(func() {
						buf := make([]byte, 256<<10)
						for i := range work {
							str, err := cs[i%len(cs)].OpenStreamSync(context.Background())
							if err != nil {
								b.Error(err)
								return
							}
							var idx [4]byte
							binary.BigEndian.PutUint32(idx[:], uint32(i))
							str.Write(idx[:])
							str.Close()
							whole, part := sha256.New(), sha256.New()
							n := 0
							for {
								m, err := str.Read(buf)
								if mode == "verify" {
									whole.Write(buf[:m])
									part.Write(buf[:m])
								}
								n += m
								if err == io.EOF {
									break
								}
								if err != nil {
									b.Error(err)
									return
								}
							}
							if n != len(data) {
								b.Errorf("read %d octets of %d", n, len(data))
								return
							}
						}
					})
				}
				for i := 0; i < b.N; i++ {
					work <- i
				}
				close(work)
				wg.Wait()
			})
		}
	}
}

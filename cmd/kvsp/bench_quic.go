package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/kvsp/kvsp/quicbulk"
)

// The bench's QUIC bound: what quic-go carries on this machine with no
// HTTP and no kvsp at all, the ceiling of the h3 and quicbulk lines. The
// self-started holder answers ALPN quicBoundALPN on its UDP port: a
// stream asks for n octets (4 octets, big-endian) and gets them from
// memory. The client reads them on 8 streams over 4 connections (as
// quicbulk does), alone ("raw"), then hashing them twice with SHA-256 as
// verifying a container and its layers does ("verified").
const quicBoundALPN = "kvsp-bench-quic-bound"

// quicBoundServer is the bound's server side, a server.QUICHandler.
type quicBoundServer struct {
	data []byte
	wg   sync.WaitGroup
}

func (s *quicBoundServer) ServeQUICConn(conn *quic.Conn) error {
	for {
		str, err := conn.AcceptStream(conn.Context())
		if err != nil {
			return nil
		}
		s.wg.Go(func() {
			defer str.Close()
			var n [4]byte
			if _, err := io.ReadFull(str, n[:]); err != nil {
				str.CancelWrite(0)
				return
			}
			size := int(binary.BigEndian.Uint32(n[:]))
			for size > 0 {
				m := min(size, len(s.data))
				if _, err := str.Write(s.data[:m]); err != nil {
					return
				}
				size -= m
			}
		})
	}
}

func (s *quicBoundServer) Shutdown(ctx context.Context) error {
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// quicBound measures the bound against addr (the holder's host:port) for
// blocks of octets, for d each way, in GB/s.
func quicBound(addr string, tc *tls.Config, octets int, d time.Duration) (raw, verified float64, err error) {
	tc = tc.Clone()
	tc.NextProtos = []string{quicBoundALPN}
	var conns []*quic.Conn
	defer func() {
		for _, c := range conns {
			c.CloseWithError(0, "")
		}
	}()
	for range 4 {
		c, err := quic.DialAddr(context.Background(), addr, tc, quicbulk.DefaultConfig())
		if err != nil {
			return 0, 0, fmt.Errorf("bench: the QUIC bound: %w", err)
		}
		conns = append(conns, c)
	}
	run := func(verify bool) (float64, error) {
		var moved atomic.Int64
		var next atomic.Int64
		var firstErr error
		var once sync.Once
		deadline := time.Now().Add(d)
		start := time.Now()
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				buf := make([]byte, 256<<10)
				for time.Now().Before(deadline) {
					n, err := quicBoundGet(conns[next.Add(1)%int64(len(conns))], octets, buf, verify)
					if err != nil {
						once.Do(func() { firstErr = err })
						return
					}
					moved.Add(int64(n))
				}
			})
		}
		wg.Wait()
		return float64(moved.Load()) / time.Since(start).Seconds() / 1e9, firstErr
	}
	if raw, err = run(false); err != nil {
		return 0, 0, err
	}
	verified, err = run(true)
	return raw, verified, err
}

// quicBoundGet asks for octets octets on a new stream of c and reads them.
func quicBoundGet(c *quic.Conn, octets int, buf []byte, verify bool) (int, error) {
	str, err := c.OpenStreamSync(context.Background())
	if err != nil {
		return 0, err
	}
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(octets))
	if _, err := str.Write(n[:]); err != nil {
		return 0, err
	}
	str.Close()
	whole, layer := sha256.New(), sha256.New()
	got := 0
	for {
		m, err := str.Read(buf)
		if verify {
			whole.Write(buf[:m])
			layer.Write(buf[:m])
		}
		got += m
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return got, err
		}
	}
	if got != octets {
		return got, fmt.Errorf("bench: the QUIC bound: %d octets of %d", got, octets)
	}
	return got, nil
}

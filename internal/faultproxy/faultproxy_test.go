package faultproxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// source serves n octets to every connection, after reading its request
// line.
func source(t *testing.T, n int) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.Read(make([]byte, 16))
				c.Write(bytes.Repeat([]byte("k"), n))
			}()
		}
	}()
	return ln.Addr().String()
}

func fetch(t *testing.T, p *Proxy, timeout time.Duration) ([]byte, error) {
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	c.Write([]byte("GET\n"))
	return io.ReadAll(c)
}

func start(t *testing.T, n int) *Proxy {
	p, err := Start(source(t, n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TestFaults: each toxic does what it says, and clearing it restores
// clean transfers.
func TestFaults(t *testing.T) {
	p := start(t, 100<<10)
	if b, err := fetch(t, p, 5*time.Second); err != nil || len(b) != 100<<10 {
		t.Fatalf("clean: %d octets, %v", len(b), err)
	}
	p.Set(Faults{CutAfter: 1000})
	if b, err := fetch(t, p, 5*time.Second); err != nil || len(b) != 1000 {
		t.Fatalf("cut after 1000: %d octets, %v", len(b), err)
	}
	p.Set(Faults{ResetAfter: 5000})
	b, err := fetch(t, p, 5*time.Second)
	if !errors.Is(err, syscall.ECONNRESET) || len(b) > 5000 {
		t.Fatalf("reset after 5000: %d octets, %v", len(b), err)
	}
	p.Set(Faults{BytesPerSecond: 1 << 20}) // 100 KiB at 1 MiB/s: about 100 ms
	start := time.Now()
	if b, err := fetch(t, p, 5*time.Second); err != nil || len(b) != 100<<10 || time.Since(start) < 80*time.Millisecond {
		t.Fatalf("bandwidth: %d octets in %v, %v", len(b), time.Since(start), err)
	}
	p.Set(Faults{Latency: 50 * time.Millisecond, SliceBytes: 64 << 10})
	start = time.Now()
	if b, err := fetch(t, p, 5*time.Second); err != nil || len(b) != 100<<10 || time.Since(start) < 50*time.Millisecond {
		t.Fatalf("latency: %d octets in %v, %v", len(b), time.Since(start), err)
	}
	p.Set(Faults{BlackHole: true})
	if b, err := fetch(t, p, 200*time.Millisecond); len(b) != 0 || err == nil {
		t.Fatalf("black hole: %d octets, %v", len(b), err)
	}
	p.Set(Faults{})
	if b, err := fetch(t, p, 5*time.Second); err != nil || len(b) != 100<<10 {
		t.Fatalf("clean again: %d octets, %v", len(b), err)
	}
}

// Package faultproxy is an in-process TCP proxy for loopback fault tests
// (the toxics of RELIABILITY.md): latency with jitter, a bandwidth limit,
// slicing into small writes, a cut or a reset after a number of octets,
// and a black hole. Faults apply to what the target sends back (the
// download direction, where block transfers go) and can be changed while
// connections run; a new setting applies to the octets that follow.
package faultproxy

import (
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"
)

// Faults are the toxics in force.
type Faults struct {
	// Latency, plus up to Jitter either way, delays every chunk.
	Latency, Jitter time.Duration
	// BytesPerSecond limits the rate (0: unlimited).
	BytesPerSecond int64
	// SliceBytes delivers in writes of at most this many octets (the
	// "slicer"; 0: as read).
	SliceBytes int
	// CutAfter closes a connection after this many octets were delivered
	// on it (a holder killed mid-transfer; 0: never).
	CutAfter int64
	// ResetAfter resets it (TCP RST) after this many octets (0: never).
	ResetAfter int64
	// BlackHole stops delivering anything (connections stay open).
	BlackHole bool
}

// Proxy forwards connections from its address to a target.
type Proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	faults Faults
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
	closed bool
}

// Start listens on 127.0.0.1 and forwards to target ("host:port").
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's address.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Set replaces the faults in force.
func (p *Proxy) Set(f Faults) {
	p.mu.Lock()
	p.faults = f
	p.mu.Unlock()
}

func (p *Proxy) current() Faults {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.faults
}

// Close stops accepting and closes every connection.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
		c.Close()
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			down.Close()
			continue
		}
		if !p.track(down, up) {
			down.Close()
			up.Close()
			return
		}
		p.wg.Add(2)
		go func() { // requests go through untouched
			defer p.wg.Done()
			io.Copy(up, down)
			if tc, ok := up.(*net.TCPConn); ok {
				tc.CloseWrite()
			}
		}()
		go func() {
			defer p.wg.Done()
			defer p.untrack(down, up)
			p.deliver(down, up)
		}()
	}
}

// errReset marks a connection the proxy reset.
var errReset = errors.New("faultproxy: reset")

// deliver copies the target's answers to the client through the faults.
func (p *Proxy) deliver(dst, src net.Conn) error {
	buf := make([]byte, 32<<10)
	var sent int64
	for {
		n, err := src.Read(buf)
		chunk := buf[:n]
		for len(chunk) > 0 {
			f := p.current()
			for f.BlackHole { // hold everything until the hole closes
				time.Sleep(10 * time.Millisecond)
				if p.isClosed() {
					return nil
				}
				f = p.current()
			}
			k := len(chunk)
			if f.SliceBytes > 0 {
				k = min(k, f.SliceBytes)
			}
			if f.CutAfter > 0 {
				k = int(min(int64(k), max(0, f.CutAfter-sent)))
			}
			if f.ResetAfter > 0 {
				k = int(min(int64(k), max(0, f.ResetAfter-sent)))
			}
			if d := f.Latency; d > 0 {
				if f.Jitter > 0 {
					d += time.Duration(rand.Int64N(int64(2*f.Jitter))) - f.Jitter
				}
				time.Sleep(max(0, d))
			}
			if f.BytesPerSecond > 0 {
				time.Sleep(time.Duration(float64(k) / float64(f.BytesPerSecond) * float64(time.Second)))
			}
			if k > 0 {
				if _, werr := dst.Write(chunk[:k]); werr != nil {
					return werr
				}
				sent += int64(k)
				chunk = chunk[k:]
			}
			if f.ResetAfter > 0 && sent >= f.ResetAfter {
				if tc, ok := dst.(*net.TCPConn); ok {
					tc.SetLinger(0) // close sends RST
				}
				return errReset
			}
			if f.CutAfter > 0 && sent >= f.CutAfter {
				return nil
			}
		}
		if err != nil {
			return err
		}
	}
}

func (p *Proxy) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

package holder_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/kvsp/kvsp/internal/h2"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/pki"
)

// serveH2Floor is the HTTP/2 rows' TLS floor (TestTLSFloorProcess): it
// answers every request on tc with body, doing the least an HTTP/2 server
// can: no routing, authorization or store, request headers not decoded, a
// header block encoded once (no HPACK state), the client's windows kept.
// One goroutine reads frames; one writes, giving the streams DATA frames
// in turn as far as the windows allow, each frame cut as internal/h2's
// are (header and payload fill whole TLS records) and written as they
// are (a 16 KiB buffer in front of the TLS connection, a frame's header
// and first octets copied into it, the rest written from body itself).
// What it costs per GB is crypto/tls's sealing and write syscalls of the
// same octets in the same frames, and the two goroutines' hand-offs. With
// handlers, each request also has a goroutine of its own, started at its
// HEADERS, that queues the response and waits for its last frame: the
// cost of net/http's handler model, without the rest of a server.
func serveH2Floor(tc *tls.Conn, body []byte, handlers bool) {
	defer tc.Close()
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(tc, preface); err != nil || string(preface) != http2.ClientPreface {
		return
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":status", "200"}, {"content-type", "application/kvsp-block"}, {"content-length", strconv.Itoa(len(body))}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1], Sensitive: true}) // never indexed
	}
	bw := bufio.NewWriterSize(tc, 16<<10)
	f := &h2Floor{bw: bw, w: http2.NewFramer(bw, nil), body: body, hdr: hb.Bytes(), kick: make(chan struct{}, 1), done: make(chan struct{}),
		connWin: 65535, initWin: 65535, maxFrame: 16384, byID: map[uint32]*floorStream{}}
	if f.w.WriteSettings() != nil || bw.Flush() != nil {
		return
	}
	go f.writeLoop()
	defer close(f.done)
	fr := http2.NewFramer(nil, tc)
	fr.SetMaxReadFrameSize(1 << 20)
	for {
		fm, err := fr.ReadFrame()
		if err != nil {
			return
		}
		f.mu.Lock()
		switch fm := fm.(type) {
		case *http2.SettingsFrame:
			if !fm.IsAck() {
				fm.ForeachSetting(func(s http2.Setting) error {
					switch s.ID {
					case http2.SettingInitialWindowSize:
						for _, st := range f.byID {
							st.window += int64(s.Val) - f.initWin
						}
						f.initWin = int64(s.Val)
					case http2.SettingMaxFrameSize:
						f.maxFrame = int(s.Val)
					}
					return nil
				})
				f.acks = append(f.acks, ack{settings: true})
			}
		case *http2.PingFrame:
			if !fm.IsAck() {
				f.acks = append(f.acks, ack{ping: fm.Data})
			}
		case *http2.WindowUpdateFrame:
			if fm.StreamID == 0 {
				f.connWin += int64(fm.Increment)
			} else if st := f.byID[fm.StreamID]; st != nil {
				st.window += int64(fm.Increment)
			}
		case *http2.HeadersFrame:
			st := &floorStream{id: fm.StreamID, window: f.initWin}
			f.byID[st.id] = st
			if handlers { // a goroutine per request, as net/http's handlers: it queues the body and waits for its end
				st.done = make(chan struct{})
				go func() {
					f.mu.Lock()
					f.queue = append(f.queue, st)
					f.mu.Unlock()
					select {
					case f.kick <- struct{}{}:
					default:
					}
					select {
					case <-st.done:
					case <-f.done:
					}
				}()
			} else {
				f.queue = append(f.queue, st)
			}
		case *http2.RSTStreamFrame:
			if st := f.byID[fm.StreamID]; st != nil {
				st.gone = true
				delete(f.byID, st.id)
				if st.done != nil {
					close(st.done)
				}
			}
		case *http2.GoAwayFrame:
			f.mu.Unlock()
			return
		}
		f.mu.Unlock()
		select {
		case f.kick <- struct{}{}:
		default:
		}
	}
}

type floorStream struct {
	done    chan struct{} // closed when its last frame is written (handlers)
	id      uint32
	window  int64
	sent    int // body octets given to frames
	headers bool
	gone    bool
}

type ack struct {
	settings bool
	ping     [8]byte
}

type h2Floor struct {
	bw   *bufio.Writer
	w    *http2.Framer // the writer goroutine's
	body []byte
	hdr  []byte
	kick chan struct{}
	done chan struct{}

	mu       sync.Mutex
	connWin  int64
	initWin  int64
	maxFrame int
	queue    []*floorStream // streams with octets to send, in turn
	byID     map[uint32]*floorStream
	acks     []ack
}

// next (mu held) picks the next frame: the first stream in turn with
// headers to send or window to send DATA in, and how many body octets
// (from off) its frame carries.
func (f *h2Floor) next() (st *floorStream, off, n int, headers bool) {
	for range len(f.queue) {
		st = f.queue[0]
		f.queue = f.queue[1:]
		if st.gone {
			continue
		}
		headers = !st.headers
		st.headers = true
		if allowed := min(f.connWin, st.window, int64(f.maxFrame)); allowed > 0 {
			n = h2.FrameSize(len(f.body)-st.sent, int(allowed))
		}
		off = st.sent
		st.sent += n
		f.connWin -= int64(n)
		st.window -= int64(n)
		if st.sent < len(f.body) {
			f.queue = append(f.queue, st) // its next frame after the others'
		} else {
			delete(f.byID, st.id)
			if st.done != nil {
				close(st.done)
			}
		}
		if headers || n > 0 {
			return st, off, n, headers
		}
	}
	return nil, 0, 0, false
}

func (f *h2Floor) writeLoop() {
	for {
		f.mu.Lock()
		acks := f.acks
		f.acks = nil
		st, off, n, headers := f.next()
		f.mu.Unlock()
		for _, a := range acks {
			var err error
			if a.settings {
				err = f.w.WriteSettingsAck()
			} else {
				err = f.w.WritePing(true, a.ping)
			}
			if err != nil {
				return
			}
		}
		if st == nil {
			if len(acks) > 0 {
				continue
			}
			if f.bw.Flush() != nil {
				return
			}
			select {
			case <-f.kick:
			case <-f.done:
				return
			}
			continue
		}
		if headers && f.w.WriteHeaders(http2.HeadersFrameParam{StreamID: st.id, BlockFragment: f.hdr, EndHeaders: true}) != nil {
			return
		}
		if n == 0 {
			continue
		}
		var h [9]byte
		h[0], h[1], h[2] = byte(n>>16), byte(n>>8), byte(n)
		h[3] = byte(http2.FrameData)
		if off+n == len(f.body) {
			h[4] = byte(http2.FlagDataEndStream)
		}
		binary.BigEndian.PutUint32(h[5:], st.id)
		if _, err := f.bw.Write(h[:]); err != nil {
			return
		}
		if _, err := f.bw.Write(f.body[off : off+n]); err != nil {
			return
		}
	}
}

// The HTTP/2 floor is a server the benchmarks trust for their reference:
// it answers every request with the whole body, to Go's HTTP/2 client,
// with eight streams at once sharing a connection window smaller than
// their bodies (so that it keeps the windows), with and without its
// goroutine per request.
func TestH2FloorServes(t *testing.T) {
	p := kvsptest.NewPKI(t)
	srvLeaf := p.Issue(pki.LeafOptions{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	body := make([]byte, 1<<20+12345)
	for i := range body {
		body[i] = byte(i * 7)
	}
	for _, handlers := range []bool{false, true} {
		t.Run(fmt.Sprintf("handlers=%v", handlers), func(t *testing.T) {
			ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{srvLeaf.TLSCertificate()}, NextProtos: []string{"h2"}})
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			defer wg.Wait()
			defer ln.Close()
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						tc := c.(*tls.Conn)
						if tc.Handshake() == nil {
							serveH2Floor(tc, body, handlers)
						}
						tc.Close()
					}()
				}
			}()
			tr := &http.Transport{TLSClientConfig: p.ClientTLS(nil), ForceAttemptHTTP2: true,
				HTTP2: &http.HTTP2Config{MaxReceiveBufferPerConnection: 3 << 20, MaxReceiveBufferPerStream: 3 << 20}}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr, Timeout: 20 * time.Second} // a body never ended fails, not hangs
			var cwg sync.WaitGroup
			for range 8 {
				cwg.Add(1)
				go func() {
					defer cwg.Done()
					for range 3 {
						resp, err := c.Get("https://" + ln.Addr().String() + "/block")
						if err != nil {
							t.Error(err)
							return
						}
						got, err := io.ReadAll(resp.Body)
						resp.Body.Close()
						if err != nil || resp.ProtoMajor != 2 || resp.ContentLength != int64(len(body)) || !bytes.Equal(got, body) {
							t.Errorf("HTTP/%d, %d octets of %d (declared %d), equal %v, %v", resp.ProtoMajor, len(got), len(body), resp.ContentLength, bytes.Equal(got, body), err)
							return
						}
					}
				}()
			}
			cwg.Wait()
			tr.CloseIdleConnections()
		})
	}
}

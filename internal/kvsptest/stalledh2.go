package kvsptest

import (
	"bytes"
	"crypto/tls"
	"io"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// StalledH2 is a raw HTTP/2 client connection that grants no window
// (SETTINGS_INITIAL_WINDOW_SIZE 0): the server may send its responses'
// headers, never a DATA octet (RELIABILITY B11, B12). It records, per
// stream, when its request went, its response's status and when (and
// with which code) the server reset it.
type StalledH2 struct {
	c    *tls.Conn
	fr   *http2.Framer
	wmu  sync.Mutex
	done chan struct{} // the server ended the connection

	mu      sync.Mutex
	sent    map[uint32]time.Time
	status  map[uint32]int
	resets  map[uint32]time.Duration // after its request
	codes   map[uint32]http2.ErrCode
	changed chan struct{}
}

// DialStalled opens a StalledH2 to addr; the test's cleanup closes it.
func DialStalled(t testing.TB, addr string, conf *tls.Config) *StalledH2 {
	t.Helper()
	conf = conf.Clone()
	conf.NextProtos = []string{"h2"}
	c, err := tls.Dial("tcp", addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	s := &StalledH2{c: c, fr: http2.NewFramer(c, c), done: make(chan struct{}), sent: map[uint32]time.Time{}, status: map[uint32]int{},
		resets: map[uint32]time.Duration{}, codes: map[uint32]http2.ErrCode{}, changed: make(chan struct{}, 1)}
	s.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	io.WriteString(c, http2.ClientPreface)
	if err := s.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}); err != nil {
		t.Fatal(err)
	}
	go s.read()
	return s
}

func (s *StalledH2) read() {
	defer close(s.done)
	for {
		f, err := s.fr.ReadFrame()
		if err != nil {
			return
		}
		s.mu.Lock()
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				s.wmu.Lock()
				s.fr.WriteSettingsAck()
				s.wmu.Unlock()
			}
		case *http2.MetaHeadersFrame:
			s.status[f.StreamID], _ = strconv.Atoi(f.PseudoValue("status"))
		case *http2.RSTStreamFrame:
			s.resets[f.StreamID] = time.Since(s.sent[f.StreamID])
			s.codes[f.StreamID] = f.ErrCode
		}
		s.mu.Unlock()
		select {
		case s.changed <- struct{}{}:
		default:
		}
	}
}

// Get sends GET path on stream id.
func (s *StalledH2) Get(id uint32, path string) error { return s.Send(id, "GET", path, "", nil) }

// Send sends a request on stream id: its headers, and body (with its
// Content-Type) when not nil, in one DATA frame (the server's windows
// allow it).
func (s *StalledH2) Send(id uint32, method, path, contentType string, body []byte) error {
	var b bytes.Buffer
	enc := hpack.NewEncoder(&b)
	fields := [][2]string{{":method", method}, {":scheme", "https"}, {":authority", "127.0.0.1"}, {":path", path}}
	if body != nil {
		fields = append(fields, [2]string{"content-type", contentType}, [2]string{"content-length", strconv.Itoa(len(body))})
	}
	for _, f := range fields {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	s.mu.Lock()
	s.sent[id] = time.Now()
	s.mu.Unlock()
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if err := s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: b.Bytes(), EndStream: body == nil, EndHeaders: true}); err != nil {
		return err
	}
	if body == nil {
		return nil
	}
	return s.fr.WriteData(id, true, body)
}

// ResetCount is the number of streams the server has reset.
func (s *StalledH2) ResetCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.resets)
}

// Answered is the number of streams whose response headers came.
func (s *StalledH2) Answered() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.status)
}

// Stream reports what became of stream id: its response's status (0:
// none yet), and whether, how long after its request and with which code
// the server reset it.
func (s *StalledH2) Stream(id uint32) (status int, reset bool, after time.Duration, code http2.ErrCode) {
	s.mu.Lock()
	defer s.mu.Unlock()
	after, reset = s.resets[id]
	return s.status[id], reset, after, s.codes[id]
}

// Changed receives after a frame was read.
func (s *StalledH2) Changed() <-chan struct{} { return s.changed }

// Close closes the connection and waits for its reader to end.
func (s *StalledH2) Close() {
	s.c.Close()
	<-s.done
}

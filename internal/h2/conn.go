package h2

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// conn is one HTTP/2 connection. The goroutine that runs serve reads
// frames and is the only one that changes what the client sent (streams,
// receive windows); handlers and the control writer write.
type conn struct {
	srv     *Server
	hs      *http.Server
	cfg     Config
	tc      *tls.Conn
	handler http.Handler
	baseCtx context.Context
	cancel  context.CancelFunc
	done    chan struct{} // closed when the connection ends
	state   *tls.ConnectionState
	remote  string
	fr      *http2.Framer // reads (serve goroutine), control frames (under the write lock)

	// Writing: wsem is the write lock (a channel, so a waiter can give up
	// at its deadline); bw, the HPACK encoder and werr are its.
	wsem      chan struct{}
	waiting   atomic.Int32 // writers waiting for wsem
	bw        *bufio.Writer
	out       io.Writer // what bw writes to: the TLS connection
	henc      *hpack.Encoder
	hbuf      headerBuffer
	werr      error
	deadline  time.Time // the connection's write deadline now set
	ctrlMu    sync.Mutex
	ctrl      []control
	ctrlKick  chan struct{}
	ctrlAlive chan struct{} // closed when the control writer ends

	// mu guards the streams and the send side's flow control.
	mu            sync.Mutex
	streams       map[uint32]*stream
	maxStreamID   uint32 // the highest stream the client opened
	sendWindow    int64  // the connection's send window
	initialWindow int64  // the client's SETTINGS_INITIAL_WINDOW_SIZE
	peerMaxFrame  int
	connQueue     []*stream       // writers waiting for the connection's send window, first come first
	running       int             // handlers running
	queued        []*stream       // streams whose handler waits for one to end
	queueRoom     chan struct{}   // a handler ended or started: the queue may have room
	work          chan handlerJob // a handler for an idle worker (worker.go)
	idleWorkers   atomic.Int32
	goingAway     bool // a GOAWAY was sent: no new streams
	clientGoAway  bool // the client sent GOAWAY
	idle          *time.Timer
	closing       atomic.Bool
	settingsSent  atomic.Bool // the preface's SETTINGS went: other frames may follow

	// The receive side: recvWindow is what the client may still send on
	// the connection (taken by the serve goroutine, given back by
	// whoever consumes a body).
	recvWindow  atomic.Int64
	sawSettings bool // serve goroutine only
	unackedMu   sync.Mutex
	unacked     int64 // octets of the connection consumed, not yet returned
}

// kindTableSize is a queued change of the HPACK encoder's table size
// limit (SETTINGS_HEADER_TABLE_SIZE), applied by the writer before the
// SETTINGS ACK that follows it.
const kindTableSize http2.FrameType = 0xff

// control is a frame queued for the control writer.
type control struct {
	kind   http2.FrameType
	stream uint32
	val    uint32 // window increment, error code
	ack    bool
	data   [8]byte
}

func newConn(s *Server, hs *http.Server, tc *tls.Conn, h http.Handler) *conn {
	cfg := s.cfg.withDefaults(hs)
	base := context.Background()
	if bc, ok := h.(baseContexter); ok {
		base = bc.BaseContext()
	}
	ctx, cancel := context.WithCancel(base)
	state := tc.ConnectionState()
	c := &conn{
		srv: s, hs: hs, cfg: cfg, tc: tc, handler: h, baseCtx: ctx, cancel: cancel,
		done: make(chan struct{}), state: &state, remote: tc.RemoteAddr().String(),
		wsem: make(chan struct{}, 1), ctrlKick: make(chan struct{}, 1), ctrlAlive: make(chan struct{}),
		streams: map[uint32]*stream{}, sendWindow: 65535, initialWindow: 65535, peerMaxFrame: 16 << 10,
		queueRoom: make(chan struct{}, 1), work: make(chan handlerJob),
	}
	c.recvWindow.Store(65535)
	c.out = tc
	c.bw = bufio.NewWriterSize(tc, recordPayload)
	c.fr = http2.NewFramer(c.bw, tc)
	c.fr.SetMaxReadFrameSize(cfg.MaxReadFrameSize)
	c.fr.MaxHeaderListSize = uint32(cfg.MaxHeaderBytes)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.SetReuseFrames()
	c.henc = hpack.NewEncoder(&c.hbuf)
	return c
}

// connError ends the connection with a GOAWAY of its code.
type connError struct {
	code   http2.ErrCode
	reason string
}

func (e connError) Error() string {
	return fmt.Sprintf("h2: connection error %v: %s", e.code, e.reason)
}

// streamError resets one stream.
type streamError struct {
	id   uint32
	code http2.ErrCode
}

func (e streamError) Error() string { return fmt.Sprintf("h2: stream %d error %v", e.id, e.code) }

func (c *conn) logf(format string, args ...any) {
	if c.hs.ErrorLog != nil {
		c.hs.ErrorLog.Printf(format, args...)
	}
}

// serve reads the preface and then frames until the connection ends.
func (c *conn) serve() {
	defer c.close()
	c.tc.SetReadDeadline(time.Now().Add(c.cfg.PrefaceTimeout))
	if c.closing.Load() { // shut down before it began
		return
	}
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(c.tc, preface[:]); err != nil || string(preface[:]) != http2.ClientPreface {
		return // not HTTP/2, or too slow: nothing to say
	}
	settings := []http2.Setting{
		{ID: http2.SettingMaxConcurrentStreams, Val: c.cfg.MaxConcurrentStreams},
		{ID: http2.SettingMaxFrameSize, Val: c.cfg.MaxReadFrameSize},
		{ID: http2.SettingInitialWindowSize, Val: c.cfg.StreamWindow},
		{ID: http2.SettingMaxHeaderListSize, Val: uint32(c.cfg.MaxHeaderBytes)},
		{ID: http2.SettingEnablePush, Val: 0},
	}
	if err := c.writeNow(func() error {
		if err := c.fr.WriteSettings(settings...); err != nil {
			return err
		}
		if d := int64(c.cfg.ConnWindow) - 65535; d > 0 {
			return c.fr.WriteWindowUpdate(0, uint32(d))
		}
		return nil
	}); err != nil {
		return
	}
	c.settingsSent.Store(true)
	go c.controlWriter() // nothing queued goes before the SETTINGS (RFC 9113 section 3.4)
	c.recvWindow.Store(int64(c.cfg.ConnWindow))
	c.mu.Lock()
	c.idle = time.AfterFunc(c.cfg.IdleTimeout, c.goAwayGracefully)
	c.mu.Unlock()
	for {
		if c.sawSettings {
			c.setReadDeadline()
		}
		f, err := c.fr.ReadFrame()
		if err == nil {
			err = c.processFrame(f)
		}
		if err == nil {
			continue
		}
		var se streamError
		var ce connError
		var he http2.StreamError
		var hc http2.ConnectionError
		switch {
		case errors.As(err, &se) || errors.As(err, &he):
			if he.StreamID != 0 {
				se = streamError{he.StreamID, he.Code}
			}
			c.mu.Lock()
			c.maxStreamID = max(c.maxStreamID, se.id) // a refused stream's id is used
			c.mu.Unlock()
			if err := c.resetStream(se.id, se.code); err != nil {
				c.goAwayError(http2.ErrCodeEnhanceYourCalm)
				return
			}
		case errors.As(err, &ce):
			c.logf("http2: server connection error from %s: %s", c.remote, ce.reason)
			c.goAwayError(ce.code)
			return
		case errors.Is(err, http2.ErrFrameTooLarge):
			c.goAwayError(http2.ErrCodeFrameSize)
			return
		case errors.As(err, &hc):
			detail := ""
			if d := c.fr.ErrorDetail(); d != nil {
				detail = d.Error()
			}
			c.logf("http2: server connection error from %s: %v %s", c.remote, http2.ErrCode(hc), detail)
			c.goAwayError(http2.ErrCode(hc))
			return
		case errors.Is(err, os.ErrDeadlineExceeded):
			c.goAwayGracefully() // idle, or a client too slow to finish a frame
			c.flushShortly()
			c.finAndDrain()
			return
		default: // the client went away, or the connection broke
			return
		}
	}
}

// setReadDeadline bounds the wait for the next frame while the
// connection has no stream: a connection idle past IdleTimeout, or one
// that starts a frame (a header block) and does not finish it, is closed.
func (c *conn) setReadDeadline() {
	c.mu.Lock()
	idle := len(c.streams) == 0 && c.running == 0 && len(c.queued) == 0
	c.mu.Unlock()
	if c.closing.Load() {
		c.tc.SetReadDeadline(time.Now()) // closeSoon's, which this would overwrite
		return
	}
	if idle {
		c.tc.SetReadDeadline(time.Now().Add(c.cfg.IdleTimeout))
	} else {
		c.tc.SetReadDeadline(time.Time{})
	}
}

func (c *conn) processFrame(f http2.Frame) error {
	if !c.sawSettings {
		sf, ok := f.(*http2.SettingsFrame)
		if !ok || sf.IsAck() {
			return connError{http2.ErrCodeProtocol, "the client's first frame is not SETTINGS"}
		}
		c.sawSettings = true
		c.tc.SetReadDeadline(time.Time{})
	}
	switch f := f.(type) {
	case *http2.SettingsFrame:
		return c.processSettings(f)
	case *http2.MetaHeadersFrame:
		return c.processHeaders(f)
	case *http2.DataFrame:
		return c.processData(f)
	case *http2.WindowUpdateFrame:
		return c.processWindowUpdate(f)
	case *http2.PingFrame:
		if f.StreamID != 0 {
			return connError{http2.ErrCodeProtocol, "PING on a stream"}
		}
		if !f.IsAck() {
			return c.queueControl(control{kind: http2.FramePing, ack: true, data: f.Data})
		}
		return nil
	case *http2.RSTStreamFrame:
		return c.processReset(f)
	case *http2.PriorityFrame:
		if f.StreamID == f.StreamDep {
			return streamError{f.StreamID, http2.ErrCodeProtocol}
		}
		return nil
	case *http2.GoAwayFrame:
		c.mu.Lock()
		c.clientGoAway = true
		c.mu.Unlock()
		c.goAwayGracefully()
		return nil
	case *http2.PushPromiseFrame:
		return connError{http2.ErrCodeProtocol, "PUSH_PROMISE from a client"}
	case *http2.ContinuationFrame, *http2.HeadersFrame:
		return connError{http2.ErrCodeProtocol, "header block out of order"} // the Framer assembles them
	default:
		return nil // unknown frame types are ignored (RFC 9113 section 4.1)
	}
}

func (c *conn) processSettings(f *http2.SettingsFrame) error {
	if f.IsAck() {
		return nil
	}
	if f.NumSettings() > 100 {
		return connError{http2.ErrCodeProtocol, "too many settings"}
	}
	var err error
	f.ForeachSetting(func(s http2.Setting) error {
		if err == nil {
			err = s.Valid()
		}
		return nil
	})
	if err != nil {
		var hc http2.ConnectionError
		if errors.As(err, &hc) {
			return connError{http2.ErrCode(hc), "invalid setting"}
		}
		return connError{http2.ErrCodeProtocol, "invalid setting"}
	}
	var tableSize *uint32
	var woken []*stream // woken once the ACK is queued: it goes before the DATA the new windows allow
	c.mu.Lock()
	f.ForeachSetting(func(s http2.Setting) error {
		switch s.ID {
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - c.initialWindow
			c.initialWindow = int64(s.Val)
			for _, st := range c.streams {
				st.sendWindow += delta
				if st.sendWindow > 1<<31-1 && err == nil {
					err = connError{http2.ErrCodeFlowControl, "SETTINGS_INITIAL_WINDOW_SIZE overflows a stream window"}
				}
				if delta > 0 {
					woken = append(woken, st)
				}
			}
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame = int(s.Val)
		case http2.SettingHeaderTableSize:
			v := s.Val
			tableSize = &v
		}
		return nil
	})
	c.mu.Unlock()
	if err != nil {
		return err
	}
	if tableSize != nil { // the encoder is the writer's: applied in order, before the ACK
		if err := c.queueControl(control{kind: kindTableSize, val: *tableSize}); err != nil {
			return err
		}
	}
	if err := c.queueControl(control{kind: http2.FrameSettings, ack: true}); err != nil {
		return err
	}
	for _, st := range woken {
		st.wake()
	}
	return nil
}

func (c *conn) processWindowUpdate(f *http2.WindowUpdateFrame) error {
	inc := int64(f.Increment)
	c.mu.Lock()
	defer c.mu.Unlock()
	if f.StreamID == 0 {
		if inc == 0 {
			return connError{http2.ErrCodeProtocol, "WINDOW_UPDATE of 0"}
		}
		prev := c.sendWindow
		c.sendWindow += inc
		if c.sendWindow > 1<<31-1 {
			return connError{http2.ErrCodeFlowControl, "connection window overflow"}
		}
		if prev <= 0 { // only then can a writer be waiting for it
			c.wakeConnQueue()
		}
		return nil
	}
	st := c.streams[f.StreamID]
	if st == nil {
		if f.StreamID > c.maxStreamID {
			return connError{http2.ErrCodeProtocol, "WINDOW_UPDATE on an idle stream"}
		}
		return nil // a closed stream's: ignored
	}
	if inc == 0 {
		return streamError{f.StreamID, http2.ErrCodeProtocol}
	}
	prev := st.sendWindow
	st.sendWindow += inc
	if st.sendWindow > 1<<31-1 {
		return streamError{f.StreamID, http2.ErrCodeFlowControl}
	}
	if prev <= 0 {
		st.wake()
	}
	return nil
}

func (c *conn) processReset(f *http2.RSTStreamFrame) error {
	c.mu.Lock()
	st := c.streams[f.StreamID]
	if st == nil {
		idle := f.StreamID > c.maxStreamID
		c.mu.Unlock()
		if idle {
			return connError{http2.ErrCodeProtocol, "RST_STREAM on an idle stream"}
		}
		return nil
	}
	c.mu.Unlock()
	st.closeStream(errStreamReset)
	return nil
}

// processData takes a DATA frame of a request body.
func (c *conn) processData(f *http2.DataFrame) error {
	id := f.StreamID
	data := f.Data()
	n := int64(f.Length) // padding counts against the windows
	if n > c.recvWindow.Load() {
		return connError{http2.ErrCodeFlowControl, "DATA past the connection window"}
	}
	c.recvWindow.Add(-n)
	c.mu.Lock()
	st := c.streams[id]
	if st == nil {
		idle := id > c.maxStreamID
		c.mu.Unlock()
		if idle {
			return connError{http2.ErrCodeProtocol, "DATA on an idle stream"}
		}
		c.returnConn(n)
		return streamError{id, http2.ErrCodeStreamClosed}
	}
	c.mu.Unlock()
	if st.remoteClosed() || st.body == nil {
		c.returnConn(n)
		return streamError{id, http2.ErrCodeStreamClosed}
	}
	if n > st.recvWindow.Load() {
		c.returnConn(n)
		return streamError{id, http2.ErrCodeFlowControl}
	}
	st.recvWindow.Add(-n)
	st.received += int64(len(data))
	if st.declared >= 0 && st.received > st.declared {
		c.returnConn(n)
		return streamError{id, http2.ErrCodeProtocol} // more than its content-length
	}
	if pad := n - int64(len(data)); pad > 0 {
		c.returnConn(pad)
		st.returnStream(pad)
	}
	if len(data) > 0 && !st.body.write(data) {
		// The handler is done with the body: what arrives is dropped and
		// its window given back.
		c.returnConn(int64(len(data)))
		st.returnStream(int64(len(data)))
	}
	if f.StreamEnded() {
		if st.declared >= 0 && st.received != st.declared {
			return streamError{id, http2.ErrCodeProtocol}
		}
		st.endRemote(nil)
	}
	return nil
}

// returnConn gives n octets of the connection's receive window back to
// the client, in batches.
func (c *conn) returnConn(n int64) {
	c.unackedMu.Lock()
	c.unacked += n
	send := c.unacked
	if send < int64(c.cfg.ConnWindow)/8 {
		c.unackedMu.Unlock()
		return
	}
	c.unacked = 0
	c.unackedMu.Unlock()
	c.recvWindow.Add(send) // before the client can learn of it
	c.queueControl(control{kind: http2.FrameWindowUpdate, val: uint32(send)})
}

// processHeaders opens a stream, or takes a request's trailers.
func (c *conn) processHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	if id%2 != 1 {
		return connError{http2.ErrCodeProtocol, "a client stream with an even id"}
	}
	if f.HasPriority() && f.Priority.StreamDep == id {
		return streamError{id, http2.ErrCodeProtocol}
	}
	c.mu.Lock()
	if st := c.streams[id]; st != nil {
		c.mu.Unlock()
		return st.trailers(f)
	}
	if id <= c.maxStreamID {
		c.mu.Unlock()
		return connError{http2.ErrCodeStreamClosed, "HEADERS on a closed stream"}
	}
	c.maxStreamID = id
	if c.goingAway || c.clientGoAway {
		c.mu.Unlock()
		return streamError{id, http2.ErrCodeRefusedStream}
	}
	if len(c.streams) >= int(c.cfg.MaxConcurrentStreams) {
		c.mu.Unlock()
		return streamError{id, http2.ErrCodeRefusedStream}
	}
	c.mu.Unlock()
	st := newStream(c, id)
	var req *http.Request
	if f.Truncated { // past MaxHeaderBytes: 431, from a handler of its own
		req = &http.Request{Method: "GET", URL: &url.URL{Path: "/"}, Header: http.Header{}, Body: http.NoBody}
		st.handler = refuseHeaders
	} else {
		var err error
		if req, err = c.newRequest(st, f); err != nil {
			st.cancel(err)
			return err
		}
	}
	c.mu.Lock()
	c.streams[id] = st
	c.idle.Stop()
	c.mu.Unlock()
	if f.StreamEnded() {
		st.endRemote(nil)
	}
	return c.startHandler(st, req)
}

// refuseHeaders answers a request whose header list is over the bound.
var refuseHeaders = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Length", "0")
	w.WriteHeader(http.StatusRequestHeaderFieldsTooLarge)
})

// startHandler runs st's handler, or queues it while MaxConcurrentStreams
// handlers run (a rapid reset leaves handlers running after their
// streams are gone).
func (c *conn) startHandler(st *stream, req *http.Request) error {
	c.mu.Lock()
	if c.running < int(c.cfg.MaxConcurrentStreams) {
		c.running++
		c.mu.Unlock()
		c.goHandler(st, req)
		return nil
	}
	if len(c.queued) >= handlerQueueFactor*int(c.cfg.MaxConcurrentStreams) {
		// A client resetting streams faster than their handlers end:
		// reading stops until handlers make room (TCP holds the client
		// back, its handlers stay within MAX_CONCURRENT_STREAMS), and
		// if none does within QueueWait the connection ends.
		c.mu.Unlock()
		if !c.awaitQueueRoom() {
			return connError{http2.ErrCodeEnhanceYourCalm, "too many handlers queued"}
		}
		c.mu.Lock()
	}
	st.req = req
	c.queued = append(c.queued, st)
	c.mu.Unlock()
	return nil
}

// awaitQueueRoom waits until the handler queue is below its bound.
func (c *conn) awaitQueueRoom() bool {
	t := time.NewTimer(c.cfg.QueueWait)
	defer t.Stop()
	for {
		c.mu.Lock()
		room := len(c.queued) < handlerQueueFactor*int(c.cfg.MaxConcurrentStreams)
		c.mu.Unlock()
		if room {
			return true
		}
		select {
		case <-c.queueRoom:
		case <-t.C:
			return false
		case <-c.done:
			return false
		}
	}
}

// handlerDone starts the next queued handler whose stream is still open.
func (c *conn) handlerDone() {
	var skipped []*stream
	defer func() {
		for _, st := range skipped { // what their bodies took of the windows goes back
			if st.body != nil {
				st.body.closeRead()
			}
			st.cancel(errHandlerDone)
		}
	}()
	c.mu.Lock()
	for len(c.queued) > 0 {
		st := c.queued[0]
		c.queued[0] = nil
		c.queued = c.queued[1:]
		if st.ctx.Err() != nil { // reset while it waited
			skipped = append(skipped, st)
			continue
		}
		req := st.req
		st.req = nil
		c.mu.Unlock()
		c.signalQueueRoom()
		c.goHandler(st, req)
		return
	}
	c.running--
	c.signalQueueRoom()
	c.checkIdle()
	c.mu.Unlock()
}

func (c *conn) signalQueueRoom() {
	select {
	case c.queueRoom <- struct{}{}:
	default:
	}
}

// checkIdle (under mu) arms the idle timer, or ends a connection going
// away, when nothing is under way.
func (c *conn) checkIdle() {
	if len(c.streams) > 0 || c.running > 0 || len(c.queued) > 0 {
		return
	}
	select {
	case <-c.done:
		return // closed: a handler that outlived it has nothing to arm
	default:
	}
	if c.goingAway || c.clientGoAway {
		go c.closeSoon()
		return
	}
	if c.idle != nil {
		c.idle.Reset(c.cfg.IdleTimeout)
	}
}

// forget removes a stream that is closed both ways.
func (c *conn) forget(st *stream) {
	c.mu.Lock()
	if c.streams[st.id] == st {
		delete(c.streams, st.id)
	}
	c.checkIdle()
	c.mu.Unlock()
}

// resetStream sends RST_STREAM and ends the stream here (the frame is
// queued first: the handler the reset wakes has nothing to add).
func (c *conn) resetStream(id uint32, code http2.ErrCode) error {
	err := c.queueControl(control{kind: http2.FrameRSTStream, stream: id, val: uint32(code)})
	c.mu.Lock()
	st := c.streams[id]
	c.mu.Unlock()
	if st != nil {
		st.closeStream(serverReset{code: code})
	}
	return err
}

// serverReset is the error of a stream this side reset (cause: why, when
// it was not a stream error of the client's: a write past its deadline).
type serverReset struct {
	code  http2.ErrCode
	cause error
}

func (e serverReset) Error() string {
	if e.cause != nil {
		return fmt.Sprintf("h2: stream reset by the server: %v: %v", e.code, e.cause)
	}
	return fmt.Sprintf("h2: stream reset by the server: %v", e.code)
}

func (e serverReset) Unwrap() error { return e.cause }

// wasReset reports whether a stream's error is a reset already (by either
// side) or the connection's end: no RST_STREAM is to follow it.
func wasReset(err error) bool {
	var sr serverReset
	return errors.Is(err, errStreamReset) || errors.Is(err, errConnClosed) || errors.As(err, &sr)
}

// goAwayGracefully sends GOAWAY(NO_ERROR): no new streams; the connection
// closes once those under way have ended.
func (c *conn) goAwayGracefully() {
	if !c.settingsSent.Load() { // before the preface's SETTINGS: no frame may go, the connection just ends
		c.closing.Store(true)
		c.tc.SetReadDeadline(time.Now())
		return
	}
	c.mu.Lock()
	if c.goingAway {
		c.mu.Unlock()
		return
	}
	c.goingAway = true
	last := c.maxStreamID
	c.mu.Unlock()
	c.queueControl(control{kind: http2.FrameGoAway, stream: last, val: uint32(http2.ErrCodeNo)})
	c.mu.Lock()
	c.checkIdle()
	c.mu.Unlock()
}

// closeSoon closes a connection that went away once its GOAWAY is out.
func (c *conn) closeSoon() {
	if c.closing.Swap(true) {
		return
	}
	c.flushShortly()
	c.tc.SetReadDeadline(time.Now()) // ends serve's read
}

// flushShortly writes what is queued (a GOAWAY), giving a client that
// does not read a second; it is on the wire when flushShortly returns (the
// caller may send FIN next).
func (c *conn) flushShortly() {
	deadline := time.Now().Add(goAwayLinger)
	if c.acquire(nil, deadline) != nil {
		return
	}
	if c.werr == nil {
		c.deadline = deadline
		c.tc.SetWriteDeadline(deadline)
	}
	c.releaseFlushed()
}

// goAwayError sends GOAWAY with an error code and stops reading: the
// connection closes after a short linger that lets the client read it.
func (c *conn) goAwayError(code http2.ErrCode) {
	c.mu.Lock()
	c.goingAway = true
	last := c.maxStreamID
	c.mu.Unlock()
	c.queueControl(control{kind: http2.FrameGoAway, stream: last, val: uint32(code)})
	c.flushShortly()
	c.finAndDrain()
}

// finAndDrain, once the GOAWAY is written, sends FIN after it and reads
// (and drops) a little of what the client still sends, for a short
// linger, so that closing with unread octets (a reset) does not destroy
// the GOAWAY in the client's receive buffer. A client's PING sent just
// after its own GOAWAY, arriving once the serve goroutine had stopped
// reading, was such an octet (h2spec 6.8 #1 saw a reset in about one run
// of fifteen).
func (c *conn) finAndDrain() {
	if tcp, ok := c.tc.NetConn().(interface{ CloseWrite() error }); ok {
		tcp.CloseWrite()
	}
	c.tc.NetConn().SetReadDeadline(time.Now().Add(goAwayLinger))
	io.CopyN(io.Discard, c.tc.NetConn(), goAwayReadAllowance)
}

// close ends the connection: every stream, the handlers' writes, the
// control writer.
func (c *conn) close() {
	c.cancel()
	close(c.done)
	c.mu.Lock()
	if c.idle != nil {
		c.idle.Stop()
	}
	streams := make([]*stream, 0, len(c.streams))
	for _, st := range c.streams {
		streams = append(streams, st)
	}
	c.queued = nil
	c.mu.Unlock()
	for _, st := range streams {
		st.closeStream(errConnClosed)
	}
	if c.settingsSent.Load() {
		<-c.ctrlAlive
	}
	// No close_notify: a client that stopped reading could hold it for
	// crypto/tls's 5 s; the GOAWAY (when there was one) went before.
	c.tc.NetConn().Close()
}

var (
	errConnClosed  = errors.New("h2: connection closed")
	errStreamReset = errors.New("h2: stream reset by the client")
)

package h2

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/textproto"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
)

// stream is one request and its response.
type stream struct {
	c       *conn
	id      uint32
	ctx     context.Context
	cancel  context.CancelCauseFunc
	req     *http.Request // while its handler is queued
	handler http.Handler  // nil: the connection's

	// Send side, under c.mu.
	sendWindow int64
	connQueued bool          // in c.connQueue
	wakeCh     chan struct{} // a window grew, or a deadline changed

	// Receive side: the window is taken by the serve goroutine and given
	// back by the body's reader.
	recvWindow atomic.Int64
	body       *pipe // nil: the request has no body
	declared   int64 // the request's content-length, -1 when none
	received   int64 // body octets received (serve goroutine)
	trailer    http.Header
	// expectContinue: the client waits for a 100 (Continue) before the
	// body, sent at the handler's first read of it.
	expectContinue bool
	continueOnce   sync.Once
	respStarted    atomic.Bool // the response's headers went (no 100 after them)

	mu         sync.Mutex
	remoteDone bool // the client ended its side (END_STREAM)
	localDone  bool // the response ended (END_STREAM) or the stream was reset
	resetErr   error
	wdl        time.Time // write deadline
	unacked    int64     // body octets read, their window not yet returned
}

func newStream(c *conn, id uint32) *stream {
	st := &stream{c: c, id: id, wakeCh: make(chan struct{}, 1), declared: -1}
	st.ctx, st.cancel = context.WithCancelCause(c.baseCtx)
	c.mu.Lock()
	st.sendWindow = c.initialWindow
	c.mu.Unlock()
	st.recvWindow.Store(int64(c.cfg.StreamWindow))
	return st
}

// wake (c.mu held, or not: it never blocks) wakes a writer waiting for
// window.
func (st *stream) wake() {
	select {
	case st.wakeCh <- struct{}{}:
	default:
	}
}

func (st *stream) err() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.resetErr != nil {
		return st.resetErr
	}
	if cause := context.Cause(st.ctx); cause != nil {
		return cause
	}
	return nil
}

func (st *stream) remoteClosed() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.remoteDone
}

func (st *stream) writeDeadline() time.Time {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.wdl
}

// endRemote: the client ended its side.
func (st *stream) endRemote(err error) {
	if st.body != nil {
		st.body.closeWithError(cmpErr(err, io.EOF))
	}
	st.mu.Lock()
	st.remoteDone = true
	both := st.localDone
	st.mu.Unlock()
	if both {
		st.c.forget(st)
	}
}

// endLocal: the response ended. A client still sending a body nobody
// reads is told to stop (RST_STREAM NO_ERROR, RFC 9113 section 8.1).
func (st *stream) endLocal() {
	st.mu.Lock()
	st.localDone = true
	both := st.remoteDone
	st.mu.Unlock()
	if both {
		st.c.forget(st)
		return
	}
	// The handler's context lasts until it returns (as net/http's): only
	// the body's reads end.
	st.end(errResponseEnded, false)
	st.c.queueControl(control{kind: http2.FrameRSTStream, stream: st.id, val: uint32(http2.ErrCodeNo)})
}

// closeStream ends the stream both ways with err (a reset by either side,
// the connection's end): its handler's context is cancelled, its body
// reads and response writes fail.
func (st *stream) closeStream(err error) { st.end(err, true) }

// end closes the stream both ways; cancel ends the handler's context too.
func (st *stream) end(err error, cancel bool) {
	st.mu.Lock()
	if st.resetErr == nil {
		st.resetErr = err
	}
	st.remoteDone, st.localDone = true, true
	st.mu.Unlock()
	if cancel {
		st.cancel(err)
	}
	if st.body != nil {
		st.body.closeWithError(err)
	}
	st.wake()
	st.c.forget(st)
}

// returnStream gives n octets of the stream's receive window back, in
// batches, while the client may still send.
func (st *stream) returnStream(n int64) {
	st.mu.Lock()
	st.unacked += n
	send := st.unacked
	if send < int64(st.c.cfg.StreamWindow)/8 || st.remoteDone {
		if st.remoteDone {
			st.unacked = 0
		}
		st.mu.Unlock()
		return
	}
	st.unacked = 0
	st.mu.Unlock()
	st.recvWindow.Add(send)
	st.c.queueControl(control{kind: http2.FrameWindowUpdate, stream: st.id, val: uint32(send)})
}

// consumed: the handler read n octets of the body.
func (st *stream) consumed(n int) {
	st.c.returnConn(int64(n))
	st.returnStream(int64(n))
}

// trailers takes a HEADERS frame on an open stream: the request's
// trailers, which must end it.
func (st *stream) trailers(f *http2.MetaHeadersFrame) error {
	if st.remoteClosed() {
		return streamError{st.id, http2.ErrCodeStreamClosed}
	}
	if !f.StreamEnded() || len(f.PseudoFields()) > 0 || f.Truncated {
		return streamError{st.id, http2.ErrCodeProtocol}
	}
	for _, hf := range f.RegularFields() {
		k := http.CanonicalHeaderKey(hf.Name)
		if _, declared := st.trailer[k]; declared {
			st.trailer[k] = append(st.trailer[k], hf.Value)
		}
	}
	if st.declared >= 0 && st.received != st.declared {
		return streamError{st.id, http2.ErrCodeProtocol}
	}
	st.endRemote(nil)
	return nil
}

// sendContinue answers Expect: 100-continue when the handler first reads
// the body, unless its response has begun.
func (st *stream) sendContinue() {
	if st.respStarted.Load() || st.err() != nil {
		return
	}
	c := st.c
	c.withWriteLock(st, func() error {
		if st.respStarted.Load() {
			return nil
		}
		return c.writeHeaderBlock(st.id, c.encodeHeaders(http.StatusContinue, nil), false)
	})
}

var (
	errResponseEnded = errors.New("h2: the response ended before the request body")
	errHandlerDone   = errors.New("h2: the handler returned")
)

func cmpErr(err, def error) error {
	if err != nil {
		return err
	}
	return def
}

// newRequest builds the http.Request of a stream's header block, or the
// stream error of a malformed one (RFC 9113 section 8.1.1).
func (c *conn) newRequest(st *stream, f *http2.MetaHeadersFrame) (*http.Request, error) {
	bad := streamError{st.id, http2.ErrCodeProtocol}
	method, path := f.PseudoValue("method"), f.PseudoValue("path")
	scheme, authority := f.PseudoValue("scheme"), f.PseudoValue("authority")
	isConnect := method == http.MethodConnect
	if isConnect {
		if scheme != "" || path != "" || authority == "" {
			return nil, bad
		}
	} else if method == "" || path == "" || (scheme != "https" && scheme != "http") {
		return nil, bad
	}
	if f.PseudoValue("protocol") != "" || strings.Contains(authority, "@") {
		return nil, bad // extended CONNECT is not offered; userinfo has no place in a request (RFC 9113 section 8.3.1)
	}
	fields := f.RegularFields()
	hdr := make(http.Header, len(fields))
	var cookies []string
	for _, hf := range fields {
		if connectionSpecific(hf.Name) || (hf.Name == "te" && hf.Value != "trailers") {
			return nil, bad
		}
		if hf.Name == "cookie" {
			cookies = append(cookies, hf.Value)
			continue
		}
		k := textproto.CanonicalMIMEHeaderKey(hf.Name)
		hdr[k] = append(hdr[k], hf.Value)
	}
	if len(cookies) > 0 {
		hdr["Cookie"] = []string{strings.Join(cookies, "; ")}
	}
	if vs := hdr["Content-Length"]; len(vs) > 0 {
		n, err := strconv.ParseUint(vs[0], 10, 63)
		for _, v := range vs[1:] {
			if v != vs[0] {
				err = strconv.ErrSyntax
			}
		}
		if err != nil {
			return nil, bad
		}
		st.declared = int64(n)
	}
	if f.StreamEnded() && st.declared > 0 {
		return nil, bad
	}
	var u *url.URL
	if isConnect {
		u = &url.URL{Host: authority}
		path = authority
	} else {
		var err error
		if u, err = url.ParseRequestURI(path); err != nil {
			return nil, bad
		}
	}
	if authority == "" {
		authority = hdr.Get("Host")
	}
	req := &http.Request{
		Method: method, URL: u, Proto: "HTTP/2.0", ProtoMajor: 2, Header: hdr, Host: authority,
		RemoteAddr: c.remote, RequestURI: path, TLS: c.state, ContentLength: st.declared,
	}
	if ts := hdr["Trailer"]; len(ts) > 0 {
		st.trailer = http.Header{}
		for _, v := range ts {
			for _, k := range strings.Split(v, ",") {
				switch k = textproto.CanonicalMIMEHeaderKey(textproto.TrimString(k)); k {
				case "", "Content-Length", "Transfer-Encoding", "Trailer":
				default:
					st.trailer[k] = nil
				}
			}
		}
		delete(hdr, "Trailer") // as net/http: the declaration is Request.Trailer's keys
		req.Trailer = st.trailer
	}
	if ex := hdr["Expect"]; len(ex) == 1 && strings.EqualFold(ex[0], "100-continue") && !f.StreamEnded() {
		st.expectContinue = true
	}
	if f.StreamEnded() {
		req.Body, req.ContentLength = http.NoBody, 0
	} else {
		st.body = newPipe(st)
		req.Body = st.body
	}
	return req.WithContext(st.ctx), nil
}

// runHandler serves one stream.
func (c *conn) runHandler(st *stream, req *http.Request) {
	w := &responseWriter{st: st, head: req.Method == http.MethodHead, declared: -1}
	returned := false
	defer func() {
		if v := recover(); v != nil || !returned { // a panic, or runtime.Goexit
			if v != nil && v != http.ErrAbortHandler {
				buf := make([]byte, 64<<10)
				buf = buf[:runtime.Stack(buf, false)]
				c.logf("http2: panic serving %v: %v\n%s", c.remote, v, buf)
			}
			if err := st.err(); err == nil || !wasReset(err) { // not a second RST_STREAM (a write past its deadline reset it)
				c.resetStream(st.id, http2.ErrCodeInternal)
			}
		}
		if st.body != nil {
			st.body.closeRead()
		}
		st.cancel(errHandlerDone) // the request's context ends with its handler
		c.handlerDone()
	}()
	h := c.handler
	if st.handler != nil {
		h = st.handler
	}
	defer w.release()
	h.ServeHTTP(w, req)
	returned = true
	w.finish()
}

// pipe is a request body: the DATA frames' octets, buffered up to the
// stream's window, read by the handler.
type pipe struct {
	st       *stream
	mu       sync.Mutex
	ready    chan struct{} // octets, or the end, arrived
	chunks   [][]byte
	off      int // read offset in chunks[0]
	n        int // octets buffered
	err      error
	done     bool // the handler closed the body: arrivals are dropped
	deadline time.Time
}

// Chunks come in four sizes, the first of a body no larger than what is
// known to come (its content-length, or its first frame), so that many
// streams with a few octets each do not pin 32 KiB apiece.
var chunkSizes = [...]int{1 << 10, 4 << 10, 16 << 10, 32 << 10}

var chunkPools [len(chunkSizes)]sync.Pool

func init() {
	for i, n := range chunkSizes {
		chunkPools[i].New = func() any { b := make([]byte, 0, n); return &b }
	}
}

// getChunk returns an empty chunk of the least size that holds want
// (the largest when none does).
func getChunk(want int) []byte {
	for i, n := range chunkSizes {
		if want <= n || i == len(chunkSizes)-1 {
			return (*chunkPools[i].Get().(*[]byte))[:0]
		}
	}
	panic("unreachable")
}

func putChunk(c []byte) {
	for i, n := range chunkSizes {
		if cap(c) == n {
			c = c[:0]
			chunkPools[i].Put(&c)
			return
		}
	}
}

func newPipe(st *stream) *pipe { return &pipe{st: st, ready: make(chan struct{}, 1)} }

// write buffers data; false when the handler no longer reads.
func (p *pipe) write(data []byte) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done || p.err != nil {
		return false
	}
	p.n += len(data)
	for len(data) > 0 {
		if k := len(p.chunks); k > 0 {
			last := p.chunks[k-1]
			if room := cap(last) - len(last); room > 0 {
				m := min(room, len(data))
				p.chunks[k-1] = append(last, data[:m]...)
				data = data[m:]
				continue
			}
		}
		want := len(data)
		if d := p.st.declared; d >= 0 {
			want = min(want, int(d))
		}
		if len(p.chunks) > 0 { // a body that goes on: the largest
			want = chunkSizes[len(chunkSizes)-1]
		}
		p.chunks = append(p.chunks, getChunk(want))
	}
	p.signal()
	return true
}

func (p *pipe) signal() {
	select {
	case p.ready <- struct{}{}:
	default:
	}
}

func (p *pipe) closeWithError(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.mu.Unlock()
	p.signal()
}

// closeRead: the handler is done with the body; what it left unread is
// given back to the windows.
func (p *pipe) closeRead() {
	p.mu.Lock()
	if p.done {
		p.mu.Unlock()
		return
	}
	p.done = true
	left := p.n
	p.n, p.off = 0, 0
	for _, c := range p.chunks {
		putChunk(c)
	}
	p.chunks = nil
	p.mu.Unlock()
	if left > 0 {
		p.st.consumed(left)
	}
}

func (p *pipe) Read(b []byte) (int, error) {
	if p.st.expectContinue {
		p.st.continueOnce.Do(p.st.sendContinue)
	}
	for {
		p.mu.Lock()
		if p.done {
			p.mu.Unlock()
			return 0, errBodyClosed
		}
		if p.n > 0 {
			n := 0
			for n < len(b) && n < p.n {
				c := p.chunks[0]
				k := copy(b[n:], c[p.off:])
				n += k
				p.off += k
				if p.off == len(c) && (len(p.chunks) > 1 || len(c) == cap(c)) { // a chunk still filling stays
					putChunk(c)
					p.chunks[0] = nil
					p.chunks = p.chunks[1:]
					p.off = 0
				}
			}
			p.n -= n
			p.mu.Unlock()
			p.st.consumed(n)
			return n, nil
		}
		if p.err != nil {
			err := p.err
			p.mu.Unlock()
			return 0, err
		}
		deadline := p.deadline
		p.mu.Unlock()
		var timeout <-chan time.Time
		if !deadline.IsZero() {
			t := time.NewTimer(time.Until(deadline))
			timeout = t.C
			defer t.Stop()
		}
		select {
		case <-p.ready:
		case <-timeout:
			return 0, errReadTimeout
		}
	}
}

func (p *pipe) Close() error {
	p.closeRead()
	return nil
}

func (p *pipe) setDeadline(t time.Time) {
	p.mu.Lock()
	p.deadline = t
	p.mu.Unlock()
	p.signal()
}

var (
	errBodyClosed   = errors.New("h2: read on a closed body")
	errReadTimeout  = timeoutError("h2: read deadline exceeded")
	errWriteTimeout = timeoutError("h2: write deadline exceeded")
)

// timeoutError is a net.Error whose Timeout is true (as os.ErrDeadlineExceeded).
type timeoutError string

func (e timeoutError) Error() string   { return string(e) }
func (e timeoutError) Timeout() bool   { return true }
func (e timeoutError) Temporary() bool { return true }

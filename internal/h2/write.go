package h2

import (
	"encoding/binary"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// The connection's writes. Whoever holds the write lock (wsem) writes its
// frames into bw, a buffer of one TLS record, and before it lets go it
// writes the control frames the serve goroutine queued and flushes. The
// serve goroutine never writes: it queues and wakes the control writer,
// so a client that stops reading cannot stop the connection from reading
// its RST_STREAM or GOAWAY.

// acquire takes the write lock, giving up at deadline (zero: none), when
// st's stream is cancelled, or when the connection ends. A stream's
// deadline moved meanwhile (SetWriteDeadline from another goroutine: a
// role cutting a response short) applies to the wait under way.
func (c *conn) acquire(st *stream, deadline time.Time) error {
	select {
	case c.wsem <- struct{}{}:
		return nil
	default:
	}
	var timer deadlineTimer
	defer timer.stop()
	var cancelled, moved <-chan struct{}
	if st != nil {
		cancelled, moved = st.ctx.Done(), st.wakeCh
	}
	c.waiting.Add(1)
	defer c.waiting.Add(-1)
	for {
		timeout := timer.at(deadline)
		select {
		case c.wsem <- struct{}{}:
			return nil
		case <-timeout:
			return errWriteTimeout
		case <-cancelled:
			return st.err()
		case <-moved: // the deadline moved, or a window grew (takeWindow looks at the windows afresh)
			deadline = st.writeDeadline()
		case <-c.done:
			return errConnClosed
		}
	}
}

// deadlineTimer is a wait's timer for a deadline that may move: one timer,
// made at the first wait that has a deadline and reset for the next.
type deadlineTimer struct{ t *time.Timer }

// at returns a channel that fires at d (nil, never, for the zero time).
func (dt *deadlineTimer) at(d time.Time) <-chan time.Time {
	if d.IsZero() {
		return nil
	}
	if dt.t == nil {
		dt.t = time.NewTimer(time.Until(d))
	} else {
		dt.t.Reset(time.Until(d))
	}
	return dt.t.C
}

func (dt *deadlineTimer) stop() {
	if dt.t != nil {
		dt.t.Stop()
	}
}

// release writes the queued control frames, flushes and lets go of the
// write lock; a control frame queued meanwhile is written by whoever
// takes the lock next, or by this call when nobody does. While another
// writer waits for the lock, what bw holds is left for it to complete
// and flush, so that the frames of several streams share TLS records and
// system calls; if no waiter takes the lock (it gave up), this call takes
// it back and flushes.
func (c *conn) release() { c.releaseWith(true) }

// releaseFlushed is release without the hand-off: when it returns, what
// bw held is written (or the connection has failed), whoever waits. A
// GOAWAY followed by the connection's FIN needs that: left to a waiter,
// it could go after the FIN, or never.
func (c *conn) releaseFlushed() { c.releaseWith(false) }

func (c *conn) releaseWith(mayHandOff bool) {
	ours := false // nobody took the lock after a hand-off: bw is this call's to flush
	for {
		c.writeControl()
		handOff := false
		if c.werr == nil && c.bw.Buffered() > 0 {
			if handOff = mayHandOff && !ours && c.waiting.Load() > 0; !handOff {
				if err := c.bw.Flush(); err != nil {
					c.fail(err)
				}
			}
		}
		<-c.wsem // a waiter blocked on wsem holds the lock from here
		c.ctrlMu.Lock()
		pending := len(c.ctrl) > 0
		c.ctrlMu.Unlock()
		if !pending && !handOff {
			return
		}
		select {
		case c.wsem <- struct{}{}:
			ours = true
		default:
			return // the holder writes and flushes them
		}
	}
}

// withWriteLock runs fn with the write lock (st's deadline and
// cancellation apply to the wait), then releases it. An error fn returns
// is the connection's (its TLS writes failed) unless it is streamGone.
func (c *conn) withWriteLock(st *stream, fn func() error) error {
	var deadline time.Time
	if st != nil {
		deadline = st.writeDeadline()
		if !deadline.IsZero() && !time.Now().Before(deadline) {
			return c.writeTimedOut(st) // not a write that would break the connection for all
		}
	}
	if err := c.acquire(st, deadline); err != nil {
		if err == errWriteTimeout {
			return c.writeTimedOut(st)
		}
		return err
	}
	defer c.release()
	if c.werr != nil {
		return c.werr
	}
	// The socket's deadline is the connection's, never the stream's: a
	// frame half written when one stream's deadline passes would break
	// the TLS connection, and every stream on it. A stream's deadline
	// bounds its waits (for the lock, for window), as net/http's does.
	c.setWriteDeadline(time.Time{})
	c.writeControl() // what the serve goroutine queued goes first (a SETTINGS ACK before the DATA it allowed)
	if err := fn(); err != nil {
		var gone streamGone
		if errors.As(err, &gone) {
			return gone.err // the stream's end, not the connection's
		}
		c.fail(err)
		return err
	}
	return nil
}

// writeTimedOut resets st (CANCEL) whose write deadline passed while it
// waited (for window, for the write lock): nothing of its frame was
// written, so the connection serves on; the client learns the response
// will not come, and the handler's context ends, so that a handler that
// ignores its write's error stops as well. The write returns
// errWriteTimeout (a net.Error whose Timeout is true).
func (c *conn) writeTimedOut(st *stream) error {
	st.mu.Lock()
	ended := st.resetErr != nil
	st.mu.Unlock()
	if !ended {
		c.queueControl(control{kind: http2.FrameRSTStream, stream: st.id, val: uint32(http2.ErrCodeCancel)})
		st.closeStream(serverReset{code: http2.ErrCodeCancel, cause: errWriteTimeout})
	}
	return errWriteTimeout
}

// streamGone is what a write function returns for a stream that was
// reset or closed before its frame went: nothing was written, and the
// connection is fine.
type streamGone struct{ err error }

func (e streamGone) Error() string { return e.err.Error() }
func (e streamGone) Unwrap() error { return e.err }

// writeNow writes frames at once (the connection's first SETTINGS).
func (c *conn) writeNow(fn func() error) error { return c.withWriteLock(nil, fn) }

// setWriteDeadline (write lock held) sets the TLS connection's write
// deadline for the writes to come: d, or WriteTimeout from now.
func (c *conn) setWriteDeadline(d time.Time) {
	if d.IsZero() {
		now := time.Now()
		if c.deadline.Sub(now) >= c.cfg.WriteTimeout/2 {
			return // still far enough: not a timer reset per frame
		}
		d = now.Add(c.cfg.WriteTimeout)
	}
	if !d.Equal(c.deadline) {
		c.deadline = d
		c.tc.SetWriteDeadline(d)
	}
}

// fail (write lock held) records a write error: a TLS connection whose
// write failed is broken, so the connection ends.
func (c *conn) fail(err error) {
	if c.werr == nil {
		c.werr = err
		c.tc.NetConn().Close() // ends serve's read
	}
}

// queueControl queues a control frame for the control writer.
func (c *conn) queueControl(f control) error {
	c.ctrlMu.Lock()
	if len(c.ctrl) >= maxQueuedControl {
		c.ctrlMu.Unlock()
		return connError{http2.ErrCodeEnhanceYourCalm, "too many control frames queued for a client that does not read"}
	}
	c.ctrl = append(c.ctrl, f)
	c.ctrlMu.Unlock()
	select {
	case c.ctrlKick <- struct{}{}:
	default:
	}
	return nil
}

// controlWriter writes queued control frames when no handler is writing.
func (c *conn) controlWriter() {
	defer close(c.ctrlAlive)
	for {
		select {
		case <-c.ctrlKick:
		case <-c.done:
			return
		}
		if c.acquire(nil, time.Time{}) != nil {
			return
		}
		c.setWriteDeadline(time.Time{})
		c.release()
	}
}

// writeControl (write lock held) writes the queued control frames into bw.
func (c *conn) writeControl() {
	c.ctrlMu.Lock()
	q := c.ctrl
	c.ctrl = nil
	c.ctrlMu.Unlock()
	if len(q) == 0 || c.werr != nil {
		return
	}
	for _, f := range q {
		var err error
		switch f.kind {
		case http2.FrameSettings:
			err = c.fr.WriteSettingsAck()
		case http2.FramePing:
			err = c.fr.WritePing(true, f.data)
		case http2.FrameWindowUpdate:
			err = c.fr.WriteWindowUpdate(f.stream, f.val)
		case http2.FrameRSTStream:
			err = c.fr.WriteRSTStream(f.stream, http2.ErrCode(f.val))
		case http2.FrameGoAway:
			err = c.fr.WriteGoAway(f.stream, http2.ErrCode(f.val), nil)
		case kindTableSize:
			c.henc.SetMaxDynamicTableSizeLimit(f.val)
		}
		if err != nil {
			c.fail(err)
			return
		}
	}
}

// writeData (write lock held) writes one DATA frame of a's octets, then
// b's: its header and the first octets fill bw (one TLS record), whole
// records of the rest of b go to the TLS connection from b itself, and
// what is left is copied into bw, where the next frame (or the flush at
// release) completes its record.
func (c *conn) writeData(id uint32, a, b []byte, end bool) error {
	var h [9]byte
	n := len(a) + len(b)
	h[0], h[1], h[2] = byte(n>>16), byte(n>>8), byte(n)
	h[3] = byte(http2.FrameData)
	if end {
		h[4] = byte(http2.FlagDataEndStream)
	}
	binary.BigEndian.PutUint32(h[5:], id)
	c.bw.Write(h[:]) // bufio's error is sticky: the next Write returns it
	if _, err := c.bw.Write(a); err != nil {
		return err
	}
	p := b
	if len(p) <= c.bw.Available() {
		_, err := c.bw.Write(p)
		return err
	}
	k := c.bw.Available()
	c.bw.Write(p[:k])
	if err := c.bw.Flush(); err != nil {
		return err
	}
	p = p[k:]
	if whole := len(p) / recordPayload * recordPayload; whole > 0 {
		if _, err := c.out.Write(p[:whole]); err != nil {
			return err
		}
		p = p[whole:]
	}
	_, err := c.bw.Write(p)
	return err
}

// FrameSize is the payload of the next DATA frame of a body with want
// octets left, allowed allowed: a frame that does not end the body is cut
// so that its header and payload fill whole TLS records. (Exported for
// the holder's benchmark floor, which cuts its frames the same way.)
func FrameSize(want, allowed int) int {
	if allowed >= want {
		return want
	}
	if aligned := (allowed+9)/recordPayload*recordPayload - 9; aligned > 0 {
		return aligned
	}
	return allowed
}

// headerBuffer is the HPACK encoder's output.
type headerBuffer struct{ b []byte }

func (h *headerBuffer) Write(p []byte) (int, error) { h.b = append(h.b, p...); return len(p), nil }

// encodeHeaders (write lock held: the encoder's table follows the
// order of the frames) encodes a response's header block.
func (c *conn) encodeHeaders(status int, hdr http.Header) []byte {
	c.hbuf.b = c.hbuf.b[:0]
	c.henc.WriteField(hpack.HeaderField{Name: ":status", Value: statusText(status)})
	for k, vs := range hdr {
		name, ok := lowerHeader(k)
		if !ok || connectionSpecific(name) {
			continue
		}
		sensitive := name == "set-cookie" || name == "authorization"
		for _, v := range vs {
			if !validValue(v) {
				continue // as net/http: never a header that would split the block
			}
			c.henc.WriteField(hpack.HeaderField{Name: name, Value: v, Sensitive: sensitive})
		}
	}
	return c.hbuf.b
}

// writeHeaderBlock (write lock held) writes HEADERS and, past the
// client's frame size, CONTINUATION frames.
func (c *conn) writeHeaderBlock(id uint32, block []byte, end bool) error {
	c.mu.Lock()
	maxFrame := c.peerMaxFrame
	c.mu.Unlock()
	first := block
	if len(first) > maxFrame {
		first = first[:maxFrame]
	}
	block = block[len(first):]
	if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first, EndStream: end, EndHeaders: len(block) == 0}); err != nil {
		return err
	}
	for len(block) > 0 {
		frag := block
		if len(frag) > maxFrame {
			frag = frag[:maxFrame]
		}
		block = block[len(frag):]
		if err := c.fr.WriteContinuation(id, len(block) == 0, frag); err != nil {
			return err
		}
	}
	return nil
}

var statusTexts sync.Map // int -> string

func statusText(code int) string {
	if v, ok := statusTexts.Load(code); ok {
		return v.(string)
	}
	s := strconv.Itoa(code)
	statusTexts.Store(code, s)
	return s
}

// lowerHeader is the wire form of a header name (lower case), false for
// a name that is not a token.
func lowerHeader(k string) (string, bool) {
	if v, ok := commonLower[k]; ok {
		return v, true
	}
	for i := 0; i < len(k); i++ {
		if !tokenChar(k[i]) {
			return "", false
		}
	}
	return strings.ToLower(k), true
}

var commonLower = func() map[string]string {
	m := map[string]string{}
	for _, k := range []string{"Content-Type", "Content-Length", "Cache-Control", "Repr-Digest", "Location", "Retry-After",
		"Allow", "Alt-Svc", "X-Content-Type-Options", "Date", "Etag", "Last-Modified", "Vary", "Www-Authenticate"} {
		m[k] = strings.ToLower(k)
	}
	return m
}()

func tokenChar(b byte) bool {
	return b < 127 && b > ' ' && !strings.ContainsRune("\"(),/:;<=>?@[\\]{}", rune(b))
}

func validValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if b := v[i]; (b < ' ' && b != '\t') || b == 0x7f {
			return false
		}
	}
	return true
}

// connectionSpecific headers have no place in HTTP/2 (RFC 9113 section
// 8.2.2).
func connectionSpecific(name string) bool {
	switch name {
	case "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade":
		return true
	}
	return false
}

package h2

import (
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
)

// responseWriter is a stream's http.ResponseWriter. Its headers go out
// with the first octets of the body (or at the end, with END_STREAM when
// there is none). A write of fewer than heldMax octets that does not end
// the body is held, as net/http holds it, and goes out with the next
// write, a Flush or the handler's return (a container's header with its
// sections, a handler's pieces of JSON: one frame, not one each); the
// others go to the connection before they return, in frames as large as
// the windows and the client's frame size allow, the last one ending the
// stream when the declared Content-Length is reached. (A frame's last
// octets short of a TLS record may wait in the connection's buffer for a
// writer already waiting for the lock, which flushes them with its own;
// see release.)
type responseWriter struct {
	st       *stream
	head     bool // a HEAD request: no body goes out
	header   http.Header
	snapshot http.Header // the headers as of WriteHeader
	status   int
	sent     bool  // the header block went out
	ended    bool  // END_STREAM went out
	declared int64 // the response's Content-Length, -1 when none
	written  int64 // octets of the body the handler wrote (held ones too)
	held     *[]byte
}

// heldMax bounds the octets a response holds back.
const heldMax = 4 << 10

// heldPool recycles the held buffers: all of one capacity, never grown,
// so a sync.Pool of them does what bytebufferpool's size calibration
// would have nothing to calibrate.
var heldPool = sync.Pool{New: func() any { b := make([]byte, 0, heldMax); return &b }}

// release returns the held buffer (the handler has returned).
func (w *responseWriter) release() {
	if w.held != nil {
		*w.held = (*w.held)[:0]
		heldPool.Put(w.held)
		w.held = nil
	}
}

func (w *responseWriter) heldLen() int {
	if w.held == nil {
		return 0
	}
	return len(*w.held)
}

func (w *responseWriter) Header() http.Header {
	if w.header == nil {
		w.header = http.Header{}
	}
	return w.header
}

func (w *responseWriter) WriteHeader(code int) {
	if w.status != 0 {
		return
	}
	if code < 100 || code > 999 {
		panic("h2: invalid WriteHeader code " + strconv.Itoa(code))
	}
	if code >= 100 && code <= 199 && code != http.StatusSwitchingProtocols {
		w.informational(code)
		return
	}
	w.status = code
	w.snapshot = w.Header().Clone()
	if _, ok := w.snapshot["Date"]; !ok {
		w.snapshot["Date"] = []string{httpDate()}
	}
	if vs, ok := w.snapshot["Content-Length"]; ok {
		n, err := strconv.ParseInt(vs[0], 10, 64)
		if len(vs) == 1 && err == nil && n >= 0 {
			w.declared = n
		} else {
			delete(w.snapshot, "Content-Length") // as net/http: never a length that is not one
		}
	}
	if !bodyAllowed(code) {
		w.declared = 0
	}
}

// informational sends a 1xx response's headers at once.
func (w *responseWriter) informational(code int) {
	c := w.st.c
	c.withWriteLock(w.st, func() error {
		return c.writeHeaderBlock(w.st.id, c.encodeHeaders(code, w.Header()), false)
	})
}

func bodyAllowed(code int) bool {
	return code != http.StatusNoContent && code != http.StatusNotModified && (code < 100 || code > 199)
}

func (w *responseWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.sent && len(p) > 0 && bodyAllowed(w.status) {
		// As net/http: a body without a Content-Type (or encoding) gets
		// the one its first octets suggest.
		if _, ok := w.snapshot["Content-Type"]; !ok && w.snapshot.Get("Content-Encoding") == "" {
			w.snapshot["Content-Type"] = []string{http.DetectContentType(p)}
		}
	}
	if !bodyAllowed(w.status) {
		return 0, http.ErrBodyNotAllowed
	}
	if w.declared >= 0 && w.written+int64(len(p)) > w.declared {
		return 0, http.ErrContentLength
	}
	if w.head {
		w.written += int64(len(p))
		return len(p), nil
	}
	if len(p) == 0 {
		return 0, nil
	}
	w.written += int64(len(p))
	if w.heldLen()+len(p) < heldMax && (w.declared < 0 || w.written < w.declared) {
		if w.held == nil {
			w.held = heldPool.Get().(*[]byte)
		}
		*w.held = append(*w.held, p...)
		return len(p), nil
	}
	n, err := w.send(p, false)
	if err != nil {
		w.written -= int64(len(p) - n)
	}
	return n, err
}

// send writes what the response holds, then p, in frames as the windows
// allow; with final, the last frame ends the stream. It returns the
// octets of p sent.
func (w *responseWriter) send(p []byte, final bool) (int, error) {
	var pre []byte
	if w.held != nil {
		pre = *w.held
		*w.held = pre[:0]
	}
	st, c := w.st, w.st.c
	total := len(pre) + len(p)
	done := 0
	for done < total {
		k, err := c.takeWindow(st, total-done, w.headersFirst)
		if err != nil {
			return max(done-len(pre), 0), err
		}
		sent := w.written - int64(total-done) // octets of the body in frames before this one
		end := (w.declared >= 0 && sent+int64(k) == w.declared) || (final && done+k == total)
		var a, b []byte
		if done < len(pre) {
			a = pre[done:min(len(pre), done+k)]
		}
		if done+k > len(pre) {
			b = p[max(done-len(pre), 0) : done+k-len(pre)]
		}
		wrote := false
		err = c.withWriteLock(st, func() error {
			if err := st.err(); err != nil {
				return streamGone{err} // reset while it waited for the lock
			}
			if err := w.sendHeaders(false); err != nil {
				return err
			}
			wrote = true
			if end {
				w.end() // before END_STREAM can reach the client
			}
			return c.writeData(st.id, a, b, end)
		})
		if err != nil {
			if !wrote {
				c.giveBack(st, k)
			}
			return max(done-len(pre), 0), err
		}
		done += k
	}
	return len(p), nil
}

// headersFirst sends the header block alone when the body must wait for
// window: the client learns the status without it.
func (w *responseWriter) headersFirst() {
	if !w.sent {
		w.st.c.withWriteLock(w.st, func() error { return w.sendHeaders(false) })
	}
}

// sendHeaders (write lock held) writes the header block once.
func (w *responseWriter) sendHeaders(end bool) error {
	if w.sent {
		return nil
	}
	w.st.respStarted.Store(true)
	if err := w.st.err(); err != nil && !w.ended {
		return streamGone{err}
	}
	c := w.st.c
	w.sent = true
	return c.writeHeaderBlock(w.st.id, c.encodeHeaders(w.status, w.snapshot), end)
}

// finish ends the response when the handler returns: the headers with
// END_STREAM when nothing was sent, or an empty DATA frame ending it. A
// response that cannot be ended (a write past its deadline) is reset
// (CANCEL), so the client does not wait for the rest.
func (w *responseWriter) finish() {
	if w.ended {
		return
	}
	if err := w.st.err(); err != nil {
		if !wasReset(err) {
			w.st.c.resetStream(w.st.id, http2.ErrCodeCancel)
		}
		return
	}
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	c, st := w.st.c, w.st
	var err error
	if w.heldLen() > 0 {
		_, err = w.send(nil, true)
	} else {
		err = c.withWriteLock(st, func() error {
			if err := st.err(); err != nil {
				return streamGone{err}
			}
			w.end()
			if !w.sent {
				return w.sendHeaders(true)
			}
			return c.writeData(st.id, nil, nil, true)
		})
	}
	if err != nil && !w.ended {
		c.resetStream(st.id, http2.ErrCodeCancel)
	}
}

// end (write lock held) records the response's end before its last
// frame is written: a client that has read END_STREAM finds the stream
// closed here (a HEADERS on it is STREAM_CLOSED for the connection).
func (w *responseWriter) end() {
	w.ended = true
	w.st.endLocal()
}

// Flush sends what the response holds, or its headers if they have not
// gone.
func (w *responseWriter) Flush() { w.FlushError() }

func (w *responseWriter) FlushError() error {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.heldLen() > 0 {
		_, err := w.send(nil, false)
		return err
	}
	if w.sent {
		return nil
	}
	return w.st.c.withWriteLock(w.st, func() error { return w.sendHeaders(false) })
}

// SetWriteDeadline bounds the response's writes (http.ResponseController).
func (w *responseWriter) SetWriteDeadline(t time.Time) error {
	w.st.mu.Lock()
	w.st.wdl = t
	w.st.mu.Unlock()
	w.st.wake()
	return nil
}

// SetReadDeadline bounds the request body's reads.
func (w *responseWriter) SetReadDeadline(t time.Time) error {
	if w.st.body != nil {
		w.st.body.setDeadline(t)
	}
	return nil
}

// EnableFullDuplex: HTTP/2 is.
func (w *responseWriter) EnableFullDuplex() error { return nil }

// takeWindow waits until the windows let at least one octet of want go
// on st, takes what the next frame carries and returns its size: all the
// windows allow when they are what limits it (no sliver is left for
// another frame), else as FrameSize cuts it. Writers waiting for the
// connection's window queue for it: a WINDOW_UPDATE wakes the first, and
// each leaves what it does not take to the next (rather than every
// waiter woken to find that one took it).
func (c *conn) takeWindow(st *stream, want int, beforeWait func()) (n int, err error) {
	var timer deadlineTimer
	defer func() {
		timer.stop()
		if err != nil {
			c.mu.Lock()
			c.leaveConnQueue(st)
			c.mu.Unlock()
		}
	}()
	for {
		if err := st.err(); err != nil {
			return 0, err
		}
		c.mu.Lock()
		if window := min(c.sendWindow, st.sendWindow); window > 0 {
			if window < int64(want) && window <= int64(c.peerMaxFrame) {
				n = int(window)
			} else {
				n = FrameSize(want, int(min(window, int64(c.peerMaxFrame))))
			}
			c.sendWindow -= int64(n)
			st.sendWindow -= int64(n)
			c.leaveConnQueue(st)
			c.mu.Unlock()
			return n, nil
		}
		if c.sendWindow <= 0 {
			c.joinConnQueue(st)
		} else {
			c.leaveConnQueue(st) // the stream's window is what it lacks: the connection's goes to the next
		}
		c.mu.Unlock()
		if beforeWait != nil {
			beforeWait()
			beforeWait = nil
			continue // the wait starts after it, on a fresh look at the windows
		}
		timeout := timer.at(st.writeDeadline())
		select {
		case <-st.wakeCh:
		case <-timeout:
			return 0, c.writeTimedOut(st)
		case <-st.ctx.Done():
		case <-c.done:
			return 0, errConnClosed
		}
	}
}

// joinConnQueue (c.mu held) queues st for the connection's window.
func (c *conn) joinConnQueue(st *stream) {
	if !st.connQueued {
		st.connQueued = true
		c.connQueue = append(c.connQueue, st)
	}
}

// leaveConnQueue (c.mu held): st no longer waits for the connection's
// window; what is left of it goes to the next writer queued.
func (c *conn) leaveConnQueue(st *stream) {
	if st.connQueued {
		st.connQueued = false
		if i := slices.Index(c.connQueue, st); i >= 0 {
			c.connQueue = slices.Delete(c.connQueue, i, i+1)
		}
	}
	if c.sendWindow > 0 {
		c.wakeConnQueue()
	}
}

// wakeConnQueue (c.mu held) wakes the first writer queued for the
// connection's window; it leaves the queue.
func (c *conn) wakeConnQueue() {
	if len(c.connQueue) == 0 {
		return
	}
	st := c.connQueue[0]
	st.connQueued = false
	c.connQueue = slices.Delete(c.connQueue, 0, 1)
	st.wake()
}

// giveBack returns window taken for a frame that did not go.
func (c *conn) giveBack(st *stream, n int) {
	c.mu.Lock()
	c.sendWindow += int64(n)
	st.sendWindow += int64(n)
	if c.sendWindow > 0 {
		c.wakeConnQueue()
	}
	c.mu.Unlock()
}

// httpDate is the Date header, formatted once a second.
func httpDate() string {
	now := time.Now().Unix()
	if d := cachedDate.Load(); d != nil && d.at == now {
		return d.s
	}
	d := &dateString{at: now, s: time.Unix(now, 0).UTC().Format(http.TimeFormat)}
	cachedDate.Store(d)
	return d.s
}

type dateString struct {
	at int64
	s  string
}

var cachedDate atomic.Pointer[dateString]

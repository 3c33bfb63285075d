package instance

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"

	"github.com/kvsp/kvsp"
)

// maxQueuedTokens bounds the octets of token lines a generation queues
// for a front end that does not read them as fast as the engine makes
// them: past it, the client has stopped reading and the session is
// cancelled (its sequence and pins freed), as when the server's write
// deadline cuts its stream.
const maxQueuedTokens = 1 << 20

// errNotReading ends a generation whose front end stopped reading.
var errNotReading = errors.New("instance: the front end is not reading its token stream")

// tokenWriter sends a generation's token lines to its front end from a
// goroutine of its own, so that the engine never waits for a client: a
// client that grants no window (RELIABILITY B11, red team D1) no longer
// holds a batch slot, and the agent counts a request as running only
// while the engine works on it, not while its last lines wait for the
// client. Lines are written as they come, all queued ones in one write
// and one flush.
type tokenWriter struct {
	w      http.ResponseWriter
	rc     *http.ResponseController
	cancel context.CancelCauseFunc // the generation's: a failed write ends it

	mu     sync.Mutex
	buf    []byte // queued lines
	spare  []byte
	closed bool
	err    error // the first write's failure, or errNotReading
	wake   chan struct{}
	done   chan struct{}
}

func newTokenWriter(w http.ResponseWriter, cancel context.CancelCauseFunc) *tokenWriter {
	t := &tokenWriter{w: w, rc: http.NewResponseController(w), cancel: cancel, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go t.run()
	return t
}

// line queues one token line; it fails once the stream has.
func (t *tokenWriter) line(tok kvsp.GeneratedToken) error {
	b, err := kvsp.Marshal(&tok)
	if err != nil {
		return err
	}
	t.mu.Lock()
	if t.err != nil {
		err := t.err
		t.mu.Unlock()
		return err
	}
	if len(t.buf)+len(b)+1 > maxQueuedTokens {
		t.err = fmt.Errorf("%w: %d octets of tokens unread", errNotReading, len(t.buf))
		err := t.err
		t.mu.Unlock()
		t.cancel(err)
		return err
	}
	t.buf = append(append(t.buf, b...), '\n')
	t.mu.Unlock()
	select {
	case t.wake <- struct{}{}:
	default:
	}
	return nil
}

// failed returns the stream's failure so far.
func (t *tokenWriter) failed() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

// close lets the writer finish what is queued and waits for it; it
// returns the stream's failure, if any.
func (t *tokenWriter) close() error {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	select {
	case t.wake <- struct{}{}:
	default:
	}
	<-t.done
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

func (t *tokenWriter) run() {
	defer close(t.done)
	for range t.wake {
		for {
			t.mu.Lock()
			out, closed := t.buf, t.closed
			t.buf, t.spare = t.spare[:0], nil
			t.mu.Unlock()
			if len(out) == 0 {
				if closed {
					return
				}
				break
			}
			_, err := t.w.Write(out)
			if err == nil {
				err = t.rc.Flush() // the lines leave at once
			}
			if err != nil {
				t.mu.Lock()
				if t.err == nil {
					t.err = err
				}
				t.mu.Unlock()
				t.cancel(err)
				return
			}
			t.mu.Lock()
			t.spare = out
			t.mu.Unlock()
		}
	}
}

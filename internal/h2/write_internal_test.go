package h2

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"golang.org/x/net/http2"
)

// writeCounter counts the writes that reach it (the TLS connection's,
// one record and system call each).
type writeCounter struct {
	writes int
	data   []byte
}

func (w *writeCounter) Write(p []byte) (int, error) {
	w.writes++
	w.data = append(w.data, p...)
	return len(p), nil
}

func lockOnly(out *writeCounter) *conn {
	return &conn{wsem: make(chan struct{}, 1), out: out, bw: bufio.NewWriterSize(out, recordPayload), done: make(chan struct{})}
}

// TestReleaseHandsBufferToWaiter: a writer that lets go of the lock while
// another waits for it leaves what bw holds to that waiter, which
// completes it and flushes once: two streams' frames, one write.
func TestReleaseHandsBufferToWaiter(t *testing.T) { synctest.Test(t, testReleaseHandsBufferToWaiter) }

func testReleaseHandsBufferToWaiter(t *testing.T) {
	var out writeCounter
	c := lockOnly(&out)
	if err := c.acquire(nil, time.Time{}); err != nil {
		t.Fatal(err)
	}
	c.bw.WriteString("a")
	got := make(chan error)
	go func() { got <- c.acquire(nil, time.Time{}) }()
	synctest.Wait() // the second writer waits for the lock
	c.release()
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if out.writes != 0 || c.bw.Buffered() != 1 {
		t.Fatalf("released to a waiter: %d writes, %d octets left in bw; want 0 and 1", out.writes, c.bw.Buffered())
	}
	c.bw.WriteString("b")
	c.release()
	if out.writes != 1 || string(out.data) != "ab" {
		t.Fatalf("%d writes of %q, want one of \"ab\"", out.writes, out.data)
	}
}

// TestReleaseFlushesWhenNoWaiterTakes: a waiter counted but gone (it gave
// up at its deadline) does not strand what bw holds: release takes the
// lock back and flushes, and the lock ends free.
func TestReleaseFlushesWhenNoWaiterTakes(t *testing.T) {
	var out writeCounter
	c := lockOnly(&out)
	if err := c.acquire(nil, time.Time{}); err != nil {
		t.Fatal(err)
	}
	c.bw.WriteString("a")
	c.waiting.Add(1) // a waiter between its count and its wait, or one that gave up
	c.release()
	if out.writes != 1 || string(out.data) != "a" {
		t.Fatalf("%d writes of %q, want one of \"a\"", out.writes, out.data)
	}
	select {
	case c.wsem <- struct{}{}:
	default:
		t.Fatal("the lock is still held")
	}
}

// TestDataTailWaitsInBuffer: a DATA frame that starts in a part-filled
// buffer fills it (one record), goes out in whole records from the
// handler's memory, and leaves its tail in bw for the next frame to
// complete, rather than as a record of its own.
func TestDataTailWaitsInBuffer(t *testing.T) {
	var out writeCounter
	c := lockOnly(&out)
	c.bw.Write(make([]byte, 100)) // another stream's frame
	p := make([]byte, 40000)
	if err := c.writeData(1, nil, p, false); err != nil {
		t.Fatal(err)
	}
	tail := 100 + 9 + len(p) - 2*recordPayload
	if out.writes != 2 || len(out.data) != 2*recordPayload || c.bw.Buffered() != tail {
		t.Fatalf("%d writes of %d octets, %d left in bw; want 2 writes of %d, %d left", out.writes, len(out.data), c.bw.Buffered(), 2*recordPayload, tail)
	}
}

// TestConnWindowQueue (RFC 9113 section 6.9.1): writers waiting for the
// connection's window take it first come first, each grant whole (no
// sliver cut off for another frame), and a writer that gives up as the
// window opens leaves it to the next rather than stranding it.
func TestConnWindowQueue(t *testing.T) { synctest.Test(t, testConnWindowQueue) }

func testConnWindowQueue(t *testing.T) {
	c := &conn{done: make(chan struct{}), baseCtx: context.Background(), initialWindow: 1 << 20, peerMaxFrame: 1 << 20}
	type took struct{ i, n int }
	got := make(chan took, 4)
	var streams []*stream
	for i := range 4 {
		st := newStream(c, uint32(2*i+1))
		streams = append(streams, st)
		go func() {
			n, err := c.takeWindow(st, 1<<20, nil)
			if err != nil {
				n = -1
			}
			got <- took{i, n}
		}()
		synctest.Wait() // queued in this order
	}
	grant := func(n uint32) {
		if err := c.processWindowUpdate(&http2.WindowUpdateFrame{Increment: n}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
	}
	expect := func(want ...took) {
		t.Helper()
		for _, w := range want {
			select {
			case g := <-got:
				if g != w {
					t.Fatalf("writer %d took %d, want writer %d taking %d", g.i, g.n, w.i, w.n)
				}
			default:
				t.Fatalf("no writer took window, want writer %d taking %d", w.i, w.n)
			}
		}
		if len(got) > 0 {
			t.Fatalf("another writer went: %v", <-got)
		}
	}

	grant(32768)
	expect(took{0, 32768})

	streams[1].cancel(errors.New("reset by the client"))
	grant(1000)
	expect(took{1, -1}, took{2, 1000})

	close(c.done)
	synctest.Wait()
	expect(took{3, -1})
}

// TestFlushShortlyFlushesPastAWaiter: the GOAWAY flushShortly writes is
// on the wire when it returns, even while another writer waits for the
// lock (the control writer, woken by the GOAWAY's queueing): goAwayError
// sends FIN next, and a GOAWAY left in bw for the waiter went after the
// FIN or not at all (h2spec 6.9.1 #2 then saw the connection closed, not
// its GOAWAY, in about one run of seven).
func TestFlushShortlyFlushesPastAWaiter(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var out writeCounter
		c := lockOnly(&out)
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		c.tc = tls.Client(a, &tls.Config{}) // for its write deadline; the frames go to out
		if err := c.acquire(nil, time.Time{}); err != nil {
			t.Fatal(err)
		}
		c.bw.WriteString("goaway")
		flushed := make(chan string)
		go func() { // the lock's first waiter: goAwayError's flush
			c.flushShortly()
			flushed <- string(out.data)
		}()
		synctest.Wait()
		waiter := make(chan error)
		go func() { waiter <- c.acquire(nil, time.Time{}) }() // the second: the control writer
		synctest.Wait()
		c.release() // hands bw to flushShortly
		if got := <-flushed; got != "goaway" {
			t.Fatalf("flushShortly returned with %q written, want \"goaway\" (%d octets left in bw)", got, c.bw.Buffered())
		}
		if err := <-waiter; err != nil {
			t.Fatal(err)
		}
		c.release()
	})
}

// TestDeadlineMovedWhileWaitingForTheLock: a writer waiting for the write
// lock gives up when its stream's deadline is moved to now from another
// goroutine (a role cutting the response short), not at the deadline it
// began waiting with; its stream is reset (CANCEL queued) and its
// handler's context ends. The lock's holder is not disturbed.
func TestDeadlineMovedWhileWaitingForTheLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var out writeCounter
		c := lockOnly(&out)
		c.baseCtx = context.Background()
		st := newStream(c, 1)
		st.wdl = time.Now().Add(time.Hour)
		if err := c.acquire(nil, time.Time{}); err != nil { // another writer holds the lock
			t.Fatal(err)
		}
		got := make(chan error)
		go func() { got <- c.withWriteLock(st, func() error { return nil }) }()
		synctest.Wait()
		time.Sleep(time.Second)
		st.mu.Lock()
		st.wdl = time.Now()
		st.mu.Unlock()
		st.wake()
		synctest.Wait()
		select {
		case err := <-got:
			if err != errWriteTimeout {
				t.Fatalf("the wait ended with %v, want errWriteTimeout", err)
			}
		default:
			t.Fatal("the writer still waits for the lock after its deadline moved to now")
		}
		if st.ctx.Err() == nil {
			t.Fatal("the stream's context goes on after its write timed out")
		}
		if len(c.ctrl) != 1 || c.ctrl[0].kind != http2.FrameRSTStream || http2.ErrCode(c.ctrl[0].val) != http2.ErrCodeCancel {
			t.Fatalf("queued %v, want one RST_STREAM CANCEL", c.ctrl)
		}
		c.ctrl = nil
		c.release()
	})
}

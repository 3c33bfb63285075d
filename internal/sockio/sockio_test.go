//go:build linux

package sockio_test

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvsp/kvsp/internal/sockio"
)

// pair returns the two ends of a loopback TCP connection, each wrapped in
// a sockio.Conn when raw is true (the accepting end through Listener).
func pair(t *testing.T, raw bool) (server, client net.Conn) {
	t.Helper()
	ln := listen(t, raw)
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			t.Error(err)
		}
		accepted <- c
	}()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.FailNow()
	}
	if raw {
		if _, ok := server.(*sockio.Conn); !ok {
			t.Fatalf("Listener accepted a %T, want *sockio.Conn", server)
		}
		if client, err = sockio.New(client.(*net.TCPConn)); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { server.Close(); client.Close() })
	return server, client
}

// Wrap wraps a TCP connection and returns any other as it is.
func TestWrap(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if got := sockio.Wrap(a); got != a {
		t.Fatalf("Wrap(a pipe) = %T, want the pipe itself", got)
	}
	_, c := pair(t, false)
	if _, ok := sockio.Wrap(c).(*sockio.Conn); !ok {
		t.Fatalf("Wrap(%T) is not a *sockio.Conn", c)
	}
}

// listen listens on a loopback port, through Listener when raw is true.
func listen(t *testing.T, raw bool) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if raw {
		return sockio.Listener{Listener: ln}
	}
	return ln
}

// A stream larger than the socket buffers, written in one Write while the
// reader takes small pieces, arrives whole and in order: Write waits in
// the poller when the send buffer is full and goes on where it stopped.
func TestStreamArrivesWhole(t *testing.T) {
	s, c := pair(t, true)
	data := make([]byte, 32<<20)
	rand.Read(data)
	done := make(chan error, 1)
	go func() {
		n, err := s.Write(data)
		if err == nil && n != len(data) {
			err = io.ErrShortWrite
		}
		s.Close()
		done <- err
	}()
	var got bytes.Buffer
	buf := make([]byte, 1000) // reads far smaller than the writes: many EAGAINs on both ends
	for {
		n, err := c.Read(buf)
		got.Write(buf[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), data) {
		t.Fatalf("read %d octets, not the %d written", got.Len(), len(data))
	}
}

// Concurrent Writes do not interleave their octets (net.Conn's contract;
// Conn keeps each Write's progress per connection).
func TestConcurrentWrites(t *testing.T) {
	s, c := pair(t, true)
	const writers, size = 4, 4 << 20
	var wg sync.WaitGroup
	for i := range writers {
		wg.Go(func() {
			if _, err := s.Write(bytes.Repeat([]byte{byte('a' + i)}, size)); err != nil {
				t.Error(err)
			}
		})
	}
	go func() { wg.Wait(); s.Close() }()
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != writers*size {
		t.Fatalf("read %d octets, want %d", len(got), writers*size)
	}
	for off := 0; off < len(got); off += size {
		run := got[off : off+size]
		if n := bytes.Count(run, run[:1]); n != size {
			t.Fatalf("octets %d-%d mix writes: %d of %d are %q", off, off+size, n, size, run[:1])
		}
	}
}

// Deadlines are the TCPConn's: a Read with nothing to read and a Write the
// peer does not read end with os.ErrDeadlineExceeded, as net.Conn's do;
// Close ends a Read in progress with net.ErrClosed; the peer's close is
// io.EOF.
func TestDeadlinesCloseAndEOF(t *testing.T) {
	s, c := pair(t, true)
	s.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := s.Read(make([]byte, 10)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past its deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	var ne net.Error
	// 500 ms: under make test's load the Write once began after a 50 ms
	// deadline had passed, and rightly wrote nothing.
	buf := make([]byte, 64<<20)
	s.SetWriteDeadline(time.Now().Add(500 * time.Millisecond))
	n, err := s.Write(buf) // more than the socket buffers hold: nobody reads
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("write past its deadline: %v, want a timeout", err)
	}
	if n <= 0 || n >= 64<<20 {
		t.Fatalf("a write cut by its deadline reported %d octets written", n)
	}

	s, c = pair(t, true) // nothing written on this one
	ended := make(chan error, 1)
	go func() { _, err := c.Read(make([]byte, 1)); ended <- err }()
	time.Sleep(10 * time.Millisecond) // let the Read wait in the poller (either order passes)
	c.Close()
	if err := <-ended; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read ended by Close: %v, want net.ErrClosed", err)
	}
	if n, err := s.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("read after the peer closed: %d, %v, want 0, io.EOF", n, err)
	}
}

// The mechanism: a goroutine that wakes from the network poller in a
// process whose every P was idle, and makes read and write system calls,
// wakes the runtime's monitor thread (sysmon) when the calls go through
// the runtime's hand-off, and leaves it asleep when they are Conn's raw
// ones. Counted as the monitor thread's voluntary context switches over
// 300 round trips of one octet to an echo in another process that waits
// 300 µs before each answer, so that every trip leaves this process idle:
// with plain connections (the control, which also checks that the runtime
// still behaves as the package comment says) and with Conns.
func TestRawCallsLeaveTheMonitorAsleep(t *testing.T) {
	if sockio.RaceBuild {
		t.Skip("built with -race, Conn's calls go through entersyscall for the detector's sake (raw_race.go); make test runs this test without -race")
	}
	mon := monitorThread(t)
	trips := func(raw bool) int {
		ln := listen(t, raw)
		defer ln.Close()
		echo := exec.Command(os.Args[0], "-test.run=^TestEchoProcess$")
		echo.Env = append(os.Environ(), "SOCKIO_ECHO="+ln.Addr().String())
		echo.Stderr = os.Stderr
		if err := echo.Start(); err != nil {
			t.Fatal(err)
		}
		defer echo.Wait()
		c, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		b := make([]byte, 1)
		before := switches(t, mon)
		for range 300 {
			if _, err := c.Write(b); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, b); err != nil {
				t.Fatal(err)
			}
		}
		return switches(t, mon) - before
	}
	plain, raw := trips(false), trips(true)
	t.Logf("the monitor thread's context switches over 300 round trips: %d with net.TCPConn, %d with sockio.Conn", plain, raw)
	if plain < 300 {
		t.Fatalf("with net.TCPConn the monitor switched %d times in 300 round trips, want at least 300: the runtime no longer wakes it on a system call after idling, and sockio's reason is gone (or thread %d is not the monitor)", plain, mon)
	}
	if raw*10 > plain {
		t.Errorf("with sockio.Conn the monitor switched %d times, against %d with net.TCPConn: want at most a tenth", raw, plain)
	}
}

// TestEchoProcess is not a test: TestRawCallsLeaveTheMonitorAsleep runs
// the test binary with it selected, as the echo it talks to.
func TestEchoProcess(t *testing.T) {
	addr := os.Getenv("SOCKIO_ECHO")
	if addr == "" {
		t.Skip("the echo process of TestRawCallsLeaveTheMonitorAsleep")
	}
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b := make([]byte, 1)
	for {
		if _, err := c.Read(b); err != nil {
			return
		}
		time.Sleep(300 * time.Microsecond)
		if _, err := c.Write(b); err != nil {
			return
		}
	}
}

// monitorThread returns the thread id of the runtime's monitor (sysmon):
// the first thread runtime.main starts, so the process's second-lowest
// thread id.
func monitorThread(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Skip("no /proc/self/task:", err)
	}
	var tids []int
	for _, e := range ents {
		if id, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, id)
		}
	}
	slices.Sort(tids)
	if len(tids) < 2 {
		t.Fatalf("threads %v: no monitor thread", tids)
	}
	return tids[1]
}

// switches returns thread tid's voluntary context switches so far.
func switches(t *testing.T, tid int) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc/self/task", strconv.Itoa(tid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	for l := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(l, "voluntary_ctxt_switches:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("thread %d's status has no voluntary_ctxt_switches", tid)
	return 0
}

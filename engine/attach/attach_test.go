package attach

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvsp/kvsp"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a Handler that maps a memfd pool and records the session's
// messages (the holder's handler is tested in package holder).
type recorder struct {
	mu        sync.Mutex
	pool      []byte
	published map[kvsp.BlockKey]int
	detached  chan struct{}
	refuse    error
}

func (r *recorder) Attach(s *Session, h *Hello, fd int) error {
	if fd < 0 {
		return errors.New("no descriptor")
	}
	defer unix.Close(fd)
	mem, err := unix.Mmap(fd, 0, int(h.Pool.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.pool = bytes.Clone(mem)
	r.mu.Unlock()
	return unix.Munmap(mem)
}

func (r *recorder) Publish(s *Session, scope kvsp.ScopeID, blocks []Placement) error {
	if r.refuse != nil {
		return r.refuse
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, b := range blocks {
		if b.Page < 0 || b.Page >= s.Hello.Pool.Pages {
			return errors.New("page out of the pool")
		}
		r.published[b.BlockKey] = b.Page
	}
	return nil
}

func (r *recorder) Unpublish(s *Session, keys []kvsp.BlockKey) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, k := range keys {
		delete(r.published, k)
	}
	return nil
}

func (r *recorder) Detach(s *Session) { close(r.detached) }

func serve(t *testing.T, h Handler) string {
	path := filepath.Join(t.TempDir(), "attach.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { (&Server{Handler: h}).Serve(ln); close(done) }()
	t.Cleanup(func() { ln.Close(); <-done })
	return path
}

func memfd(t *testing.T, data []byte) int {
	fd, err := unix.MemfdCreate("pool", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Write(fd, data); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

var pool = Pool{Memory: MemoryMemfd, Size: 4 * 1024, Pages: 4, PageTokens: 16, LayerStride: 2048, VOffset: 1024, PageStride: 256}

// TestSession: hello carries the pool's memfd (SCM_RIGHTS) and is
// welcomed; publish and unpublish reach the handler and are answered; an
// error of the handler comes back as the reply; closing detaches.
func TestSession(t *testing.T) {
	r := &recorder{published: map[kvsp.BlockKey]int{}, detached: make(chan struct{})}
	path := serve(t, r)
	data := bytes.Repeat([]byte("kvpool!!"), 512)
	e, err := Dial(path, &Hello{Engine: "test", CompatID: kvsp.CompatID{1}, Pool: pool}, memfd(t, data))
	if err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	got := bytes.Equal(r.pool, data)
	r.mu.Unlock()
	if !got {
		t.Fatal("the handler did not map the engine's memfd")
	}
	if err := e.Publish(kvsp.ScopeID{2}, []Placement{{BlockKey: kvsp.BlockKey{1}, Page: 0}, {BlockKey: kvsp.BlockKey{2}, Page: 3}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Publish(kvsp.ScopeID{2}, []Placement{{BlockKey: kvsp.BlockKey{3}, Page: 9}}); err == nil || !strings.Contains(err.Error(), "page out of the pool") {
		t.Fatalf("a refused publish: %v", err)
	}
	if err := e.Unpublish([]kvsp.BlockKey{{1}}); err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	if len(r.published) != 1 || r.published[kvsp.BlockKey{2}] != 3 {
		t.Fatalf("published %v", r.published)
	}
	r.mu.Unlock()
	e.Close()
	select {
	case <-r.detached:
	case <-time.After(5 * time.Second):
		t.Fatal("closing the session did not detach it")
	}
}

// TestHelloRefused: a memfd pool without its descriptor, and a handler
// that refuses the pool, end the session with the reason.
func TestHelloRefused(t *testing.T) {
	r := &recorder{published: map[kvsp.BlockKey]int{}, detached: make(chan struct{})}
	path := serve(t, r)
	if _, err := Dial(path, &Hello{CompatID: kvsp.CompatID{1}, Pool: pool}, -1); err == nil || !strings.Contains(err.Error(), "descriptor") {
		t.Fatalf("memfd pool without its descriptor: %v", err)
	}
	cuda := pool
	cuda.Memory = MemoryCUDA
	if _, err := Dial(path, &Hello{CompatID: kvsp.CompatID{1}, Pool: cuda}, -1); err == nil || !strings.Contains(err.Error(), "no descriptor") {
		t.Fatalf("a pool the handler refuses: %v", err)
	}
}

// TestPoolCheck: version 1's pool rules.
func TestPoolCheck(t *testing.T) {
	const sec = 256 // 16 tokens x 2 heads x 4 dim x 2 octets
	ok := Pool{Memory: MemoryMemfd, Size: 2 * 2 * 4 * sec, Pages: 4, PageTokens: 16, LayerStride: 2 * 4 * sec, VOffset: 4 * sec, PageStride: sec}
	if err := ok.Check(2, sec/16); err != nil {
		t.Fatalf("a vLLM-style [2, pages, ...] pool per layer: %v", err)
	}
	if k, v := ok.Section(1, 2); k != 2*4*sec+2*sec || v != k+4*sec {
		t.Fatalf("section offsets %d %d", k, v)
	}
	for name, mut := range map[string]func(p *Pool){
		"memory":         func(p *Pool) { p.Memory = "rdma" },
		"cuda handle":    func(p *Pool) { p.Memory = MemoryCUDA },
		"page tokens":    func(p *Pool) { p.PageTokens = 32 },
		"no tokens":      func(p *Pool) { p.PageTokens = 0 },
		"small stride":   func(p *Pool) { p.PageStride = sec - 1 },
		"k/v overlap":    func(p *Pool) { p.VOffset = sec / 2 },
		"too small":      func(p *Pool) { p.Size-- },
		"overflow":       func(p *Pool) { p.PageStride = 1 << 62 },
		"huge pages":     func(p *Pool) { p.PageTokens = 1 << 61 },
		"layers overlap": func(p *Pool) { p.LayerStride = 0 },
		"offset < 0":     func(p *Pool) { p.Offset = -1 },
		"offset past":    func(p *Pool) { p.Offset = math.MaxInt64 - p.Size + 1 },
	} {
		p := ok
		mut(&p)
		if p.Check(2, sec/16) == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestBadFrames: a peer that sends an oversized frame, a frame that is not
// JSON, a hello of another version, or an unknown message gets an error or
// a closed connection; the server keeps serving the next session.
func TestBadFrames(t *testing.T) {
	r := &recorder{published: map[kvsp.BlockKey]int{}, detached: make(chan struct{})}
	path := serve(t, r)
	send := func(frame []byte) string {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write(frame)
		c.(*net.UnixConn).CloseWrite()
		reply, _ := io.ReadAll(c)
		return string(reply)
	}
	frame := func(body string) []byte {
		return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	}
	for name, f := range map[string][]byte{
		"oversized":     binary.BigEndian.AppendUint32(nil, MaxFrame+1),
		"not JSON":      frame("{hello"),
		"short":         {0, 0},
		"version 2":     frame(`{"type":"hello","version":2}`),
		"not a hello":   frame(`{"type":"publish","version":1}`),
		"publish first": frame(`{"type":"publish","scope_id":"00000000000000000000000000000000","blocks":[]}`),
	} {
		if reply := send(f); strings.Contains(reply, "welcome") {
			t.Errorf("%s: welcomed: %q", name, reply)
		}
	}
	// Still serving.
	e, err := Dial(path, &Hello{CompatID: kvsp.CompatID{1}, Pool: pool}, memfd(t, make([]byte, pool.Size)))
	if err != nil {
		t.Fatal(err)
	}
	e.Close()
	<-r.detached
}

// TestPlacementTable: a block is one page when pages are blocks, or the
// pages from the one holding its first token; the table must hold exactly
// the block's tokens, inside the pool.
func TestPlacementTable(t *testing.T) {
	for name, c := range map[string]struct {
		p                              Placement
		pages, pageTokens, blockTokens int
		table                          []int32
		first                          int
		ok                             bool
	}{
		"a page is a block":         {Placement{Page: 3}, 8, 16, 16, []int32{3}, 0, true},
		"pages of 16, block of 64":  {Placement{Pages: []int{5, 1, 7, 2}}, 8, 16, 64, []int32{5, 1, 7, 2}, 0, true},
		"block of 16 in two pages":  {Placement{Pages: []int{4, 6}, Offset: 8}, 8, 16, 16, []int32{4, 6}, 8, true},
		"block inside a page of 64": {Placement{Pages: []int{2}, Offset: 32}, 8, 64, 16, []int32{2}, 32, true},
		"page without pages":        {Placement{Page: 1}, 8, 16, 64, nil, 0, false},
		"one page too many":         {Placement{Pages: []int{1, 2, 3}}, 8, 16, 32, nil, 0, false},
		"too few":                   {Placement{Pages: []int{1}, Offset: 8}, 8, 16, 16, nil, 0, false},
		"outside the pool":          {Placement{Pages: []int{1, 8}}, 8, 16, 32, nil, 0, false},
		"offset past the page":      {Placement{Pages: []int{1}, Offset: 16}, 8, 16, 16, nil, 0, false},
	} {
		table, first, err := c.p.Table(c.pages, c.pageTokens, c.blockTokens)
		if (err == nil) != c.ok || c.ok && (!slices.Equal(table, c.table) || first != c.first) {
			t.Errorf("%s: %v %d %v", name, table, first, err)
		}
	}
}

// TestServerClose: Close ends the live sessions (Detach runs) before it
// returns, so their pools can be released after it.
func TestServerClose(t *testing.T) {
	r := &recorder{published: map[kvsp.BlockKey]int{}, detached: make(chan struct{})}
	path := filepath.Join(t.TempDir(), "attach.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{Handler: r}
	served := make(chan struct{})
	go func() { srv.Serve(ln); close(served) }()
	e, err := Dial(path, &Hello{CompatID: kvsp.CompatID{1}, Pool: pool}, memfd(t, make([]byte, pool.Size)))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	srv.Close()
	<-served
	select {
	case <-r.detached:
	default:
		t.Fatal("Close returned before the session was detached")
	}
	if err := e.Publish(kvsp.ScopeID{1}, nil); err == nil {
		t.Fatal("a session outlived the server's Close")
	}
}

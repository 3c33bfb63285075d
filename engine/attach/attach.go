// Package attach is kvsp's engine attach protocol: how an inference engine
// on the node (a vLLM-style engine with a Python connector, or a Go one)
// hands its paged KV pool to the holder, and says which of its pages hold
// which blocks, so the holder serves those blocks straight out of the
// engine's memory. The protocol is documented in docs/engine-attach.md;
// this package is its Go implementation, both sides.
//
// The transport is a Unix stream socket. Each frame is a 4-octet
// big-endian length and a JSON object of that length; the hello frame of
// a memfd pool carries the pool's descriptor (SCM_RIGHTS). The server
// accepts peers of its own user only (SO_PEERCRED), unless configured
// with others.
package attach

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"net"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvsp/kvsp"
)

// Version is the protocol version of this package.
const Version = 1

// Bounds of a pool, so that every offset fits the kernels' arithmetic.
const (
	MaxPageTokens = 1 << 16
	MaxPages      = 1 << 24
)

// MaxFrame bounds a frame (a publish of many blocks fits easily).
const MaxFrame = 4 << 20

// Memory kinds of a pool.
const (
	MemoryCUDA  = "cuda-ipc" // Pool.Handle is a CUDA IPC memory handle
	MemoryMemfd = "memfd"    // the hello frame carries the memfd
)

// Pool describes an engine's paged KV pool: one region of Size octets, in
// which the K rows of (layer l, page p) start at l*LayerStride +
// p*PageStride and its V rows VOffset octets later: PageTokens rows of
// kv_heads x head_dim elements, token after token. When PageTokens is the
// model's block_tokens a page is a block's kvsp-layout-1 section per
// layer and K/V; otherwise blocks are gathered from their pages on the
// device (gpu.Paged).
type Pool struct {
	Memory      string `json:"memory"`
	Device      int    `json:"device"`
	Handle      []byte `json:"handle,omitempty"`
	Offset      int64  `json:"offset,omitempty"` // where the pool starts in the exported allocation or memfd
	Size        int64  `json:"size"`
	Pages       int    `json:"pages"`
	PageTokens  int    `json:"page_tokens"`
	LayerStride int64  `json:"layer_stride"`
	VOffset     int64  `json:"v_offset"`
	PageStride  int64  `json:"page_stride"`
}

// Hello opens a session: the engine's model and its pool.
type Hello struct {
	Type     string        `json:"type"` // "hello"
	Version  int           `json:"version"`
	Engine   string        `json:"engine"`
	CompatID kvsp.CompatID `json:"compat_id"`
	Pool     Pool          `json:"pool"`
}

// Placement says where block BlockKey's tokens are (all its layers): page
// Page, when pages are blocks; otherwise the sequence's Pages from the
// one holding the block's first token, whose row in Pages[0] is Offset.
type Placement struct {
	BlockKey kvsp.BlockKey `json:"block_key"`
	Page     int           `json:"page"`
	Pages    []int         `json:"pages,omitempty"`
	Offset   int           `json:"offset,omitempty"`
}

// Table returns the pages holding the block's blockTokens tokens and the
// row of its first token, checked against a pool of pages pages of
// pageTokens tokens.
func (b *Placement) Table(pages, pageTokens, blockTokens int) ([]int32, int, error) {
	src := b.Pages
	if src == nil {
		if pageTokens != blockTokens || b.Offset != 0 {
			return nil, 0, errors.New("attach: pages of another size than a block need pages and offset")
		}
		src = []int{b.Page}
	}
	if b.Offset < 0 || b.Offset >= pageTokens || len(src) != (b.Offset+blockTokens+pageTokens-1)/pageTokens {
		return nil, 0, fmt.Errorf("attach: %d pages from row %d do not hold a block of %d tokens exactly", len(src), b.Offset, blockTokens)
	}
	table := make([]int32, len(src))
	for i, p := range src {
		if p < 0 || p >= pages {
			return nil, 0, fmt.Errorf("attach: page %d is outside the pool's %d", p, pages)
		}
		table[i] = int32(p)
	}
	return table, b.Offset, nil
}

// message is any frame after hello.
type message struct {
	Type      string          `json:"type"` // publish, unpublish, lend, claim, stats; ok, error, welcome, claimed
	ScopeID   *kvsp.ScopeID   `json:"scope_id,omitempty"`
	Blocks    []Placement     `json:"blocks,omitempty"`
	BlockKeys []kvsp.BlockKey `json:"block_keys,omitempty"`
	Pages     []int           `json:"pages,omitempty"`
	Stats     *Stats          `json:"stats,omitempty"`
	Error     string          `json:"error,omitempty"`
	Version   int             `json:"version,omitempty"`
}

// Stats is an engine's load, as the instance agent reports it in its
// status record.
type Stats struct {
	Running           uint64  `json:"running"`
	Queued            uint64  `json:"queued"`
	BatchSize         uint64  `json:"batch_size"`
	KVUtilization     float64 `json:"kv_utilization"`
	PrefillTokensPerS float64 `json:"prefill_tokens_per_s"`
	DecodeTokensPerS  float64 `json:"decode_tokens_per_s"`
}

// Loader is the instance agent's side of a session, besides Handler: the
// engine lends it free pages, the agent writes prefetched blocks into
// them, and the engine claims the loaded blocks (their pages are the
// engine's again, holding those blocks); the engine also reports its load.
type Loader interface {
	Lend(s *Session, pages []int) error
	Claim(s *Session) ([]Placement, error)
	Report(s *Session, st Stats) error
}

// Check validates a pool against the model's geometry (rows of rowBytes
// octets): pages inside the pool, a page's K and V rows apart.
func (p *Pool) Check(layers int, rowBytes int64) error {
	if p.PageTokens <= 0 || p.PageTokens > MaxPageTokens || p.Pages <= 0 || p.Pages > MaxPages || layers <= 0 || layers > 1<<16 ||
		rowBytes <= 0 || rowBytes > 1<<24 {
		return fmt.Errorf("attach: pool: pages (at most %d) of page_tokens (at most %d) for %d layers of %d-octet rows", MaxPages, MaxPageTokens, layers, rowBytes)
	}
	sectionLen := int64(p.PageTokens) * rowBytes
	switch {
	case p.Memory != MemoryCUDA && p.Memory != MemoryMemfd:
		return fmt.Errorf("attach: pool memory %q: want %s or %s", p.Memory, MemoryCUDA, MemoryMemfd)
	case p.Memory == MemoryCUDA && len(p.Handle) != 64:
		return fmt.Errorf("attach: a %s pool needs its 64-octet handle", MemoryCUDA)
	case p.PageTokens <= 0:
		return errors.New("attach: page_tokens: at least 1")
	case p.Pages <= 0 || p.Size <= 0 || p.LayerStride < 0 || p.PageStride < sectionLen || p.VOffset < sectionLen:
		return errors.New("attach: pool: pages, size and strides must describe sections that do not overlap (v_offset and page_stride at least a section)")
	case p.Offset < 0 || p.Offset > math.MaxInt64-p.Size:
		return errors.New("attach: pool: offset must be at least 0, and offset + size fit in 63 bits")
	}
	// The last row's end, computed without overflow: a peer's numbers may
	// be anything.
	end, ok := mulAdd(int64(layers-1), p.LayerStride, 0)
	if ok {
		end, ok = mulAdd(int64(p.Pages-1), p.PageStride, end)
	}
	if ok {
		end, ok = mulAdd(1, p.VOffset, end)
	}
	if ok {
		end, ok = mulAdd(1, sectionLen, end)
	}
	if !ok || end > p.Size {
		return fmt.Errorf("attach: pool: its sections reach past the pool's %d octets", p.Size)
	}
	// A layer's pages end before the next layer's begin.
	extent, ok := mulAdd(int64(p.Pages-1), p.PageStride, p.VOffset)
	if ok {
		extent, ok = mulAdd(1, sectionLen, extent)
	}
	if layers > 1 && (!ok || p.LayerStride < extent) {
		return errors.New("attach: pool: layer_stride is shorter than a layer's pages: layers would overlap")
	}
	return nil
}

// mulAdd returns a*b + c for non-negative operands, and false when it
// does not fit in an int64.
func mulAdd(a, b, c int64) (int64, bool) {
	if a < 0 || b < 0 || c < 0 {
		return 0, false
	}
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi != 0 || lo > math.MaxInt64 {
		return 0, false
	}
	sum := int64(lo) + c
	return sum, sum >= 0
}

// Section returns the offsets in the pool of the K and V sections of
// (layer, page).
func (p *Pool) Section(layer, page int) (k, v int64) {
	k = int64(layer)*p.LayerStride + int64(page)*p.PageStride
	return k, k + p.VOffset
}

// conn is one side of a session.
type conn struct {
	c *net.UnixConn
}

func (c conn) write(v any, fds ...int) error {
	body, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(body) > MaxFrame {
		return fmt.Errorf("attach: a frame of %d octets", len(body))
	}
	frame := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(body)), uint32(len(body)))
	frame = append(frame, body...)
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.c.WriteMsgUnix(frame, oob, nil)
	if err == nil && n < len(frame) {
		_, err = c.c.Write(frame[n:])
	}
	return err
}

// read reads one frame into v, with the descriptors it carried.
func (c conn) read(v any) ([]int, error) {
	var hdr [4]byte
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := c.c.ReadMsgUnix(hdr[:], oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return nil, fmt.Errorf("attach: control message: %w", err)
		}
		for _, m := range msgs {
			got, err := unix.ParseUnixRights(&m)
			if err != nil {
				return nil, fmt.Errorf("attach: control message: %w", err)
			}
			fds = append(fds, got...)
		}
	}
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	if _, err := io.ReadFull(c.c, hdr[n:]); err != nil {
		closeAll()
		return nil, err
	}
	size := binary.BigEndian.Uint32(hdr[:])
	if size > MaxFrame {
		closeAll()
		return nil, fmt.Errorf("attach: a frame of %d octets (at most %d)", size, MaxFrame)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(c.c, body); err != nil {
		closeAll()
		return nil, err
	}
	if err := json.Unmarshal(body, v); err != nil {
		closeAll()
		return nil, fmt.Errorf("attach: frame: %w", err)
	}
	return fds, nil
}

// Engine is the engine's side of a session (a connector).
type Engine struct {
	c conn
}

// Dial opens a session at the socket path: hello with the pool (fd: its
// memfd, or -1), answered by welcome or an error.
func Dial(path string, h *Hello, fd int) (*Engine, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	e := &Engine{c: conn{c}}
	h.Type, h.Version = "hello", Version
	var fds []int
	if fd >= 0 {
		fds = []int{fd}
	}
	if err := e.c.write(h, fds...); err != nil {
		c.Close()
		return nil, fmt.Errorf("attach: hello: %w", err)
	}
	if err := e.reply("welcome"); err != nil {
		c.Close()
		return nil, err
	}
	return e, nil
}

func (e *Engine) reply(want string) error {
	_, err := e.answer(want)
	return err
}

// answer reads the server's answer, which must be of type want.
func (e *Engine) answer(want string) (*message, error) {
	var m message
	fds, err := e.c.read(&m)
	for _, fd := range fds {
		unix.Close(fd)
	}
	switch {
	case err != nil:
		return nil, fmt.Errorf("attach: %w", err)
	case m.Type == "error":
		return nil, fmt.Errorf("attach: refused: %s", m.Error)
	case m.Type != want:
		return nil, fmt.Errorf("attach: %q where %q was due", m.Type, want)
	}
	return &m, nil
}

// Publish says which pages hold which blocks of a scope; once it returns,
// the holder serves them.
func (e *Engine) Publish(scope kvsp.ScopeID, blocks []Placement) error {
	if err := e.c.write(&message{Type: "publish", ScopeID: &scope, Blocks: blocks}); err != nil {
		return err
	}
	return e.reply("ok")
}

// Unpublish withdraws blocks; once it returns, no read of their pages is
// in flight and none will start: the engine may reuse the pages.
func (e *Engine) Unpublish(keys []kvsp.BlockKey) error {
	if err := e.c.write(&message{Type: "unpublish", BlockKeys: keys}); err != nil {
		return err
	}
	return e.reply("ok")
}

// Lend gives the agent free pages to load prefetched blocks into.
func (e *Engine) Lend(pages []int) error {
	if err := e.c.write(&message{Type: "lend", Pages: pages}); err != nil {
		return err
	}
	return e.reply("ok")
}

// Claim takes back the blocks the agent loaded since the last claim: their
// pages hold them now, and are the engine's again.
func (e *Engine) Claim() ([]Placement, error) {
	if err := e.c.write(&message{Type: "claim"}); err != nil {
		return nil, err
	}
	m, err := e.answer("claimed")
	if err != nil {
		return nil, err
	}
	return m.Blocks, nil
}

// Report sends the engine's load (the agent's status record carries it).
func (e *Engine) Report(st Stats) error {
	if err := e.c.write(&message{Type: "stats", Stats: &st}); err != nil {
		return err
	}
	return e.reply("ok")
}

// Close ends the session: the holder stops serving everything it
// published (after reads in flight).
func (e *Engine) Close() error { return e.c.c.Close() }

// Handler is the holder's side of sessions.
type Handler interface {
	// Attach accepts a session's pool (fd: the memfd it carried, or -1,
	// owned by the handler from here on).
	Attach(s *Session, h *Hello, fd int) error
	// Publish starts serving blocks out of the session's pages.
	Publish(s *Session, scope kvsp.ScopeID, blocks []Placement) error
	// Unpublish stops serving blocks; it returns once no read of their
	// pages is in flight.
	Unpublish(s *Session, keys []kvsp.BlockKey) error
	// Detach ends a session: as Unpublish of everything it published.
	Detach(s *Session)
}

// Session is a connected engine, as the handler sees it; Value is the
// handler's.
type Session struct {
	Hello Hello
	Value any
}

// Server accepts engine sessions on a Unix socket.
type Server struct {
	Handler Handler
	// UIDs are the user ids allowed besides the server's own.
	UIDs []int

	mu     sync.Mutex
	ln     *net.UnixListener
	conns  map[*net.UnixConn]bool
	closed bool
	wg     sync.WaitGroup
}

// Serve accepts sessions until ln is closed (or Close).
func (srv *Server) Serve(ln *net.UnixListener) error {
	srv.mu.Lock()
	srv.ln = ln
	if srv.conns == nil {
		srv.conns = map[*net.UnixConn]bool{}
	}
	srv.mu.Unlock()
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		srv.mu.Lock()
		if srv.closed {
			srv.mu.Unlock()
			c.Close()
			return nil
		}
		srv.conns[c] = true
		srv.wg.Add(1)
		srv.mu.Unlock()
		go func() {
			defer srv.wg.Done()
			srv.session(c)
			srv.mu.Lock()
			delete(srv.conns, c)
			srv.mu.Unlock()
		}()
	}
}

// Close stops accepting, ends every session (their handlers' Detach run)
// and returns once they have: what the handlers hold can be released
// after it.
func (srv *Server) Close() error {
	srv.mu.Lock()
	srv.closed = true
	var err error
	if srv.ln != nil {
		err = srv.ln.Close()
	}
	for c := range srv.conns {
		c.Close()
	}
	srv.mu.Unlock()
	srv.wg.Wait()
	return err
}

// peerAllowed checks the peer's user (SO_PEERCRED).
func (srv *Server) peerAllowed(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if int(cred.Uid) != unix.Getuid() && !slices.Contains(srv.UIDs, int(cred.Uid)) {
		return fmt.Errorf("attach: user %d may not attach", cred.Uid)
	}
	return nil
}

func (srv *Server) session(c *net.UnixConn) {
	defer c.Close()
	cn := conn{c}
	if err := srv.peerAllowed(c); err != nil {
		cn.write(&message{Type: "error", Error: err.Error()})
		return
	}
	var h Hello
	fds, err := cn.read(&h)
	if err != nil {
		return
	}
	fd := -1
	for i, f := range fds { // one descriptor at most: the pool's
		if i == 0 && h.Pool.Memory == MemoryMemfd {
			fd = f
			continue
		}
		unix.Close(f)
	}
	if h.Type != "hello" || h.Version != Version {
		if fd >= 0 {
			unix.Close(fd)
		}
		cn.write(&message{Type: "error", Error: fmt.Sprintf("want hello of version %d", Version)})
		return
	}
	if h.Pool.Memory == MemoryMemfd && fd < 0 {
		cn.write(&message{Type: "error", Error: "a memfd pool's hello carries its descriptor"})
		return
	}
	s := &Session{Hello: h}
	if err := srv.Handler.Attach(s, &h, fd); err != nil {
		cn.write(&message{Type: "error", Error: err.Error()})
		return
	}
	defer srv.Handler.Detach(s)
	if cn.write(&message{Type: "welcome", Version: Version}) != nil {
		return
	}
	for {
		var m message
		fds, err := cn.read(&m)
		for _, f := range fds {
			unix.Close(f)
		}
		if err != nil {
			return
		}
		reply := &message{Type: "ok"}
		loader, isLoader := srv.Handler.(Loader)
		switch {
		case m.Type == "publish" && m.ScopeID != nil:
			err = srv.Handler.Publish(s, *m.ScopeID, m.Blocks)
		case m.Type == "unpublish":
			err = srv.Handler.Unpublish(s, m.BlockKeys)
		case m.Type == "lend" && isLoader:
			err = loader.Lend(s, m.Pages)
		case m.Type == "claim" && isLoader:
			var blocks []Placement
			blocks, err = loader.Claim(s)
			reply = &message{Type: "claimed", Blocks: blocks}
		case m.Type == "stats" && isLoader && m.Stats != nil:
			err = loader.Report(s, *m.Stats)
		default:
			err = fmt.Errorf("unexpected %q", m.Type)
		}
		if err != nil {
			reply = &message{Type: "error", Error: err.Error()}
		}
		if cn.write(reply) != nil {
			return
		}
	}
}

//go:build nogpu

package connected_test

import (
	"bytes"
	"errors"
	"net"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/engine/attach"
	"github.com/kvsp/kvsp/engine/connected"
	"github.com/kvsp/kvsp/engine/sim"
	"github.com/kvsp/kvsp/tier"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var desc = kvsp.Descriptor{Model: "sim/tiny", ModelDigest: kvsp.Digest{1}, TokenizerDigest: kvsp.Digest{2}, Layers: 4, KVHeads: 2, HeadDim: 16,
	KVDType: "bf16", Positional: "rope", BlockTokens: 16, Layout: "kvsp-layout-1"}

// TestLentPages (nogpu stand-in, memfd pool): an engine attaches to the
// agent's socket with pages of 8 tokens and lends four pages; the agent
// writes a block (two pages) layer by layer; it reads back, the engine's
// pool holds its rows where its layout says, and the engine claims it with
// its pages; a block with no lent page left is ErrKVFull, one dropped
// gives its pages back; the engine's load
// reports reach Stats; closing the session forgets everything.
func TestLentPages(t *testing.T) {
	dev, err := tier.OpenDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	s, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 1, DecodeTokensPerS: 1})
	g := s.Geometry()
	e, err := connected.New(desc, g, dev)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { (&attach.Server{Handler: e}).Serve(ln); close(served) }()
	defer func() { ln.Close(); <-served }()

	row := int64(g.RawSectionLen()) / int64(g.BlockTokens)
	pool := attach.Pool{Memory: attach.MemoryMemfd, Pages: 6, PageTokens: 8, PageStride: 8 * row}
	pool.VOffset = 6 * pool.PageStride
	pool.LayerStride = 2 * pool.VOffset
	pool.Size = int64(g.Layers) * pool.LayerStride
	fd, err := unix.MemfdCreate("engine-pool", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	unix.Ftruncate(fd, pool.Size)
	mem, err := unix.Mmap(fd, 0, int(pool.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	compat, _ := desc.CompatID()
	kv := e.KV()
	if err := kv.WriteLayer(kvsp.BlockKey{1}, 0, make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())); !errors.Is(err, connected.ErrNotAttached) {
		t.Fatalf("a write before any engine attached: %v", err)
	}
	en, err := attach.Dial(sock, &attach.Hello{Engine: "test", CompatID: compat, Pool: pool}, fd)
	if err != nil {
		t.Fatal(err)
	}
	if err := en.Lend([]int{5, 2, 3, 0}); err != nil {
		t.Fatal(err)
	}
	if err := en.Lend([]int{2}); err == nil {
		t.Fatal("a page lent twice was accepted")
	}
	key := kvsp.BlockKey{0xa1}
	k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
	for l := range g.Layers {
		sim.BlockContent(g, key, l, k, v)
		if err := kv.WriteLayer(key, l, k, v); err != nil {
			t.Fatal(err)
		}
	}
	if !kv.Has(key) {
		t.Fatal("a block written whole is not resident")
	}
	gk, gv := make([]byte, len(k)), make([]byte, len(v))
	for l := range g.Layers {
		sim.BlockContent(g, key, l, k, v)
		if err := kv.ReadLayer(key, l, gk, gv); err != nil || !bytes.Equal(gk, k) || !bytes.Equal(gv, v) {
			t.Fatalf("layer %d read back: %v", l, err)
		}
		for tok := range int(g.BlockTokens) { // in the engine's own pool, where its layout says
			page := []int{5, 2}[tok/8]
			ko, vo := pool.Section(int(l), page)
			r := int64(tok%8) * row
			if !bytes.Equal(mem[ko+r:ko+r+row], k[int64(tok)*row:int64(tok+1)*row]) || !bytes.Equal(mem[vo+r:vo+r+row], v[int64(tok)*row:int64(tok+1)*row]) {
				t.Fatalf("layer %d token %d is not in the engine's page %d", l, tok, page)
			}
		}
	}
	// A pinned block is not claimed; unpinned, it is, with its pages.
	kv.Pin(key)
	if got, err := en.Claim(); err != nil || len(got) != 0 {
		t.Fatalf("claim of a pinned block: %v %v", got, err)
	}
	kv.Unpin(key)
	got, err := en.Claim()
	if err != nil || len(got) != 1 || got[0].BlockKey != key || len(got[0].Pages) != 2 || got[0].Pages[0] != 5 || got[0].Pages[1] != 2 {
		t.Fatalf("claim: %+v %v", got, err)
	}
	if kv.Has(key) {
		t.Fatal("a claimed block is the engine's, not the agent's")
	}
	for i := range 2 { // pages 3 and 0 take one block; then none is left
		err := kv.WriteLayer(kvsp.BlockKey{byte(0xb0 + i)}, 0, k, v)
		if (i == 0) != (err == nil) || i == 1 && !errors.Is(err, engine.ErrKVFull) {
			t.Fatalf("block %d with pages %s: %v", i, map[bool]string{true: "left", false: "used up"}[i == 0], err)
		}
	}
	kv.Drop(kvsp.BlockKey{0xb0}) // partly written: its pages are free again
	if err := kv.WriteLayer(kvsp.BlockKey{0xb1}, 0, k, v); err != nil {
		t.Fatalf("a block with the pages of a dropped one: %v", err)
	}
	if err := en.Report(attach.Stats{Running: 3, Queued: 1, BatchSize: 8, KVUtilization: 0.5, PrefillTokensPerS: 9000, DecodeTokensPerS: 70}); err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.Running != 3 || st.KVUtilization != 0.5 || st.DecodeTokensPerS != 70 {
		t.Fatalf("stats %+v", st)
	}
	for _, bad := range []attach.Stats{{KVUtilization: 1.5}, {PrefillTokensPerS: -5}, {Running: 1 << 60}} {
		if en.Report(bad) == nil {
			t.Fatalf("a report no status record could carry was accepted: %+v", bad)
		}
	}
	if st := e.Stats(); st.Running != 3 {
		t.Fatalf("a refused report changed the stats: %+v", st)
	}
	en.Close()
	deadline := time.Now().Add(5 * time.Second)
	for !errors.Is(kv.WriteLayer(kvsp.BlockKey{0xc0}, 0, k, v), connected.ErrNotAttached) {
		if time.Now().After(deadline) {
			t.Fatal("the session's pool outlived it")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

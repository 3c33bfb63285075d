//go:build nogpu

package holder_test

import (
	"bytes"
	"context"
	"net"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine/attach"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/tier"
)

// TestAttachedEngineServesFromItsPages (nogpu stand-in: the pool is a
// memfd): an engine attaches its paged pool (vLLM's per-layer [2, pages,
// tokens, heads, dim] layout, at an offset in its memory) over the Unix
// socket and publishes two blocks by page; the holder serves each, whole
// and by layer range, verified, byte for byte the container a PUT of the
// same KV would store, and publishes it on the device tier; after
// unpublish (and after the engine's session ends) the block is gone and
// withdrawn.
func TestAttachedEngineServesFromItsPages(t *testing.T) {
	f, sock := startAttached(t)

	// The engine's pool: 3 pages; blocks 1 and 2 in pages 0 and 2.
	sec := int64(geom.RawSectionLen())
	const pages = 3
	pool := attach.Pool{Memory: attach.MemoryMemfd, Pages: pages, PageTokens: int(geom.BlockTokens),
		PageStride: sec, VOffset: pages * sec, LayerStride: 2 * pages * sec, Size: int64(geom.Layers) * 2 * pages * sec}
	mem := make([]byte, pool.Size)
	datas, blocks := map[byte][]byte{}, map[byte]*container.Block{}
	for k, page := range map[byte]int{1: 0, 2: 2} {
		datas[k], blocks[k] = makeBlock(uint64(k)+900, 0, 4)
		for l := range int(geom.Layers) {
			kk, vv, _ := blocks[k].Layer(uint32(l))
			ko, vo := pool.Section(l, page)
			copy(mem[ko:], kk)
			copy(mem[vo:], vv)
		}
	}
	// The pool lies inside a larger allocation, at an offset that is not
	// page-aligned (a caching allocator's segment), other octets around it.
	pool.Offset = 12345
	fd, err := unix.MemfdCreate("engine-pool", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	around := bytes.Repeat([]byte{0xee}, int(pool.Offset))
	if _, err := unix.Write(fd, slices.Concat(around, mem, around)); err != nil {
		t.Fatal(err)
	}
	e, err := attach.Dial(sock, &attach.Hello{Engine: "test-engine", CompatID: compat, Pool: pool}, fd)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.Publish(scope, []attach.Placement{{BlockKey: ref(1).Key, Page: 0}, {BlockKey: ref(2).Key, Page: 2}}); err != nil {
		t.Fatal(err)
	}
	if err := e.Publish(scope, []attach.Placement{{BlockKey: ref(3).Key, Page: pages}}); err == nil {
		t.Fatal("a page outside the pool was published")
	}
	a := f.hold[kvsptest.ClientA]
	for _, k := range []byte{1, 2} {
		f.residency(t, ref(k).Key, []kvsp.Residency{{Tier: kvsp.TierDevice, Layers: kvsp.LayerRange{0, 3}, ReadMbitPerS: 2000000}})
		for _, lr := range []*kvsp.LayerRange{nil, {1, 2}, {3, 3}} {
			want := 4
			if lr != nil {
				want = int(lr[1]-lr[0]) + 1
			}
			if n := readAll(t, a, ref(k), blocks[k], lr); n != want {
				t.Fatalf("block %d layers %v: %d sections", k, lr, n)
			}
		}
		if st, _, body := f.raw(t, kvsptest.ClientA, "GET", path(ref(k)), nil, nil); st != 200 || !bytes.Equal(body, datas[k]) {
			t.Fatalf("block %d from the engine's pages: %d, equal to its container %v", k, st, bytes.Equal(body, datas[k]))
		}
	}
	if err := e.Unpublish([]kvsp.BlockKey{ref(1).Key}); err != nil {
		t.Fatal(err)
	}
	if st, _, _ := f.raw(t, kvsptest.ClientA, "GET", path(ref(1)), nil, nil); st != 404 {
		t.Fatalf("an unpublished block: %d", st)
	}
	f.gone(t, ref(1).Key)
	e.Close() // the session ends: everything it published goes
	deadline := time.Now().Add(5 * time.Second)
	for st := 200; st != 404; st, _, _ = f.raw(t, kvsptest.ClientA, "GET", path(ref(2)), nil, nil) {
		if time.Now().After(deadline) {
			t.Fatalf("block 2 still served after the engine left: %d", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
	f.gone(t, ref(2).Key)
}

// startAttached is a holder whose device tier (the stand-in) takes all 4
// layers, serving the attach protocol on a socket until the test ends.
func startAttached(t *testing.T) (*fixture, string) {
	dev, err := tier.OpenDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	f := start(t, 8*blockSize(), func(c *holder.Config) {
		c.Device, c.DeviceCapacity, c.DeviceLayers, c.DeviceReadMbitPerS = dev, 2*blockSize(), 4, 2000000
	})
	sock := filepath.Join(t.TempDir(), "attach.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	srv := &attach.Server{Handler: f.h.AttachHandler()}
	served := make(chan struct{})
	go func() { srv.Serve(ln); close(served) }()
	t.Cleanup(func() { srv.Close(); <-served })
	return f, sock
}

// gone waits until the IS has no replica of key k.
func (f *fixture) gone(t *testing.T, k kvsp.BlockKey) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := f.is.Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: scope, CompatID: compat, BlockKeys: []kvsp.BlockKey{k}})
		if err == nil && resp.Matched == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replica of %x was not withdrawn", k[:2])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestAttachedPagesOtherThanBlocks: pages of 2 tokens (a block spans two,
// out of order) and pages of 8 (a block is half of one, from row 4): the
// holder gathers the block's rows on the device (the stand-in's gather)
// and serves the same container a PUT of that KV would store.
func TestAttachedPagesOtherThanBlocks(t *testing.T) {
	f, sock := startAttached(t)
	row := int64(geom.RawSectionLen()) / int64(geom.BlockTokens)
	for i, c := range []struct {
		pageTokens, pages int
		place             attach.Placement
	}{
		{2, 6, attach.Placement{Pages: []int{4, 1}}},
		{8, 2, attach.Placement{Pages: []int{1}, Offset: 4}},
	} {
		k := byte(10 + i)
		data, blk := makeBlock(uint64(k)+700, 0, 4)
		pool := attach.Pool{Memory: attach.MemoryMemfd, Pages: c.pages, PageTokens: c.pageTokens, PageStride: int64(c.pageTokens) * row}
		pool.VOffset = int64(c.pages) * pool.PageStride
		pool.LayerStride = 2 * pool.VOffset
		pool.Size = int64(geom.Layers) * pool.LayerStride
		mem := make([]byte, pool.Size)
		for l := range int(geom.Layers) {
			kk, vv, _ := blk.Layer(uint32(l))
			for kv, sec := range [][]byte{kk, vv} {
				for tok := range int(geom.BlockTokens) {
					at := c.place.Offset + tok
					off := int64(l)*pool.LayerStride + int64(kv)*pool.VOffset + int64(c.place.Pages[at/c.pageTokens])*pool.PageStride + int64(at%c.pageTokens)*row
					copy(mem[off:off+row], sec[int64(tok)*row:])
				}
			}
		}
		fd, err := unix.MemfdCreate("engine-pool", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		unix.Write(fd, mem)
		e, err := attach.Dial(sock, &attach.Hello{Engine: "paged", CompatID: compat, Pool: pool}, fd)
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		c.place.BlockKey = ref(k).Key
		if err := e.Publish(scope, []attach.Placement{c.place}); err != nil {
			t.Fatal(err)
		}
		if st, _, body := f.raw(t, kvsptest.ClientA, "GET", path(ref(k)), nil, nil); st != 200 || !bytes.Equal(body, data) {
			t.Fatalf("pages of %d tokens: %d, equal to the block's container %v", c.pageTokens, st, bytes.Equal(body, data))
		}
		if n := readAll(t, f.hold[kvsptest.ClientA], ref(k), blk, &kvsp.LayerRange{2, 3}); n != 2 {
			t.Fatalf("pages of %d tokens, layers 2-3: %d sections", c.pageTokens, n)
		}
	}
}

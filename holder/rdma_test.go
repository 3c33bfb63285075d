package holder_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strconv"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/tier"
)

// rdmaFixture is a holder whose blocks can be read by RDMA over an
// in-process fabric, and the instance side's reader on the same fabric.
func rdmaFixture(t *testing.T, capacity int64) (*fixture, *rdma.Reader, *rdma.Fabric) {
	fab := rdma.NewFabric()
	target := rdma.NewTarget(fab.Provider("holder"))
	t.Cleanup(func() { target.Close() })
	f := start(t, capacity, func(c *holder.Config) { c.RDMA = target })
	reader := rdma.NewReader(fab.Provider("instance"))
	t.Cleanup(func() { reader.Close() })
	return f, reader, fab
}

// TestRDMARead: a block and a layer range read by one-sided RDMA READ
// are the octets a GET serves, verified layer by layer and against the
// holder's Repr-Digest (R-BLK-8, R-BLK-9); authorization is a GET's: the
// scope is checked before any probe (R-BLK-13, R-BLK-19).
func TestRDMARead(t *testing.T) {
	f, reader, _ := rdmaFixture(t, 1<<20)
	data, blk := makeBlock(1, 0, 4)
	hc := f.hold[kvsptest.ClientA]
	if err := hc.PutBlock(context.Background(), ref(1), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	got, release, err := hc.ReadBlockRDMA(context.Background(), ref(1), geom, client.GetOptions{LayerDigests: blk.LayerDigests()}, reader)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), data) {
		t.Fatal("the block read by RDMA differs from the one stored")
	}
	release()
	got, release, err = hc.ReadBlockRDMA(context.Background(), ref(1), geom, client.GetOptions{Layers: &kvsp.LayerRange{1, 2}, LayerDigests: blk.LayerDigests()}, reader)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	v, _ := blk.Range(1, 2)
	var want bytes.Buffer
	v.WriteTo(&want)
	if !bytes.Equal(got.Bytes(), want.Bytes()) {
		t.Fatal("layers 1-2 by RDMA differ from the range a GET serves")
	}
	// Another record's digests: refused, as for a GET.
	_, other := makeBlock(2, 0, 4)
	if _, _, err := hc.ReadBlockRDMA(context.Background(), ref(1), geom, client.GetOptions{LayerDigests: other.LayerDigests()}, reader); !errors.Is(err, kvsp.ErrDigestMismatch) {
		t.Fatalf("wrong layer digests: %v", err)
	}
	// A scope the identity lacks: 403 even for a block that does not exist.
	if _, _, err := f.hold["spiffe://kvsp.test/client/nosc"].ReadBlockRDMA(context.Background(), ref(9), geom, client.GetOptions{}, reader); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Fatalf("no scope: %v", err)
	}
	if _, _, err := hc.ReadBlockRDMA(context.Background(), ref(9), geom, client.GetOptions{}, reader); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("missing block: %v", err)
	}
	if _, _, err := hc.ReadBlockRDMA(context.Background(), ref(1), geom, client.GetOptions{Layers: &kvsp.LayerRange{2, 7}}, reader); !errors.Is(err, kvsp.ErrLayersUnavailable) {
		t.Fatalf("layers past the block: %v", err)
	}
	// Bad requests: problem details, nothing exposed.
	for name, body := range map[string]string{
		"endpoint not a queue pair": `{"scope_id":"` + scope.String() + `","compat_id":"` + compat.String() + `","block_key":"` + ref(1).Key.String() + `","endpoint":"garbage"}`,
		"no block key":              `{"scope_id":"` + scope.String() + `","compat_id":"` + compat.String() + `","endpoint":"v1.0001.000001.000001.00000000000000000000000000000000"}`,
		"not JSON":                  `{"scope_id":`,
	} {
		st, hdr, b := f.raw(t, kvsptest.ClientA, "POST", "/h1/rdma/reads", map[string]string{"Content-Type": kvsp.MediaType}, []byte(body))
		if st != 400 || hdr.Get("Content-Type") != kvsp.MediaTypeProblem {
			t.Errorf("%s: %d %s", name, st, b)
		}
	}
	if st, _, _ := f.raw(t, kvsptest.ClientA, "DELETE", "/h1/rdma/reads/nope", nil, nil); st != 404 {
		t.Errorf("DELETE of no exposure: %d", st)
	}
}

// flipReader corrupts what it reads: the client must notice.
type flipReader struct{ *rdma.Reader }

func (r flipReader) Read(ctx context.Context, holder string, dst []byte, addr uint64, rkey uint32) error {
	err := r.Reader.Read(ctx, holder, dst, addr, rkey)
	dst[len(dst)/2] ^= 1
	return err
}

func TestRDMAReadCorruptionDetected(t *testing.T) {
	f, reader, _ := rdmaFixture(t, 1<<20)
	data, blk := makeBlock(3, 0, 4)
	hc := f.hold[kvsptest.ClientA]
	hc.PutBlock(context.Background(), ref(3), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest())
	if _, _, err := hc.ReadBlockRDMA(context.Background(), ref(3), geom, client.GetOptions{}, flipReader{reader}); !errors.Is(err, kvsp.ErrDigestMismatch) {
		t.Fatalf("a flipped bit: %v, want a digest mismatch", err)
	}
}

// expose POSTs rdma/reads as id and decodes the answer.
func expose(t *testing.T, f *fixture, id string, reader *rdma.Reader, r client.BlockRef) (int, kvsp.RDMAReadResponse) {
	ep, _ := reader.Endpoint("h1")
	body, _ := json.Marshal(&kvsp.RDMAReadRequest{ScopeID: r.Scope, CompatID: r.Compat, BlockKey: r.Key, Endpoint: ep})
	code, _, b := f.raw(t, id, "POST", "/h1/rdma/reads", map[string]string{"Content-Type": kvsp.MediaType}, body)
	var x kvsp.RDMAReadResponse
	if code == 201 {
		if err := json.Unmarshal(b, &x); err != nil {
			t.Fatal(err)
		}
		if err := reader.Connect("h1", ep, x.Endpoint); err != nil {
			t.Fatal(err)
		}
	}
	return code, x
}

// bigGeom's blocks (512 KiB) are recycled through the holder's buffer
// pool, as real blocks are.
var (
	bigGeom   = container.Geometry{Layers: 8, BlockTokens: 16, KVHeads: 8, HeadDim: 128, Elem: container.BF16}
	bigCompat = kvsp.CompatID{8}
)

func bigBlock(seed byte) ([]byte, *container.Block) {
	h, _ := container.NewHeader(container.CodecRaw, 0, bigGeom.Layers, bigGeom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	sec := bytes.Repeat([]byte{seed}, int(bigGeom.RawSectionLen()))
	for range bigGeom.Layers {
		w.WriteLayer(sec, sec)
	}
	w.Close()
	b, _ := container.OpenBlock(buf.Bytes(), bigGeom)
	return buf.Bytes(), b
}

// TestRDMAExposureLifetime: an exposed block's memory is not reused
// while exposed, even when the block is evicted meanwhile and another
// block is stored in recycled memory; once its exposure is deleted (only
// by the identity that made it) the octets can no longer be read.
func TestRDMAExposureLifetime(t *testing.T) {
	data, blk := bigBlock(4)
	fab := rdma.NewFabric()
	target := rdma.NewTarget(fab.Provider("holder"))
	t.Cleanup(func() { target.Close() })
	f := start(t, 2*int64(len(data)), func(c *holder.Config) {
		c.RDMA = target
		c.Geometries = map[kvsp.CompatID]container.Geometry{compat: geom, bigCompat: bigGeom}
	})
	reader := rdma.NewReader(fab.Provider("instance"))
	t.Cleanup(func() { reader.Close() })
	hc := f.hold[kvsptest.ClientA]
	bref := func(k byte) client.BlockRef { r := ref(k); r.Compat = bigCompat; return r }
	if err := hc.PutBlock(context.Background(), bref(4), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	code, x := expose(t, f, kvsptest.ClientA, reader, bref(4))
	if code != 201 {
		t.Fatalf("POST rdma/reads: %d", code)
	}
	// Evict it (two more blocks in a two-block holder), then store more,
	// which would take its memory were it free.
	for i := byte(5); i < 9; i++ {
		d, b := bigBlock(i)
		if err := hc.PutBlock(context.Background(), bref(i), bytes.NewReader(d), int64(len(d)), b.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := hc.GetBlock(context.Background(), bref(4), bigGeom, client.GetOptions{}); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("block 4 was not evicted: %v", err)
	}
	addr, _ := strconv.ParseUint(x.Addr, 16, 64)
	hdr, _ := hex.DecodeString(x.Header)
	buf := make([]byte, x.Length)
	if err := reader.Read(context.Background(), "h1", buf, addr, x.RKey); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(append(hdr, buf...), data) {
		t.Fatal("an exposed block's memory was reused after its eviction")
	}
	if code, _, _ := f.raw(t, "spiffe://kvsp.test/client/b", "DELETE", "/h1/rdma/reads/"+x.ID, nil, nil); code != 404 {
		t.Fatalf("DELETE by another identity: %d, want 404", code)
	}
	if code, _, _ := f.raw(t, kvsptest.ClientA, "DELETE", "/h1/rdma/reads/"+x.ID, nil, nil); code != 204 {
		t.Fatalf("DELETE: %d", code)
	}
	if err := reader.Read(context.Background(), "h1", buf, addr, x.RKey); !errors.Is(err, rdma.ErrRemoteAccess) {
		t.Fatalf("a read after DELETE: %v, want a remote access error", err)
	}
	if code, _, _ := f.raw(t, kvsptest.ClientA, "DELETE", "/h1/rdma/reads/"+x.ID, nil, nil); code != 404 {
		t.Fatalf("second DELETE: %d", code)
	}
}

// TestRDMARegistersRecycledMemoryOnce: blocks stored in memory the holder
// recycles are exposed without registering it again (a window per read),
// and the instance reads into its pooled buffer: across a stream of PUTs,
// evictions and RDMA reads, each side registers a handful of buffers,
// not one per block, and no window outlives its read.
func TestRDMARegistersRecycledMemoryOnce(t *testing.T) {
	d0, _ := bigBlock(0)
	fab := rdma.NewFabric()
	hp, ip := fab.Provider("holder"), fab.Provider("instance")
	target := rdma.NewTarget(hp)
	t.Cleanup(func() { target.Close() })
	f := start(t, 2*int64(len(d0)), func(c *holder.Config) {
		c.RDMA = target
		c.Geometries = map[kvsp.CompatID]container.Geometry{compat: geom, bigCompat: bigGeom}
	})
	reader := rdma.NewReader(ip)
	t.Cleanup(func() { reader.Close() })
	hc := f.hold[kvsptest.ClientA]
	bref := func(k byte) client.BlockRef { r := ref(k); r.Compat = bigCompat; return r }
	const blocks = 20
	for i := byte(0); i < blocks; i++ {
		data, blk := bigBlock(i)
		if err := hc.PutBlock(context.Background(), bref(i), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
		got, release, err := hc.ReadBlockRDMA(context.Background(), bref(i), bigGeom, client.GetOptions{LayerDigests: blk.LayerDigests()}, reader)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Bytes(), data) {
			t.Fatalf("block %d read by RDMA differs", i)
		}
		release()
	}
	hmade, _ := hp.Registrations()
	imade, _ := ip.Registrations()
	if hmade > 4 || imade != 1 || hp.Windows() != 0 {
		t.Fatalf("%d blocks: the holder registered %d times (%d windows bound now), the instance %d; want a few, 0, 1", blocks, hmade, hp.Windows(), imade)
	}
	t.Logf("%d blocks read by RDMA: holder registrations %d, instance %d", blocks, hmade, imade)
}

// failingRDMA accepts clients but cannot register memory (as when the
// locked-memory limit is reached).
type failingRDMA struct{ *rdma.Target }

func (failingRDMA) Expose(string, []byte, []byte) (uint64, uint32, func(), error) {
	return 0, 0, nil, errors.New("ibv_reg_mr: cannot allocate memory")
}

// TestRDMARegistrationFails: a block that cannot be registered is a 503
// problem (the client GETs it instead), the server stays up, and the
// block is not left held: it is evicted as any other.
func TestRDMARegistrationFails(t *testing.T) {
	fab := rdma.NewFabric()
	target := rdma.NewTarget(fab.Provider("holder"))
	t.Cleanup(func() { target.Close() })
	d0, _ := bigBlock(0)
	f := start(t, 2*int64(len(d0)), func(c *holder.Config) {
		c.RDMA = failingRDMA{target}
		c.Geometries = map[kvsp.CompatID]container.Geometry{compat: geom, bigCompat: bigGeom}
	})
	reader := rdma.NewReader(fab.Provider("instance"))
	t.Cleanup(func() { reader.Close() })
	hc := f.hold[kvsptest.ClientA]
	bref := func(k byte) client.BlockRef { r := ref(k); r.Compat = bigCompat; return r }
	for i := byte(0); i < 4; i++ {
		d, b := bigBlock(i)
		if err := hc.PutBlock(context.Background(), bref(i), bytes.NewReader(d), int64(len(d)), b.ContainerDigest()); err != nil {
			t.Fatalf("PUT %d: %v", i, err)
		}
		if _, _, err := hc.ReadBlockRDMA(context.Background(), bref(i), bigGeom, client.GetOptions{}, reader); !errors.Is(err, kvsp.ErrUnavailable) {
			t.Fatalf("block %d: %v, want 503 kvsp-unavailable", i, err)
		}
	}
	if _, err := hc.GetBlock(context.Background(), bref(0), bigGeom, client.GetOptions{}); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("block 0 was not evicted after its failed exposure: %v", err)
	}
	// A holder out of queue pairs is unavailable, not the client's fault.
	f3 := start(t, 1<<20, func(c *holder.Config) { c.RDMA = busyRDMA{target} })
	data, blk := makeBlock(5, 0, 4)
	hc3 := f3.hold[kvsptest.ClientA]
	if err := hc3.PutBlock(context.Background(), ref(5), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := hc3.ReadBlockRDMA(context.Background(), ref(5), geom, client.GetOptions{}, reader); !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("no queue pair to give: %v, want 503", err)
	}
}

// busyRDMA has no queue pair to give.
type busyRDMA struct{ *rdma.Target }

func (busyRDMA) Accept(string) (string, error) {
	return "", errors.New("rdma: 4096 queue pairs with reads under way")
}

// TestRDMAFromLocalStorage: a block demoted to local storage is read by
// RDMA from the memory it is read back into, registered for that read
// only: memory that will not come back is not kept registered.
func TestRDMAFromLocalStorage(t *testing.T) {
	disk, err := tier.OpenDisk(tier.DiskConfig{Dir: t.TempDir(), Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	fab := rdma.NewFabric()
	hp := fab.Provider("holder")
	target := rdma.NewTarget(hp)
	t.Cleanup(func() { target.Close() })
	f := start(t, blockSize(), func(c *holder.Config) { c.Disk, c.RDMA = disk, target })
	reader := rdma.NewReader(fab.Provider("instance"))
	t.Cleanup(func() { reader.Close() })
	hc := f.hold[kvsptest.ClientA]
	data, blk := makeBlock(21, 0, 4)
	d2, b2 := makeBlock(22, 0, 4) // demotes block 21 to local storage
	for _, b := range []struct {
		k    byte
		data []byte
		blk  *container.Block
	}{{21, data, blk}, {22, d2, b2}} {
		if err := hc.PutBlock(context.Background(), ref(b.k), bytes.NewReader(b.data), int64(len(b.data)), b.blk.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
	}
	waitDemoted(t, f.reg, 1)
	for range 2 {
		got, release, err := hc.ReadBlockRDMA(context.Background(), ref(21), geom, client.GetOptions{LayerDigests: blk.LayerDigests()}, reader)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Bytes(), data) {
			t.Fatal("the block read back from local storage differs")
		}
		release()
	}
	if s := target.CacheStats(); s.Registrations != 0 || s.HeldBytes != 0 {
		t.Fatalf("blocks read from disk went into the registration cache: %+v", s)
	}
	if _, live := hp.Registrations(); live != 0 {
		t.Fatalf("%d registrations live after the reads", live)
	}
}

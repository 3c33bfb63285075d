package holder_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"runtime"
	"runtime/debug"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/tier"
)

// b12Geom's blocks are 2 MiB, as the red team's (issue 46 D2).
var (
	b12Geom   = container.Geometry{Layers: 32, BlockTokens: 16, KVHeads: 8, HeadDim: 128, Elem: container.BF16}
	b12Compat = kvsp.CompatID{12}
)

func b12Block() ([]byte, *container.Block) {
	h, _ := container.NewHeader(container.CodecRaw, 0, b12Geom.Layers, b12Geom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	for l := range b12Geom.Layers {
		sec := bytes.Repeat([]byte{byte(l), 0x3c}, int(b12Geom.RawSectionLen())/2) // finite bf16 values
		w.WriteLayer(sec, sec)
	}
	w.Close()
	b, _ := container.OpenBlock(buf.Bytes(), b12Geom)
	return buf.Bytes(), b
}

// TestB12_StalledReadsHoldNoMemoryPastTheTier (RELIABILITY B12): a holder
// with a 32 MiB host tier; client B stores 120 blocks of 2 MiB, one after
// another, each PUT evicting the least recently used; client A GETs each
// block as it is stored, on an HTTP/2 connection that grants no window
// (the reads stall, each holding its block), so that B's later PUTs evict
// blocks A's GETs still hold. The memory those GETs hold beyond the tier
// (kvsp_holder_read_held_bytes{kind="evicted"}) never exceeds A's read
// allowance (8 MiB here) by more than the blocks being cut; the heap stays
// within the tier plus the allowance plus slack (the buffer pool, the PUT
// being received, the test's own client); every one of A's reads ends (its
// stream reset) within its write deadline, cut sooner when its block's
// eviction took A past its allowance, or refused with 429 while A was past
// it; B's PUTs and GETs all succeed; afterwards nothing is held.
func TestB12_StalledReadsHoldNoMemoryPastTheTier(t *testing.T) {
	const (
		tierSize  = 32 << 20
		allowance = 8 << 20
		n         = 120
		grace     = 3 * time.Second
		rate      = 4 << 20 // octets/s: a 2 MiB block's own allowance is 0.5 s
		slack     = 3 * time.Second
	)
	// The heap then follows what is live closely: what is measured is
	// memory held, not the collector's pace.
	defer debug.SetGCPercent(debug.SetGCPercent(25))
	f := startWith(t, kvsptest.Options{MinWriteRate: rate, WriteGrace: grace}, tierSize, func(c *holder.Config) {
		c.Geometries = map[kvsp.CompatID]container.Geometry{compat: geom, b12Compat: b12Geom}
		c.MaxReadPerClient = allowance
	})
	bref := func(k int) client.BlockRef { r := refFor(k); r.Compat = b12Compat; return r }
	data, blk := b12Block()
	_, hl, _ := container.ParseHeader(data, b12Geom)
	kv := data[hl:]
	blockMem := (int64(len(data)) + 64<<10 - 1) / (64 << 10) * (64 << 10) // the pool's size class
	heldEvicted := func() float64 {
		return kvsptest.MetricSumFrom(f.reg, "kvsp_holder_read_held_bytes", map[string]string{"kind": "evicted"})
	}
	kvsptest.MetricSum(t, f.reg, "kvsp_holder_read_held_bytes", nil) // registered
	baseHeap := heapInUse()

	var peakHeap, peakEvicted atomic.Int64
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			peakHeap.Store(max(peakHeap.Load(), int64(m.HeapInuse)))
			peakEvicted.Store(max(peakEvicted.Load(), int64(heldEvicted())))
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()

	a := kvsptest.DialStalled(t, f.srv.Addr, f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA)))
	b := f.hold["spiffe://kvsp.test/client/b"]
	start := time.Now()
	for i := range n {
		if err := b.PutBlock(context.Background(), bref(i), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
			t.Fatalf("client B's PUT %d: %v", i, err)
		}
		if err := a.Get(uint32(2*i+1), path(bref(i))); err != nil {
			t.Fatal(err)
		}
		if i%10 == 9 {
			if got, err := fetch(context.Background(), b, bref(i), b12Geom); err != nil || !bytes.Equal(got, kv) {
				t.Fatalf("client B's GET %d: %v", i, err)
			}
		}
	}
	stored := time.Since(start)
	for end := time.Now().Add(grace + slack + 10*time.Second); a.ResetCount() < n && time.Now().Before(end); {
		select {
		case <-a.Changed():
		case <-time.After(100 * time.Millisecond):
		}
	}
	close(stop)
	<-sampled

	limit := grace + time.Duration(float64(len(data))/rate*float64(time.Second)) + slack
	statuses := map[int]int{}
	var worst time.Duration
	never, badCode := 0, 0
	for i := range n {
		status, ok, after, code := a.Stream(uint32(2*i + 1))
		statuses[status]++
		switch {
		case !ok:
			never++
		case code != http2.ErrCodeCancel:
			badCode++
		}
		worst = max(worst, after)
	}
	cut := kvsptest.MetricSum(t, f.reg, "kvsp_holder_gets_cut_total", nil)
	refused := kvsptest.MetricSum(t, f.reg, "kvsp_holder_gets_refused_total", nil)
	heapGrowth := peakHeap.Load() - int64(baseHeap)
	heapLimit := int64(tierSize + allowance + 40<<20)
	t.Logf("%d blocks of %d KiB stored by B in %v; A's %d zero-window GETs answered %v (0: never answered), cut %v, refused %v, each reset within %v (limit %v); "+
		"held beyond the tier by A's reads at most %.1f MiB (allowance %d MiB); heap in use at most %d MiB above its %d MiB baseline (limit %d MiB)",
		n, len(data)>>10, stored.Round(time.Millisecond), n, statuses, cut, refused, worst.Round(time.Millisecond), limit.Round(time.Millisecond),
		float64(peakEvicted.Load())/(1<<20), allowance>>20, heapGrowth>>20, baseHeap>>20, heapLimit>>20)
	if never > 0 || badCode > 0 {
		t.Fatalf("of A's %d stalled GETs, %d were never reset and %d were reset with another code than CANCEL", n, never, badCode)
	}
	if worst > limit {
		t.Errorf("a stalled GET was reset %v after its request, want within %v", worst, limit)
	}
	if statuses[http.StatusOK]+statuses[http.StatusNotFound]+statuses[http.StatusTooManyRequests] != n {
		t.Errorf("A's GETs answered %v, want 200 (stalled), 404 (evicted before its GET began) or 429 (past its allowance)", statuses)
	}
	if bound := allowance + 2*blockMem; peakEvicted.Load() > bound {
		t.Errorf("A's stalled reads held %d MiB of evicted blocks beyond the tier, want at most its allowance of %d MiB and the blocks being cut (%d MiB)",
			peakEvicted.Load()>>20, allowance>>20, bound>>20)
	}
	if cut == 0 {
		t.Error("no GET was cut: the allowance was never reached, and the test proves nothing")
	}
	if heapGrowth > heapLimit {
		t.Errorf("the heap in use grew by %d MiB, want at most the tier, the allowance and slack (%d MiB)", heapGrowth>>20, heapLimit>>20)
	}
	for end := time.Now().Add(5 * time.Second); heldEvicted() > 0 && time.Now().Before(end); {
		time.Sleep(10 * time.Millisecond)
	}
	if ev, cp := heldEvicted(), kvsptest.MetricSum(t, f.reg, "kvsp_holder_read_held_bytes", map[string]string{"kind": "copy"}); ev != 0 || cp != 0 {
		t.Errorf("after the reads ended, held beyond the tier: %v octets evicted, %v copied", ev, cp)
	}
	figures.Report(t, figures.Row{Row: "B12", Inputs: n,
		Held: fmt.Sprintf("%d zero-window GETs of 2 MiB blocks evicted under them: at most %.1f MiB held beyond a 32 MiB tier (allowance %d MiB), heap +%d MiB, each read ended within %v",
			n, float64(peakEvicted.Load())/(1<<20), allowance>>20, heapGrowth>>20, worst.Round(time.Millisecond)),
		Detail: map[string]float64{"gets": n, "evicted_held_peak_bytes": float64(peakEvicted.Load()), "heap_growth_bytes": float64(heapGrowth), "cut": cut, "refused": refused}})
}

// TestReadAllowanceCoversCopies (RELIABILITY B12): a block read back from
// local storage for a GET is memory of its own, held while the client
// reads: it counts against the client's read allowance
// (kvsp_holder_read_held_bytes{kind="copy"}), and a GET whose copy does
// not fit in what is left is refused with 429 and Retry-After before
// anything is read. Another client's GET of the same block, and the same
// client's GET of a block in host memory, are served.
func TestReadAllowanceCoversCopies(t *testing.T) {
	disk, err := tier.OpenDisk(tier.DiskConfig{Dir: t.TempDir(), Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	f := start(t, blockSize(), func(c *holder.Config) { // one block in host memory
		c.Disk, c.MaxReadPerClient = disk, blockSize()*3/2
	})
	a := f.hold[kvsptest.ClientA]
	for k := range 2 {
		data, blk := makeBlock(uint64(k), 0, 4)
		if err := a.PutBlock(context.Background(), refFor(k), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
	}
	waitDemoted(t, f.reg, 1) // block 0 is on disk only
	copied := func() float64 {
		return kvsptest.MetricSum(t, f.reg, "kvsp_holder_read_held_bytes", map[string]string{"kind": "copy"})
	}
	stall := kvsptest.DialStalled(t, f.srv.Addr, f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA)))
	if err := stall.Get(1, pathFor(0)); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(5 * time.Second); copied() == 0 && time.Now().Before(end); {
		time.Sleep(5 * time.Millisecond)
	}
	if got := copied(); got != float64(blockSize()) {
		t.Fatalf("a stalled GET of a block on disk holds %v octets of copies, want its block's %d", got, blockSize())
	}
	st, hdr, body := f.raw(t, kvsptest.ClientA, "GET", pathFor(0), nil, nil)
	if st != http.StatusTooManyRequests || hdr.Get("Retry-After") == "" || !bytes.Contains(body, []byte("allowance")) {
		t.Fatalf("A's second GET from disk, past its allowance: %d %q %s", st, hdr.Get("Retry-After"), body)
	}
	if st, _, _ := f.raw(t, kvsptest.ClientA, "GET", pathFor(1), nil, nil); st != http.StatusOK {
		t.Fatalf("A's GET of a block in host memory: %d, want 200 (it takes nothing from the allowance)", st)
	}
	if st, _, _ := f.raw(t, "spiffe://kvsp.test/client/b", "GET", pathFor(0), nil, nil); st != http.StatusOK {
		t.Fatalf("B's GET from disk: %d, want 200 (A's allowance is A's)", st)
	}
	if n := kvsptest.MetricSum(t, f.reg, "kvsp_holder_gets_refused_total", nil); n != 1 {
		t.Fatalf("%v GETs counted refused, want 1", n)
	}
	stall.Close()
	for end := time.Now().Add(5 * time.Second); copied() != 0 && time.Now().Before(end); {
		time.Sleep(5 * time.Millisecond)
	}
	if got := copied(); got != 0 {
		t.Fatalf("%v octets of copies held after the stalled GET ended", got)
	}
}

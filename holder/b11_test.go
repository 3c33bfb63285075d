package holder_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// fetch GETs a whole block as an instance does and returns its KV octets.
func fetch(ctx context.Context, hc *client.Holder, r client.BlockRef, g container.Geometry) ([]byte, error) {
	s, err := hc.GetBlock(ctx, r, g, client.GetOptions{})
	if err != nil {
		return nil, err
	}
	defer s.Close()
	var out []byte
	for {
		l, err := s.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(append(out, l.K...), l.V...)
	}
}

// heapInUse is the heap in use after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

func percentile(d []time.Duration, p int) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[(len(s)*p+99)/100-1]
}

// TestB11_ZeroWindowBlockGETs (RELIABILITY B11, the variant of block
// GETs): client A opens 4 HTTP/2 connections whose initial stream window
// is 0 and sends 250 block GETs on each (the server's
// MAX_CONCURRENT_STREAMS), 1,000 handlers that can send their headers and
// no DATA. Every one of those streams is reset (CANCEL) within its write
// deadline, the grace plus its block's octets at the minimum rate (plus
// slack for 2 loaded cores), and its handler ends: the server counts
// 1,000 responses cut for a slow reader, and once the resets are in the
// goroutines are back to the baseline but for the attack's 4 idle
// connections, then to the baseline itself once A closes them, as is the
// heap. Client B, well behaved, GETs blocks all along: its latency during
// the attack (p50, p99) stays within twice its baseline, plus a little for
// the scheduler of 2 cores.
func TestB11_ZeroWindowBlockGETs(t *testing.T) {
	const (
		conns   = 4
		streams = 250
		blocks  = 8
		grace   = time.Second
		rate    = 4 << 20 // octets/s: a 512 KiB block's own allowance is 125 ms
		slack   = 3 * time.Second
	)
	f := startWith(t, kvsptest.Options{MinWriteRate: rate, WriteGrace: grace}, 64<<20, func(c *holder.Config) {
		c.Geometries = map[kvsp.CompatID]container.Geometry{compat: geom, bigCompat: bigGeom}
	})
	bref := func(k int) client.BlockRef { r := refFor(k); r.Compat = bigCompat; return r }
	data, blk := bigBlock(7)
	_, hl, _ := container.ParseHeader(data, bigGeom)
	kv := data[hl:]
	a := f.hold[kvsptest.ClientA]
	for k := range blocks {
		if err := a.PutBlock(context.Background(), bref(k), bytes.NewReader(data), int64(len(data)), blk.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
	}
	b := f.hold["spiffe://kvsp.test/client/b"]
	probe := func(i int) (time.Duration, error) {
		t0 := time.Now()
		got, err := fetch(context.Background(), b, bref(i%blocks), bigGeom)
		d := time.Since(t0)
		if err == nil && !bytes.Equal(got, kv) {
			err = fmt.Errorf("client B's GET %d: other octets", i)
		}
		return d, err
	}
	var baseline []time.Duration
	for i := range 60 {
		d, err := probe(i)
		if err != nil {
			t.Fatal(err)
		}
		baseline = append(baseline, d)
	}
	// B's connection stays open, with its idle workers: counted in the
	// baseline.
	baseG := kvsptest.QuietGoroutines()
	baseHeap := heapInUse()
	route := "GET /h1/blocks/{compat}/{scope}/{key}"
	cutBefore := kvsptest.MetricSum(t, f.reg, "kvsp_http_slow_reader_responses_total", map[string]string{"route": route})

	conf := f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA))
	var attack []*kvsptest.StalledH2
	start := time.Now()
	for range conns {
		s := kvsptest.DialStalled(t, f.srv.Addr, conf)
		attack = append(attack, s)
		for i := range streams {
			if err := s.Get(uint32(2*i+1), path(bref(i%blocks))); err != nil {
				t.Fatal(err)
			}
		}
	}
	sent := time.Since(start)
	// B is measured against the stalled state, from when every handler
	// has sent its headers and waits for window, through the resets (the
	// burst of 1,000 requests arriving at once is the cost of any 1,000
	// requests, not of their stalling).
	for end := time.Now().Add(grace + slack); ; {
		n := 0
		for _, s := range attack {
			n += s.Answered()
		}
		if n == conns*streams || time.Now().After(end) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	stalledAt := time.Since(start)
	var during []time.Duration
	probeErrs := 0
	for i := 0; ; i++ {
		n := 0
		for _, s := range attack {
			n += s.ResetCount()
		}
		if n == conns*streams || time.Since(start) > grace+slack+10*time.Second {
			break
		}
		d, err := probe(i)
		if err != nil {
			probeErrs++
			t.Logf("client B's GET during the attack: %v", err)
		}
		during = append(during, d)
	}
	resetAll := time.Since(start)

	// Every stream answered 200 (its headers), then reset within its deadline.
	limit := grace + time.Duration(float64(len(data))/rate*float64(time.Second)) + slack
	var worst time.Duration
	never, badCode, badStatus := 0, 0, 0
	for _, s := range attack {
		for i := range streams {
			status, ok, after, code := s.Stream(uint32(2*i + 1))
			switch {
			case !ok:
				never++
			case code != http2.ErrCodeCancel:
				badCode++
			}
			if status != http.StatusOK {
				badStatus++
			}
			worst = max(worst, after)
		}
	}
	cut := kvsptest.MetricSum(t, f.reg, "kvsp_http_slow_reader_responses_total", map[string]string{"route": route}) - cutBefore
	t.Logf("%d zero-window GETs sent in %v, all stalled after %v; resets awaited for %v, the slowest %v after its request (limit %v); %v counted cut for a slow reader; "+
		"client B: %d GETs before, p50 %v p99 %v; %d during, p50 %v p99 %v, %d failed",
		conns*streams, sent.Round(time.Millisecond), stalledAt.Round(time.Millisecond), resetAll.Round(time.Millisecond), worst.Round(time.Millisecond), limit.Round(time.Millisecond), cut,
		len(baseline), percentile(baseline, 50), percentile(baseline, 99), len(during), percentile(during, 50), percentile(during, 99), probeErrs)
	if never > 0 {
		t.Fatalf("%d of %d zero-window streams never reset (%v after the attack began)", never, conns*streams, resetAll.Round(time.Millisecond))
	}
	if badCode > 0 || badStatus > 0 {
		t.Errorf("%d streams reset with another code than CANCEL, %d answered another status than 200", badCode, badStatus)
	}
	if worst > limit {
		t.Errorf("a stream was reset %v after its request, want within %v", worst, limit)
	}
	if cut != conns*streams {
		t.Errorf("%v responses counted cut for a slow reader, want %d", cut, conns*streams)
	}
	if probeErrs > 0 {
		t.Errorf("%d of client B's GETs failed during the attack", probeErrs)
	}
	if len(during) < 10 {
		t.Errorf("only %d of client B's GETs during the attack", len(during))
	} else {
		// Twice the baseline, plus the scheduler's quantum on 2 loaded
		// cores under -race for p50 and a burst's worth (1,000 handlers
		// ending at once) for p99.
		b50, b99, d50, d99 := percentile(baseline, 50), percentile(baseline, 99), percentile(during, 50), percentile(during, 99)
		if d50 > 2*b50+5*time.Millisecond {
			t.Errorf("client B's p50 %v during the attack, baseline %v", d50, b50)
		}
		if d99 > 2*b99+50*time.Millisecond {
			t.Errorf("client B's p99 %v during the attack, baseline %v", d99, b99)
		}
	}
	// The handlers ended: what is left is A's 4 open connections (their
	// reader and control writer), and their idle workers until they end.
	if n := kvsptest.SettleGoroutines(baseG+conns*2+8, 5*time.Second); n > baseG+conns*2+8 {
		t.Errorf("%d goroutines with the attack's connections open and their streams reset, baseline %d", n, baseG)
	}
	for _, s := range attack {
		s.Close()
	}
	if n := kvsptest.SettleGoroutines(baseG, 5*time.Second); n > baseG {
		t.Errorf("%d goroutines after the attack, baseline %d", n, baseG)
	}
	if h := heapInUse(); h > baseHeap+8<<20 {
		t.Errorf("heap in use %d MiB after the attack, baseline %d MiB", h>>20, baseHeap>>20)
	}
	figures.Report(t, figures.Row{Row: "B11", Inputs: conns * streams,
		Held: fmt.Sprintf("%d zero-window block GETs over %d connections each reset within %v of its request (limit %v); client B's p99 %v during, %v before",
			conns*streams, conns, worst.Round(time.Millisecond), limit.Round(time.Millisecond), percentile(during, 99).Round(100*time.Microsecond), percentile(baseline, 99).Round(100*time.Microsecond)),
		Detail: map[string]float64{"streams": conns * streams, "slowest_reset_ms": float64(worst.Milliseconds()),
			"probe_p99_ms": float64(percentile(during, 99).Microseconds()) / 1000, "probe_p99_baseline_ms": float64(percentile(baseline, 99).Microseconds()) / 1000}})
}

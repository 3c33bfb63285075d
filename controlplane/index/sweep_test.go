package index

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/figures"
)

// massKey is the key of record i of a mass publish (any i up to 2^32).
func massKey(i int) kvsp.BlockKey {
	var k kvsp.BlockKey
	binary.LittleEndian.PutUint32(k[:], uint32(i))
	k[31] = 0xa5
	return k
}

// probe is one lookup of the prober: when it started and how long it took.
type probe struct {
	start time.Time
	d     time.Duration
}

// p99 of the probes that overlap [from, to] (all of them when from is
// zero), and their number.
func p99(ps []probe, from, to time.Time) (time.Duration, int) {
	var ds []time.Duration
	for _, p := range ps {
		if from.IsZero() || (!p.start.Add(p.d).Before(from) && !p.start.After(to)) {
			ds = append(ds, p.d)
		}
	}
	if len(ds) == 0 {
		return 0, 0
	}
	slices.Sort(ds)
	return ds[int(math.Ceil(0.99*float64(len(ds))))-1], len(ds)
}

// TestL3_MassExpiryWithoutFreezing (RELIABILITY.md L3): a holder's 10^5
// records expire together, or are withdrawn at once, while a client looks
// up a live 16-key prefix 100 times a second.
//   - Lookup p99 stays under 50 ms during the sweep (the lookups that
//     overlap it) and over the whole run, and every lookup still matches
//     its 16 live keys.
//   - The expiry sweep is incremental and sharded: it removes the records
//     in batches of at most sweepBatch, at least n/sweepBatch of them, and
//     between two batches no shard is write-locked (checked from the
//     sweeper's own callback, which runs between batches): no global lock
//     is held across the sweep. All records are gone when it ends.
//
// KVSP_L3_RECORDS sets another number of records (default 100000).
func TestL3_MassExpiryWithoutFreezing(t *testing.T) {
	n := 100_000
	if s := os.Getenv("KVSP_L3_RECORDS"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	const (
		mass = "https://mass.example/kvsp/"
		live = "https://live.example/kvsp/"
		rate = 100 // lookups per second
	)
	liveKeys := make([]kvsp.BlockKey, 16)
	for i := range liveKeys {
		liveKeys[i] = key(1000 + i)
	}
	for _, mode := range []string{"expiry", "withdraw"} {
		t.Run(mode, func(t *testing.T) {
			m := NewMemory(20 * time.Millisecond)
			defer m.Close()
			ctx := context.Background()
			for _, k := range liveKeys {
				m.Put(ctx, record(live, k, scopeA, compatX), time.Hour, PutOptions{})
			}
			// The sweeper's batches, and whether a shard was write-locked
			// between two of them.
			var (
				mu       sync.Mutex
				batches  []time.Time
				maxBatch int
				locked   int
			)
			f := func(n int) {
				now := time.Now()
				held := 0
				for i := range m.shards {
					if !m.shards[i].mu.TryRLock() {
						held++
						continue
					}
					m.shards[i].mu.RUnlock()
				}
				mu.Lock()
				batches = append(batches, now)
				maxBatch = max(maxBatch, n)
				locked += held
				mu.Unlock()
			}
			m.onExpire.Store(&f)

			// The mass: all expiring at the same instant, or living an hour.
			begin := time.Now()
			at := begin.Add(time.Hour)
			for i := range n {
				ttl := time.Hour
				if mode == "expiry" {
					if i == 0 {
						at = time.Now().Add(time.Duration(n/10_000+1) * 300 * time.Millisecond)
					}
					ttl = time.Until(at)
				}
				if _, err := m.Put(ctx, record(mass, massKey(i), scopeA, compatX), ttl, PutOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			if mode == "expiry" && !time.Now().Before(at) {
				t.Fatalf("publishing %d records took %v: they expired before the lookups started", n, time.Since(begin))
			}
			t.Logf("%d records published in %v", n, time.Since(begin).Round(time.Millisecond))

			// The prober, 100 lookups a second.
			var probes []probe
			stop, done := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(done)
				tick := time.NewTicker(time.Second / rate)
				defer tick.Stop()
				var res Result
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
					}
					s := time.Now()
					err := m.Lookup(ctx, scopeA, compatX, liveKeys, &res)
					probes = append(probes, probe{s, time.Since(s)})
					if err != nil || len(res.Replicas) != len(liveKeys) {
						t.Errorf("lookup during the sweep: matched %d of %d: %v", len(res.Replicas), len(liveKeys), err)
						return
					}
				}
			}()
			time.Sleep(200 * time.Millisecond) // a baseline before the sweep

			var from, to time.Time
			if mode == "withdraw" {
				// The holder withdraws everything at once: the IS handles its
				// DELETEs concurrently.
				from = time.Now()
				var wg sync.WaitGroup
				for g := range 2 {
					wg.Go(func() {
						for i := g; i < n; i += 2 {
							if err := m.Delete(ctx, mass, massKey(i), nil); err != nil {
								t.Errorf("withdraw %d: %v", i, err)
								return
							}
						}
					})
				}
				wg.Wait()
				to = time.Now()
			} else {
				deadline := at.Add(30 * time.Second)
				for m.Len() > len(liveKeys) && time.Now().Before(deadline) {
					time.Sleep(5 * time.Millisecond)
				}
				mu.Lock()
				from, to = at, at // the sweep: from the common expiry to its last batch
				if len(batches) > 0 {
					to = batches[len(batches)-1]
				}
				mu.Unlock()
			}
			time.Sleep(200 * time.Millisecond) // and after it
			close(stop)
			<-done
			if t.Failed() {
				return
			}

			if got := m.Len(); got != len(liveKeys) {
				t.Fatalf("%d records left after the sweep, want the %d live ones", got, len(liveKeys))
			}
			during, k := p99(probes, from, to)
			all, total := p99(probes, time.Time{}, time.Time{})
			t.Logf("sweep of %d records: %v; lookups: p99 %v over the %d overlapping it, p99 %v over all %d",
				n, to.Sub(from).Round(time.Millisecond), during, k, all, total)
			if during >= 50*time.Millisecond || all >= 50*time.Millisecond {
				t.Errorf("lookup p99 %v during the sweep, %v overall: want < 50 ms", during, all)
			}
			if mode == "expiry" {
				mu.Lock()
				defer mu.Unlock()
				if least := (n + sweepBatch - 1) / sweepBatch; len(batches) < least || maxBatch > sweepBatch {
					t.Errorf("the sweep ran in %d batches of up to %d records; want at least %d of at most %d (incremental)",
						len(batches), maxBatch, least, sweepBatch)
				}
				if locked != 0 {
					t.Errorf("%d shards found write-locked between sweep batches: a lock is held across the sweep", locked)
				}
				t.Logf("expiry swept in %d batches of at most %d records", len(batches), maxBatch)
				figures.Report(t, figures.Row{Row: "L3", Requests: int64(total),
					Held:   fmt.Sprintf("%d records expiring at once swept in %v in %d batches; lookup p99 %v meanwhile", n, to.Sub(from).Round(time.Millisecond), len(batches), during.Round(10*time.Microsecond)),
					Detail: map[string]float64{"records": float64(n), "sweep_ms": float64(to.Sub(from).Milliseconds()), "batches": float64(len(batches)), "p99_ms": float64(during.Microseconds()) / 1000}})
			}
		})
	}
}

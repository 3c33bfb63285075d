package index

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

const (
	benchHolders = 16
	benchChains  = 15625 // x 64 published keys = 1,000,000 replicas
	benchMatched = 64
	benchChain   = 128
)

func benchRecord(chain, i int) *kvsp.ReplicaRecord {
	r := &kvsp.ReplicaRecord{
		CompatID: compatX, ScopeID: scopeA, Holder: fmt.Sprintf("https://holder%02d.example/kvsp/", chain%benchHolders),
		Codec: 1, Size: 2097152, Digest: kvsp.Digest{byte(i)}, TTLMs: 600000,
		LayerDigests: make([]kvsp.LayerDigest, 32),
		Residency: []kvsp.Residency{{Tier: kvsp.TierDevice, Layers: kvsp.LayerRange{0, 15}},
			{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{16, 31}, ReadMbitPerS: 400000}},
	}
	r.BlockKey = chainKey(chain, i)
	return r
}

func chainKey(chain, i int) kvsp.BlockKey {
	var k kvsp.BlockKey
	k[0], k[1], k[2], k[3] = byte(chain), byte(chain>>8), byte(i), byte(i*7)
	k[8], k[9], k[10] = byte(chain*31), byte(i*13), byte(chain>>3^i) // spread over shards
	return k
}

// rawRecordSize is the size of a record's fields as data: the yardstick for
// memory per record (the target is at most 1.5x).
func rawRecordSize(r *kvsp.ReplicaRecord) int {
	n := 32 + 32 + 16 + len(r.Holder) + 2 + 8 + 32 + 32*len(r.LayerDigests) + 8
	for _, e := range r.Residency {
		n += len(e.Tier) + 8 + 8
	}
	return n
}

func fillMillion(tb testing.TB) *Memory {
	m := NewMemory(time.Minute)
	ctx := context.Background()
	for c := 0; c < benchChains; c++ {
		for i := 0; i < benchMatched; i++ {
			m.Put(ctx, benchRecord(c, i), 10*time.Minute, PutOptions{})
		}
	}
	return m
}

// BenchmarkLookupMillion: 1,000,000 replicas across 16 holders; lookups
// of 128-key chains whose first 64 keys match. Reports p50 and p99 over
// the run (the target: p99 at most 20 us in-process) and memory
// per record against the raw size of its fields.
func BenchmarkLookupMillion(b *testing.B) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	m := fillMillion(b)
	defer m.Close()
	runtime.GC()
	runtime.ReadMemStats(&after)
	perRecord := float64(after.HeapAlloc-before.HeapAlloc) / float64(benchChains*benchMatched)
	raw := float64(rawRecordSize(benchRecord(0, 0)))

	chains := make([][]kvsp.BlockKey, 256)
	for c := range chains {
		for i := 0; i < benchChain; i++ {
			chains[c] = append(chains[c], chainKey(c*61%benchChains, i))
		}
	}
	var res Result
	ctx := context.Background()
	lat := make([]time.Duration, 0, 1<<16)
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		t0 := time.Now()
		m.Lookup(ctx, scopeA, compatX, chains[i%len(chains)], &res)
		if len(lat) < cap(lat) {
			lat = append(lat, time.Since(t0))
		}
		if len(res.Replicas) != benchMatched {
			b.Fatalf("matched %d", len(res.Replicas))
		}
		i++
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-us")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-us")
	b.ReportMetric(perRecord, "heap-B/record")
	b.ReportMetric(perRecord/raw, "x-raw-size")
}

// BenchmarkPublish: publishes and refreshes in-process (the target: at
// least 100k records/s).
func BenchmarkPublish(b *testing.B) {
	m := NewMemory(time.Minute)
	defer m.Close()
	ctx := context.Background()
	recs := make([]*kvsp.ReplicaRecord, 1<<16)
	for i := range recs {
		recs[i] = benchRecord(i/64, i%64)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		m.Put(ctx, recs[i%len(recs)], time.Minute, PutOptions{})
		i++
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
}

// BenchmarkRedisLookup: the Redis backend against a local redis-server,
// lookups of 128-key chains with 64 matching, from 1, 4 and 16 parallel
// clients: lookups/s and the CPU per lookup of this process (the IS side)
// and of redis-server. The Redis side's bound is measured in the same
// run: redis-benchmark sending the very MGET a lookup sends (a chain's
// 128 keys) from 4 connections, its redis-server CPU per command
// (benchratio -ref redis-benchmark).
func BenchmarkRedisLookup(b *testing.B) {
	srv := kvsptest.StartRedis(b)
	r, err := NewRedis(context.Background(), RedisConfig{Addrs: []string{srv.Addr}, Password: kvsptest.RedisPassword})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	ctx := context.Background()
	const chains = 500
	for c := 0; c < chains; c++ {
		for i := 0; i < benchMatched; i++ {
			if _, err := r.Put(ctx, benchRecord(c, i), 10*time.Minute, PutOptions{}); err != nil {
				b.Fatal(err)
			}
		}
	}
	keys := make([][]kvsp.BlockKey, chains)
	for c := range keys {
		for i := 0; i < benchChain; i++ {
			keys[c] = append(keys[c], chainKey(c, i))
		}
	}
	lookups := func(b *testing.B, clients, chains int) {
		b.ReportAllocs()
		cpu := kvsptest.NewCPUMeter(srv.Pid())
		cpu.Start()
		var next atomic.Int64
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				var res Result
				for {
					i := int(next.Add(1)) - 1
					if i >= b.N {
						return
					}
					if err := r.Lookup(ctx, scopeA, compatX, keys[i%chains], &res); err != nil || len(res.Replicas) != benchMatched {
						b.Errorf("lookup: %d %v", len(res.Replicas), err)
						return
					}
				}
			})
		}
		wg.Wait()
		cpu.Stop()
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "lookups/s")
		// Where the two cores go: this process (the IS side) and redis-server.
		b.ReportMetric(float64(cpu.Self.Microseconds())/float64(b.N), "is-cpu-us/lookup")
		b.ReportMetric(float64(cpu.Peers.Microseconds())/float64(b.N), "redis-cpu-us/lookup")
	}
	for _, clients := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("clients=%d/kvsp", clients), func(b *testing.B) { lookups(b, clients, chains) })
		if clients != 4 {
			continue
		}
		// Redis's own work for the same MGETs, without this client: a raw
		// RESP client on 4 connections sends each lookup's MGET alone (no
		// TIME), over the same chains.
		b.Run("clients=4/raw-mget", func(b *testing.B) { rawMGETs(b, srv, r.prefix, keys, 4) })
		// The same on one chain (its records in Redis's caches), beside
		// redis-benchmark sending that chain's MGET.
		b.Run("clients=4-hot/kvsp", func(b *testing.B) { lookups(b, 4, 1) })
		b.Run("clients=4-hot/redis-benchmark", func(b *testing.B) {
			bench, err := exec.LookPath("redis-benchmark")
			if err != nil {
				b.Skip("redis-benchmark not installed (redis-tools)")
			}
			var res Result
			args := []string{"-h", "127.0.0.1", "-p", strconv.Itoa(srv.Port), "-a", kvsptest.RedisPassword, "-c", "4", "-n", strconv.Itoa(b.N), "-q", "MGET"}
			args = append(args, res.keyNames(r.prefix, keys[0])...)
			cpu := kvsptest.NewCPUMeter(srv.Pid())
			cpu.Start()
			out, err := exec.Command(bench, args...).CombinedOutput()
			cpu.Stop()
			if err != nil {
				b.Fatalf("redis-benchmark: %v\n%s", err, out)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "lookups/s")
			b.ReportMetric(float64(cpu.Peers.Microseconds())/float64(b.N), "redis-cpu-us/lookup")
		})
	}
}

// rawMGETs sends b.N MGETs of the chains' record keys (in turn) from
// conns connections speaking RESP directly, reading each reply whole, and
// reports redis-server's CPU per MGET.
func rawMGETs(b *testing.B, srv *kvsptest.Redis, prefix string, keys [][]kvsp.BlockKey, conns int) {
	reqs := make([][]byte, len(keys))
	for c, ks := range keys {
		var res Result
		names := res.keyNames(prefix, ks)
		req := fmt.Appendf(nil, "*%d\r\n$4\r\nMGET\r\n", len(names)+1)
		for _, n := range names {
			req = fmt.Appendf(req, "$%d\r\n%s\r\n", len(n), n)
		}
		reqs[c] = req
	}
	cpu := kvsptest.NewCPUMeter(srv.Pid())
	var next atomic.Int64
	var wg sync.WaitGroup
	cs := make([]net.Conn, conns)
	for i := range cs {
		c, err := net.Dial("tcp", srv.Addr)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n", len(kvsptest.RedisPassword), kvsptest.RedisPassword)
		if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || line != "+OK\r\n" {
			b.Fatalf("AUTH: %q %v", line, err)
		}
		cs[i] = c
	}
	b.ResetTimer()
	cpu.Start()
	for _, c := range cs {
		wg.Go(func() {
			br := bufio.NewReaderSize(c, 256<<10)
			for {
				i := int(next.Add(1)) - 1
				if i >= b.N {
					return
				}
				if _, err := c.Write(reqs[i%len(reqs)]); err != nil {
					b.Error(err)
					return
				}
				if n, err := readMGET(br); err != nil || n != benchMatched {
					b.Errorf("MGET: %d values, %v", n, err)
					return
				}
			}
		})
	}
	wg.Wait()
	cpu.Stop()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "lookups/s")
	b.ReportMetric(float64(cpu.Peers.Microseconds())/float64(b.N), "redis-cpu-us/lookup")
}

// readMGET reads an MGET reply (RESP2) and counts its non-nil values.
func readMGET(br *bufio.Reader) (int, error) {
	line, err := br.ReadString('\n')
	if err != nil || len(line) < 3 || line[0] != '*' {
		return 0, fmt.Errorf("reply %q: %v", line, err)
	}
	n, _ := strconv.Atoi(line[1 : len(line)-2])
	found := 0
	for range n {
		line, err := br.ReadString('\n')
		if err != nil || len(line) < 3 || line[0] != '$' {
			return 0, fmt.Errorf("value %q: %v", line, err)
		}
		l, _ := strconv.Atoi(line[1 : len(line)-2])
		if l < 0 {
			continue
		}
		found++
		if _, err := br.Discard(l + 2); err != nil {
			return 0, err
		}
	}
	return found, nil
}

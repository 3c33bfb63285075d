package holder_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/quicbulk"
	"github.com/kvsp/kvsp/server"
)

// benchGeom: 16 tokens x 8 heads x 128 x bf16, 32 layers: 2 MiB blocks.
var benchGeom = container.Geometry{Layers: 32, BlockTokens: 16, KVHeads: 8, HeadDim: 128, Elem: container.BF16}

// benchFixture is a holder on loopback mTLS holding n copies of one 2 MiB
// block (seeded content), for the benchmarks.
type benchFixture struct {
	pki  *kvsptest.PKI
	srv  *kvsptest.Server
	h    *holder.Holder
	data []byte
	blk  *container.Block
	refs []client.BlockRef
}

func benchBlockBytes() ([]byte, *container.Block) {
	hdr, _ := container.NewHeader(container.CodecRaw, 0, 32, benchGeom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, hdr)
	sec := make([]byte, benchGeom.RawSectionLen())
	for i := range sec {
		sec[i] = byte(i * 7)
	}
	for i := 0; i < 32; i++ {
		w.WriteLayer(sec, sec)
	}
	w.Close()
	blk, _ := container.OpenBlock(buf.Bytes(), benchGeom)
	return buf.Bytes(), blk
}

func newBenchFixture(b testing.TB, n int) *benchFixture { return newBenchFixtureCap(b, n, 1<<30) }

// newBenchFixtureCap is a holder of the given host capacity holding n
// blocks.
func newBenchFixtureCap(b testing.TB, n int, capacity int64) *benchFixture {
	return newBenchFixtureOpts(b, n, capacity, kvsptest.Options{})
}

// newBenchFixtureOpts is newBenchFixtureCap with o's NetHTTP2 and
// PlainSockets (the server's HTTP/2 and socket I/O).
func newBenchFixtureOpts(b testing.TB, n int, capacity int64, o kvsptest.Options) *benchFixture {
	f := &benchFixture{pki: kvsptest.NewPKI(b)}
	var err error
	f.h, err = holder.New(holder.Config{Base: "https://127.0.0.1/h1/", Geometries: map[kvsp.CompatID]container.Geometry{{7}: benchGeom},
		Capacity: capacity, LeaseQuota: holder.LeaseQuota{Octets: 1 << 30, MaxTTL: time.Minute, MaxLeases: 16}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { f.h.Close(context.Background()) })
	// HTTP/3 and the bulk path on the UDP port, with quic-go's default
	// (stock) server configuration.
	bulk := &quicbulk.Server{}
	f.srv = kvsptest.StartServer(b, f.pki, kvsptest.Options{HTTP3: true, QUIC: map[string]server.QUICHandler{quicbulk.ALPN: bulk}, NetHTTP2: o.NetHTTP2, PlainSockets: o.PlainSockets}, func(s *server.Server) {
		bulk.Handler = s.Handler()
		f.h.Mount(s.Mount("/h1/"))
	})
	f.data, f.blk = benchBlockBytes()
	setup, _ := client.New(client.Config{TLS: f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA))})
	defer setup.Close()
	for i := 0; i < n; i++ {
		ref := client.BlockRef{Compat: kvsp.CompatID{7}, Scope: mustScope(), Key: kvsp.BlockKey{byte(i), 1}}
		if err := setup.Holder(f.srv.URL("/h1/")).PutBlock(context.Background(), ref, bytes.NewReader(f.data), int64(len(f.data)), f.blk.ContainerDigest()); err != nil {
			b.Fatal(err)
		}
		f.refs = append(f.refs, ref)
	}
	return f
}

// BenchmarkGet: GETs of 2 MiB blocks over loopback mutual TLS, the client
// verifying Repr-Digest and every layer digest as an instance does, over
// HTTP/1.1, HTTP/2, HTTP/3 (h3stock: quic-go's http3 as it comes, one
// connection; h3x4: as kvsp configures it, four connections with
// block-sized windows) and the quicbulk path over one and four
// connections, with 1 and 8 concurrent clients; and a 4-of-32-layer
// range. The bound in the same run: SHA-256 of the block (the client's
// verification alone); BenchmarkQUICBound is QUIC's. Compare against nginx
// with scripts/bench-holder.sh.
func BenchmarkGet(b *testing.B) {
	bf := newBenchFixture(b, 16)
	p, srv, data, blk, refs := bf.pki, bf.srv, bf.data, bf.blk, bf.refs
	const nblocks = 16

	b.Run("bound-sha256", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			sha256.Sum256(data)
		}
	})
	for _, proto := range []string{"http1", "h2", "h3stock", "h3x4", "bulk", "bulkx4"} {
		for _, clients := range []int{1, 8} {
			b.Run(fmt.Sprintf("%s/clients=%d", proto, clients), func(b *testing.B) {
				tls := p.ClientTLS(p.Leaf(kvsptest.ClientA))
				if proto == "http1" {
					tls.NextProtos = []string{"http/1.1"}
				}
				conns := 1
				if proto == "h3x4" || proto == "bulkx4" { // over 4 QUIC connections
					conns = 4
				}
				cfg := client.Config{TLS: tls, HTTP3: proto == "h3stock" || proto == "h3x4", QUICConns: conns}
				if proto == "h3stock" {
					cfg.QUICConfig = &quic.Config{}
				}
				if proto == "bulk" || proto == "bulkx4" {
					cfg.Bulk = &quicbulk.Transport{TLS: tls, Conns: conns}
				}
				c, _ := client.New(cfg)
				defer c.Close()
				hc := c.Holder(srv.URL("/h1/"))
				b.SetBytes(int64(len(data)))
				b.ResetTimer()
				getBlocks(b, hc, refs, blk, clients)
			})
		}
	}
	b.Run("range-4-of-32/http1", func(b *testing.B) {
		tls := p.ClientTLS(p.Leaf(kvsptest.ClientA))
		tls.NextProtos = []string{"http/1.1"}
		c, _ := client.New(client.Config{TLS: tls})
		defer c.Close()
		hc := c.Holder(srv.URL("/h1/"))
		b.SetBytes(int64(len(data))) // per block-equivalent, to compare with the full GET
		for i := 0; b.Loop(); i++ {
			s, err := hc.GetBlock(context.Background(), refs[i%nblocks], benchGeom, client.GetOptions{Layers: &kvsp.LayerRange{8, 11}, LayerDigests: blk.LayerDigests()})
			if err != nil {
				b.Fatal(err)
			}
			for {
				if _, err := s.Next(); err != nil {
					break
				}
			}
			s.Close()
		}
	})
}

// getBlocks GETs b.N blocks of refs (in turn) from clients concurrent
// streams, verifying each layer as an instance does.
func getBlocks(b *testing.B, hc *client.Holder, refs []client.BlockRef, blk *container.Block, clients int) {
	var wg sync.WaitGroup
	work := make(chan int)
	for range clients {
		wg.Go(func() {
			for i := range work {
				s, err := hc.GetBlock(context.Background(), refs[i%len(refs)], benchGeom, client.GetOptions{LayerDigests: blk.LayerDigests(), ReplicaCodec: 1})
				if err != nil {
					b.Error(err)
					return
				}
				for {
					if _, err := s.Next(); err == io.EOF {
						break
					} else if err != nil {
						b.Error(err)
						break
					}
				}
				s.Close()
			}
		})
	}
	for i := 0; i < b.N; i++ {
		work <- i
	}
	close(work)
	wg.Wait()
}

func mustScope() kvsp.ScopeID { s, _ := kvsp.ParseScopeID(kvsptest.Scope); return s }

// BenchmarkPut: PUTs of 2 MiB blocks with Repr-Digest over loopback mTLS
// (HTTP/1.1, one client), the holder validating the container and
// computing every digest before storing (the target: at least 0.6
// of the SHA-256 bound). Blocks go to fresh keys; a small host tier
// evicts as it goes.
func BenchmarkPut(b *testing.B) {
	// A holder in steady state: full (128 blocks in 256 MiB), so every PUT
	// evicts the least recently used block and reuses its memory.
	bf := newBenchFixtureCap(b, 128, 256<<20)
	p, srv, data := bf.pki, bf.srv, bf.data
	d := container.Digests{Container: bf.blk.ContainerDigest()}
	b.Run("bound-sha256", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			sha256.Sum256(data)
		}
	})
	key := 1 << 20
	for _, proto := range []string{"http/1.1", "h2"} {
		tls := p.ClientTLS(p.Leaf(kvsptest.ClientA))
		tls.NextProtos = []string{proto}
		c, _ := client.New(client.Config{TLS: tls})
		defer c.Close()
		hc := c.Holder(srv.URL("/h1/"))
		for _, clients := range []int{1, 2, 4} { // concurrent PUTs
			b.Run(fmt.Sprintf("%s/clients=%d", strings.ReplaceAll(proto, "/", ""), clients), func(b *testing.B) {
				b.SetBytes(int64(len(data)))
				b.SetParallelism(max(1, clients/runtime.GOMAXPROCS(0)))
				var keys atomic.Int64
				keys.Store(int64(key))
				put := func() error {
					k := keys.Add(1)
					ref := client.BlockRef{Compat: kvsp.CompatID{7}, Scope: mustScope(), Key: kvsp.BlockKey{byte(k), byte(k >> 8), byte(k >> 16), 3}}
					return hc.PutBlock(context.Background(), ref, bytes.NewReader(data), int64(len(data)), d.Container)
				}
				cpu := kvsptest.NewCPUMeter()
				cpu.Start()
				if clients == 1 {
					for b.Loop() {
						if err := put(); err != nil {
							b.Fatal(err)
						}
					}
				} else {
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							if err := put(); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				cpu.Stop()
				key = int(keys.Load())
				// Client and server together (one process): 2 cores' worth
				// is 2 / (GB/s).
				b.ReportMetric(cpu.Self.Seconds()/(float64(b.N)*float64(len(data))/1e9), "cpu-s/GB")
			})
		}
	}
}

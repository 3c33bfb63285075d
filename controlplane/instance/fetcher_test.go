package instance

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/quicbulk"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/server"
)

// TestFetcherConformance runs every Fetcher cmd can choose against one
// real holder on loopback (HTTPS and quicbulk on its port, RDMA READ over
// the in-process fabric): a stored block's layers come in order, equal to
// the block, with and without layer digests, counted on the holder under
// the fetcher's own transport (so none fell back unseen); a layer range
// is that range; a block the holder does not have is kvsp.ErrNotFound.
// The RDMA fetcher's stream is a block read whole (its capability, by
// type assertion), and a holder without RDMA is read through its
// fallback.
func TestFetcherConformance(t *testing.T) {
	p := kvsptest.NewPKI(t)
	g := container.Geometry{Layers: 4, BlockTokens: 16, KVHeads: 2, HeadDim: 64, Elem: container.BF16}
	compat := kvsp.CompatID{7}
	scope, _ := kvsp.ParseScopeID(kvsptest.Scope)
	fab := rdma.NewFabric()
	target := rdma.NewTarget(fab.Provider("h1"))
	t.Cleanup(func() { target.Close() })
	reg := prometheus.NewRegistry()
	newHolder := func(base string, x holder.RDMA, reg prometheus.Registerer) *holder.Holder {
		h, err := holder.New(holder.Config{Base: "https://127.0.0.1" + base, Geometries: map[kvsp.CompatID]container.Geometry{compat: g},
			Capacity: 64 << 20, LeaseQuota: holder.LeaseQuota{Octets: 1 << 20, MaxTTL: time.Minute, MaxLeases: 16}, RDMA: x, Registerer: reg})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close(context.Background()) })
		return h
	}
	h1, h2 := newHolder("/h1/", target, reg), newHolder("/h2/", nil, nil) // h2: no RDMA
	bulk := &quicbulk.Server{}
	srv := kvsptest.StartServer(t, p, kvsptest.Options{QUIC: map[string]server.QUICHandler{quicbulk.ALPN: bulk}}, func(s *server.Server) {
		bulk.Handler = s.Handler()
		h1.Mount(s.Mount("/h1/"))
		h2.Mount(s.Mount("/h2/"))
	})
	tlsConf := p.ClientTLS(p.Leaf(kvsptest.ClientA))
	mk := func(cfg client.Config) *client.Client {
		cfg.TLS = tlsConf
		c, err := client.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	https := mk(client.Config{})
	viaBulk := mk(client.Config{Bulk: &quicbulk.Transport{TLS: tlsConf, Conns: 1}})
	reader := rdma.NewReader(fab.Provider("ii1"))
	t.Cleanup(func() { reader.Close() })

	// One block at both holders.
	var buf bytes.Buffer
	hd, _ := container.NewHeader(container.CodecRaw, 0, g.Layers, g)
	w := container.NewWriter(&buf, hd)
	for l := range int(g.Layers) {
		sec := bytes.Repeat([]byte{byte(l + 1)}, int(g.RawSectionLen()))
		w.WriteLayer(sec, append(sec[:0:0], bytes.Repeat([]byte{byte(0x80 + l)}, len(sec))...))
	}
	w.Close()
	blk, err := container.ReadBlock(bytes.NewReader(buf.Bytes()), int64(buf.Len()), g)
	if err != nil {
		t.Fatal(err)
	}
	ref := client.BlockRef{Compat: compat, Scope: scope, Key: kvsp.BlockKey{1}}
	for _, base := range []string{"/h1/", "/h2/"} {
		if err := https.Holder(srv.URL(base)).PutBlock(context.Background(), ref, bytes.NewReader(buf.Bytes()), int64(buf.Len()), blk.ContainerDigest()); err != nil {
			t.Fatal(err)
		}
	}

	served := func(proto string) float64 { // 0 before anything was served
		mfs, _ := reg.Gather()
		var n float64
		for _, mf := range mfs {
			if mf.GetName() != "kvsp_holder_bytes_served_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "proto" && l.GetValue() == proto {
						n += m.GetCounter().GetValue()
					}
				}
			}
		}
		return n
	}
	fetchers := []struct {
		name  string
		f     Fetcher
		proto string // what h1 counts the fetcher's octets under
		whole bool
	}{
		{"GET over HTTPS", GetFetcher{Client: https}, "HTTP/2.0", false},
		{"GET over quicbulk", GetFetcher{Client: viaBulk}, "KVSP-BULK/1", false},
		{"RDMA READ", RDMAFetcher{Client: https, Reader: reader, Fallback: GetFetcher{Client: https}}, "rdma", true},
	}
	ctx := context.Background()
	for _, fc := range fetchers {
		t.Run(fc.name, func(t *testing.T) {
			for _, digests := range [][]container.Digest{blk.LayerDigests(), nil} {
				before := served(fc.proto)
				s, err := fc.f.Fetch(ctx, srv.URL("/h1/"), ref, g, client.GetOptions{LayerDigests: digests, ReplicaCodec: container.CodecRaw})
				if err != nil {
					t.Fatalf("fetch (layer digests %v): %v", digests != nil, err)
				}
				if _, ok := s.(wholeBlock); ok != fc.whole {
					t.Errorf("read whole: %v, want %v", ok, fc.whole)
				}
				readAll(t, s, blk, 0, g.Layers-1)
				// Counted when the holder's handler returns, maybe after the body was read.
				kvsptest.WaitFor(t, "the octets served counted as "+fc.proto, func() bool { return served(fc.proto)-before >= float64(len(buf.Bytes()))/2 })
				if got := served(fc.proto) - before; got < float64(len(buf.Bytes()))/2 {
					t.Errorf("%v octets served as %s: the fetch went another way", got, fc.proto)
				}
			}
			rg := kvsp.LayerRange{1, 2}
			s, err := fc.f.Fetch(ctx, srv.URL("/h1/"), ref, g, client.GetOptions{Layers: &rg, ReplicaCodec: container.CodecRaw})
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, s, blk, 1, 2)
			missing := client.BlockRef{Compat: compat, Scope: scope, Key: kvsp.BlockKey{2}}
			if _, err := fc.f.Fetch(ctx, srv.URL("/h1/"), missing, g, client.GetOptions{}); !errors.Is(err, kvsp.ErrNotFound) {
				t.Errorf("a block the holder lacks: %v, want kvsp.ErrNotFound", err)
			}
			// A holder without RDMA: the RDMA fetcher's fallback.
			s, err = fc.f.Fetch(ctx, srv.URL("/h2/"), ref, g, client.GetOptions{LayerDigests: blk.LayerDigests()})
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, s, blk, 0, g.Layers-1)
		})
	}
}

// readAll reads a fetched stream to its end: layers first..last of blk,
// in order, then io.EOF.
func readAll(t *testing.T, s Layers, blk *container.Block, first, last uint32) {
	t.Helper()
	defer s.Close()
	want := first
	for {
		l, err := s.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("layer %d: %v", want, err)
		}
		k, v, _ := blk.Layer(l.Index)
		if l.Index != want || !bytes.Equal(l.K, k) || !bytes.Equal(l.V, v) {
			t.Fatalf("layer %d: got layer %d, equal %v", want, l.Index, bytes.Equal(l.K, k) && bytes.Equal(l.V, v))
		}
		want++
	}
	if want != last+1 {
		t.Fatalf("the stream ended after layer %d, want %d", int(want)-1, last)
	}
}

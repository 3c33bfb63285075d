package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/chart"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/pki"
	"github.com/kvsp/kvsp/quicbulk"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/server"
)

const benchUsage = `kvsp bench: the layer-streaming benchmark

Block GETs as an instance makes them (every layer verified against its
digest as it arrives, Repr-Digest at the end), for each transport, block
size, layer range and number of concurrent streams. By default it starts a
holder in this process on loopback (mutual TLS; HTTP/1.1, HTTP/2, HTTP/3
and quicbulk on one port); with --holder it measures a running holder.

Usage: kvsp bench [flags]
`

// benchConfig is what one run measures.
type benchConfig struct {
	transports []string
	sizes      []int // block payload octets (self-started holder)
	streams    []int
	layers     []string // "all" or "a-b"
	duration   time.Duration
	quicConns  int
	rdmaDevice string
	jsonPath   string
	pngPath    string
	// A running holder.
	holderURL, configPath, descriptor string
}

// benchResult is one measured point.
type benchResult struct {
	Transport   string  `json:"transport"`
	BlockOctets int     `json:"block_octets"`
	Layers      string  `json:"layers"`
	Streams     int     `json:"streams"`
	GETs        int     `json:"gets"`
	Octets      int64   `json:"octets"` // KV payload received and verified
	Seconds     float64 `json:"seconds"`
	GBPerS      float64 `json:"gb_per_s"`
	// FirstLayerP50Us/P99Us: from sending the GET to the first layer
	// verified; PerLayerUs: mean time per further layer.
	FirstLayerP50Us float64 `json:"first_layer_p50_us"`
	FirstLayerP99Us float64 `json:"first_layer_p99_us"`
	PerLayerUs      float64 `json:"per_layer_us"`
	Errors          int     `json:"errors"`
	FirstError      string  `json:"first_error,omitempty"`
}

// benchReport is the JSON the run writes.
type benchReport struct {
	Date        string  `json:"date"`
	GoVersion   string  `json:"go_version"`
	CPUs        int     `json:"cpus"`
	Holder      string  `json:"holder"`
	BoundSHA256 float64 `json:"bound_sha256_gb_per_s"` // the client's verification alone, one core
	// BoundQUIC and BoundQUICVerified: quic-go alone (no HTTP, no kvsp) on
	// the largest blocks, 8 streams over 4 connections, reading only and
	// reading and hashing as verification does: the ceiling of h3 and
	// quicbulk (self-started holder, when either is measured).
	BoundQUIC         float64       `json:"bound_quic_gb_per_s,omitempty"`
	BoundQUICVerified float64       `json:"bound_quic_verified_gb_per_s,omitempty"`
	UDPBuffers        string        `json:"udp_buffers,omitempty"`
	Results           []benchResult `json:"results"`
}

var benchTransports = []string{"http1", "h2", "h3", "h3-stock", "quicbulk", "rdma"}

func parseBenchFlags(args []string, stderr io.Writer) (*benchConfig, error) {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, benchUsage); fs.PrintDefaults() }
	transports := fs.String("transports", "http1,h2,h3,h3-stock,quicbulk", "transports to measure: http1, h2, h3 (as kvsp configures it: 4 connections, block-sized windows), h3-stock (quic-go's http3 as it comes: the baseline of quicbulk), quicbulk, rdma (one-sided READ on a verbs device: a binary built with -tags rdma)")
	rdmaDevice := fs.String("rdma-device", "", "the verbs device of the rdma transport (default: the first)")
	sizes := fs.String("sizes", "256KiB,1MiB,4MiB,16MiB", "block sizes (KV payload; multiples of 128 KiB; self-started holder only)")
	streams := fs.String("streams", "1,8,64", "numbers of concurrent streams")
	layers := fs.String("layers", "all,0-7", `layer ranges: "all" or a-b (of the 32 layers of the self-started holder's blocks)`)
	duration := fs.Duration("duration", time.Second, "time per measured point")
	conns := fs.Int("quic-conns", 0, "QUIC connections per holder for h3 and quicbulk (default 4; h3-stock has 1)")
	jsonPath := fs.String("json", "kvsp-bench.json", "JSON report")
	pngPath := fs.String("png", "kvsp-bench.png", "PNG chart: bandwidth against block size, one line per transport")
	holderURL := fs.String("holder", "", "a running holder's base URI (with --config and --descriptor)")
	cfgPath := fs.String("config", "", "a kvsp configuration: its client certificate and first scope key are used")
	descriptor := fs.String("descriptor", "", "a descriptor the running holder stores (its geometry sets the block size)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, usageError("bench: %v", err)
	}
	bc := &benchConfig{rdmaDevice: *rdmaDevice, duration: *duration, quicConns: *conns, jsonPath: *jsonPath, pngPath: *pngPath,
		holderURL: *holderURL, configPath: *cfgPath, descriptor: *descriptor}
	for _, t := range strings.Split(*transports, ",") {
		if !slices.Contains(benchTransports, t) {
			return nil, usageError("bench: --transports: %q is not one of %s", t, strings.Join(benchTransports, ", "))
		}
		bc.transports = append(bc.transports, t)
	}
	for _, s := range strings.Split(*sizes, ",") {
		n, err := config.ParseSize(s)
		if err != nil || n == 0 || n%(128<<10) != 0 || n > 64<<20 {
			return nil, usageError("bench: --sizes: %q: want a multiple of 128KiB up to 64MiB", s)
		}
		bc.sizes = append(bc.sizes, int(n))
	}
	for _, s := range strings.Split(*streams, ",") {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 1024 {
			return nil, usageError("bench: --streams: %q: want 1 to 1024", s)
		}
		bc.streams = append(bc.streams, n)
	}
	for _, l := range strings.Split(*layers, ",") {
		if l != "all" {
			if _, _, err := parseLayerArg(l); err != nil {
				return nil, usageError("bench: --layers: %q: want all or a-b", l)
			}
		}
		bc.layers = append(bc.layers, l)
	}
	if bc.duration <= 0 {
		return nil, usageError("bench: --duration must be positive")
	}
	if (bc.holderURL != "") != (bc.configPath != "") || (bc.holderURL != "") != (bc.descriptor != "") {
		return nil, usageError("bench: --holder, --config and --descriptor go together")
	}
	return bc, nil
}

func parseLayerArg(s string) (uint32, uint32, error) {
	a, b, ok := strings.Cut(s, "-")
	x, err1 := strconv.ParseUint(a, 10, 32)
	y, err2 := strconv.ParseUint(b, 10, 32)
	if !ok || err1 != nil || err2 != nil || x > y {
		return 0, 0, errors.New("want a-b")
	}
	return uint32(x), uint32(y), nil
}

// benchTarget is a holder with blocks to GET.
type benchTarget struct {
	base   string
	tls    *tls.Config
	scope  kvsp.ScopeID
	sets   []blockSet
	reader *rdma.Reader // the rdma transport's, when measured
	closer func()
	// quicBound is the self-started holder's address, which also serves
	// the QUIC bound ("" for a running holder).
	quicBound string
}

// blockSet is the blocks of one size.
type blockSet struct {
	octets int // KV payload
	g      container.Geometry
	compat kvsp.CompatID
	keys   []kvsp.BlockKey
	blk    *container.Block // every block of the set has its content
}

func cmdBench(args []string, stdout, stderr io.Writer) error {
	bc, err := parseBenchFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	ctx := context.Background()
	var tgt *benchTarget
	if bc.holderURL == "" {
		tgt, err = startBenchHolder(bc)
	} else {
		tgt, err = remoteBenchHolder(bc)
	}
	if err != nil {
		return err
	}
	defer tgt.closer()
	rep := benchReport{Date: time.Now().UTC().Format(time.RFC3339), GoVersion: runtime.Version(), CPUs: runtime.GOMAXPROCS(0), Holder: tgt.base}
	rep.BoundSHA256 = sha256Bound(tgt.sets[len(tgt.sets)-1].blk)
	fmt.Fprintf(stderr, "holder %s; bound: SHA-256 %.2f GB/s on one core (the verification alone)\n", tgt.base, rep.BoundSHA256)
	if tgt.quicBound != "" && slices.ContainsFunc(bc.transports, func(t string) bool { return strings.HasPrefix(t, "h3") || t == "quicbulk" }) {
		set := tgt.sets[len(tgt.sets)-1]
		if rep.BoundQUIC, rep.BoundQUICVerified, err = quicBound(tgt.quicBound, tgt.tls, set.octets, bc.duration); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "bound: QUIC alone (quic-go, no HTTP, %s streams) %.2f GB/s, %.2f GB/s with the verification's hashing\n", sizeName(set.octets), rep.BoundQUIC, rep.BoundQUICVerified)
	}

	type point struct {
		tr     string
		set    *blockSet
		layers string
		n      int
	}
	var points []point
	for _, tr := range bc.transports {
		for i := range tgt.sets {
			for _, l := range bc.layers {
				for _, n := range bc.streams {
					points = append(points, point{tr, &tgt.sets[i], l, n})
				}
			}
		}
	}
	clients := map[string]*client.Client{}
	var bulkTr *quicbulk.Transport
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	for i, p := range points {
		c := clients[p.tr]
		if c == nil {
			var bulk *quicbulk.Transport
			c, bulk, err = benchClient(p.tr, tgt.tls, bc.quicConns)
			if err != nil {
				return err
			}
			clients[p.tr] = c
			if bulk != nil {
				bulkTr = bulk
			}
		}
		fetch := streamGET(c.Holder(tgt.base))
		if p.tr == "rdma" {
			fetch = rdmaRead(c.Holder(tgt.base), tgt.reader)
		}
		r := measure(ctx, fetch, tgt.scope, p.set, p.layers, p.n, bc.duration)
		r.Transport = p.tr
		rep.Results = append(rep.Results, r)
		fmt.Fprintf(stderr, "\r\033[K[%d/%d] %-8s %6s layers=%-4s streams=%-3d %6.3f GB/s", i+1, len(points), p.tr, sizeName(p.set.octets), p.layers, p.n, r.GBPerS)
		if r.Errors > 0 {
			fmt.Fprintf(stderr, " (%d errors: %s)\n", r.Errors, shortErr(r.FirstError))
		}
	}
	fmt.Fprintln(stderr)
	if bulkTr != nil {
		rep.UDPBuffers = bulkTr.BufferReport().String()
	}
	writeBenchTable(stdout, &rep)
	if err := writeJSONReport(stdout, bc.jsonPath, &rep); err != nil {
		return err
	}
	if bc.pngPath != "" {
		if err := writeBenchChart(bc.pngPath, &rep); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s\n", bc.pngPath)
	}
	return nil
}

// writeJSONReport writes v, indented, to path (nothing when path is
// empty) and says so on w.
func writeJSONReport(w io.Writer, path string, v any) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(w, "wrote %s\n", path)
	return nil
}

// benchGeometry is a 32-layer geometry (8 KV heads of 128, bf16: 128 KiB
// of KV per token across the layers) whose blocks carry octets of KV.
func benchGeometry(octets int) container.Geometry {
	return container.Geometry{Layers: 32, BlockTokens: uint32(octets / (128 << 10)), KVHeads: 8, HeadDim: 128, Elem: container.BF16}
}

// benchBlock is a block of g with seeded content.
func benchBlock(g container.Geometry, seed byte) (*container.Block, error) {
	hdr, err := container.NewHeader(container.CodecRaw, 0, g.Layers, g)
	if err != nil {
		return nil, err
	}
	var buf strings.Builder
	buf.Grow(int(hdr.Size()))
	w := container.NewWriter(&buf, hdr)
	k, v := make([]byte, g.RawSectionLen()), make([]byte, g.RawSectionLen())
	for l := range g.Layers {
		for i := range k {
			k[i], v[i] = byte(i*7)^seed^byte(l), byte(i*13)+seed
		}
		if err := w.WriteLayer(k, v); err != nil {
			return nil, err
		}
	}
	if _, err := w.Close(); err != nil {
		return nil, err
	}
	return container.OpenBlock([]byte(buf.String()), g)
}

// blocksPerSet: enough distinct blocks that streams do not all read one,
// within about 256 MiB per size.
func blocksPerSet(octets int) int { return max(4, min(16, (256<<20)/octets)) }

// startBenchHolder starts a holder in this process on loopback: a fresh
// CA, mutual TLS, HTTP/1.1, HTTP/2, HTTP/3 and quicbulk on one port.
func startBenchHolder(bc *benchConfig) (*benchTarget, error) {
	dir, err := os.MkdirTemp("", "kvsp-bench-")
	if err != nil {
		return nil, err
	}
	cleanup := []func(){func() { os.RemoveAll(dir) }}
	fail := func(err error) (*benchTarget, error) {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
		return nil, err
	}
	ca, err := pki.NewCA("kvsp bench CA", 24*time.Hour)
	if err != nil {
		return fail(err)
	}
	srvLeaf, err := ca.Issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.bench/holder"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		return fail(err)
	}
	cliLeaf, err := ca.Issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.bench/client"}})
	if err != nil {
		return fail(err)
	}
	path := func(n string) string { return filepath.Join(dir, n) }
	if err := errors.Join(ca.WriteFiles(path("ca.pem"), path("ca.key")), srvLeaf.WriteFiles(path("server.pem"), path("server.key"))); err != nil {
		return fail(err)
	}
	sk, err := kvsp.GenerateScopeKey()
	if err != nil {
		return fail(err)
	}
	scope := sk.ID()
	policy := "principals:\n  - {id: \"spiffe://kvsp.bench/client\", roles: [client, producer], scopes: [" + scope.String() + "]}\n"
	if err := os.WriteFile(path("policy.yaml"), []byte(policy), 0o600); err != nil {
		return fail(err)
	}
	log := slog.New(slog.DiscardHandler)
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: path("server.pem"), Key: path("server.key"), ClientCA: path("ca.pem")}, log)
	if err != nil {
		return fail(err)
	}
	pol, err := server.LoadPolicyStore(path("policy.yaml"), log)
	if err != nil {
		return fail(err)
	}
	tgt := &benchTarget{scope: scope}
	geoms := map[kvsp.CompatID]container.Geometry{}
	var total int64
	for i, octets := range bc.sizes {
		g := benchGeometry(octets)
		set := blockSet{octets: octets, g: g, compat: kvsp.CompatID{0xbe, byte(i)}}
		geoms[set.compat] = g
		total += int64(blocksPerSet(octets)) * int64(octets+octets/8)
		tgt.sets = append(tgt.sets, set)
	}
	hcfg := holder.Config{Base: "https://127.0.0.1/h1/", Geometries: geoms, Capacity: total + 64<<20,
		LeaseQuota: holder.LeaseQuota{Octets: 1 << 30, MaxTTL: time.Minute, MaxLeases: 16}}
	if slices.Contains(bc.transports, "rdma") {
		v, err := rdma.OpenVerbs(bc.rdmaDevice)
		if err != nil {
			return fail(fmt.Errorf("bench: the rdma transport: %w", err))
		}
		target := rdma.NewTarget(v)
		tgt.reader = rdma.NewReader(v)
		cleanup = append(cleanup, func() { tgt.reader.Close(); target.Close(); v.Close() })
		hcfg.RDMA = target
	}
	h, err := holder.New(hcfg)
	if err != nil {
		return fail(err)
	}
	cleanup = append(cleanup, func() { h.Close(context.Background()) })
	bulk := &quicbulk.Server{}
	bound := &quicBoundServer{data: make([]byte, 1<<20)}
	srv, err := server.New(server.Config{Credentials: creds, Policy: pol, HTTP3: true,
		QUIC: map[string]server.QUICHandler{quicbulk.ALPN: bulk, quicBoundALPN: bound}, QUICConfig: quicbulk.DefaultConfig()})
	if err != nil {
		return fail(err)
	}
	bulk.Handler = srv.Handler()
	if err := h.Mount(srv.Mount("/h1/")); err != nil {
		return fail(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	done := make(chan struct{})
	go func() { srv.Serve(ln); close(done) }()
	cleanup = append(cleanup, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		<-done
	})
	tgt.base = "https://" + ln.Addr().String() + "/h1/"
	tgt.quicBound = ln.Addr().String()
	tgt.tls = &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: ca.Pool(), Certificates: []tls.Certificate{cliLeaf.TLSCertificate()}}
	tgt.closer = func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}
	if err := fillBenchHolder(tgt); err != nil {
		tgt.closer()
		return nil, err
	}
	return tgt, nil
}

// remoteBenchHolder measures a running holder: its client certificate and
// first scope key from a kvsp configuration, the block geometry from a
// descriptor the holder stores. The blocks it PUTs (random keys) stay
// until the holder evicts them.
func remoteBenchHolder(bc *benchConfig) (*benchTarget, error) {
	cfg, err := config.Load(bc.configPath)
	if err != nil {
		return nil, err
	}
	if len(cfg.ScopeKeys) == 0 {
		return nil, errors.New("bench: the configuration names no scope key")
	}
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: cfg.TLS.ClientCert, Key: cfg.TLS.ClientKey, ClientCA: cfg.TLS.ClientCA}, nil)
	if err != nil {
		return nil, fmt.Errorf("config: tls.client_cert: %w", err)
	}
	g, compat, err := descriptorGeometry(bc.descriptor)
	if err != nil {
		return nil, err
	}
	if err := kvsp.ValidateBaseURI("--holder", bc.holderURL); err != nil {
		return nil, err
	}
	octets := int(2 * uint64(g.Layers) * g.RawSectionLen())
	tgt := &benchTarget{base: bc.holderURL, tls: mtls.ClientTLSConfig(creds), scope: cfg.ScopeKeys[0].ID,
		sets: []blockSet{{octets: octets, g: g, compat: compat}}, closer: func() {}}
	if slices.Contains(bc.transports, "rdma") {
		v, err := rdma.OpenVerbs(bc.rdmaDevice)
		if err != nil {
			return nil, fmt.Errorf("bench: the rdma transport: %w", err)
		}
		tgt.reader = rdma.NewReader(v)
		tgt.closer = func() { tgt.reader.Close(); v.Close() }
	}
	if err := fillBenchHolder(tgt); err != nil {
		tgt.closer()
		return nil, err
	}
	return tgt, nil
}

// fillBenchHolder PUTs each set's blocks (random keys, one content per
// set) over HTTP/2.
func fillBenchHolder(tgt *benchTarget) error {
	c, err := client.New(client.Config{TLS: tgt.tls})
	if err != nil {
		return err
	}
	defer c.Close()
	hc := c.Holder(tgt.base)
	for i := range tgt.sets {
		set := &tgt.sets[i]
		if set.blk, err = benchBlock(set.g, byte(i)); err != nil {
			return err
		}
		data := set.blk.Bytes()
		for range blocksPerSet(set.octets) {
			var key kvsp.BlockKey
			rand.Read(key[:])
			ref := client.BlockRef{Compat: set.compat, Scope: tgt.scope, Key: key}
			if err := hc.PutBlock(context.Background(), ref, bytes.NewReader(data), int64(len(data)), set.blk.ContainerDigest()); err != nil {
				return fmt.Errorf("bench: storing the %s blocks: %w", sizeName(set.octets), err)
			}
			set.keys = append(set.keys, key)
		}
	}
	return nil
}

// benchClient is a client whose block GETs go over transport tr.
func benchClient(tr string, tc *tls.Config, conns int) (*client.Client, *quicbulk.Transport, error) {
	tc = tc.Clone()
	cfg := client.Config{TLS: tc}
	var bulk *quicbulk.Transport
	switch tr {
	case "http1":
		tc.NextProtos = []string{"http/1.1"}
	case "h3": // as kvsp serve's transport h3 configures it
		cfg.HTTP3, cfg.QUICConns = true, cmp.Or(conns, 4)
	case "h3-stock": // quic-go's http3 as it comes: one connection, stock windows
		cfg.HTTP3, cfg.QUICConns, cfg.QUICConfig = true, 1, &quic.Config{}
	case "quicbulk":
		bulk = &quicbulk.Transport{TLS: tc, Conns: max(conns, 4)}
		if conns > 0 {
			bulk.Conns = conns
		}
		cfg.Bulk = bulk
	}
	c, err := client.New(cfg)
	return c, bulk, err
}

// fetchFunc fetches one block (or range) verified, and says when its
// first layer was usable, how many layers and KV octets it had.
type fetchFunc func(ctx context.Context, ref client.BlockRef, g container.Geometry, o client.GetOptions) (first time.Time, layers int, octets int64, err error)

// streamGET is a verified GET: layers are usable one by one as they
// arrive.
func streamGET(hc *client.Holder) fetchFunc {
	return func(ctx context.Context, ref client.BlockRef, g container.Geometry, o client.GetOptions) (time.Time, int, int64, error) {
		var first time.Time
		var octets int64
		n := 0
		s, err := hc.GetBlock(ctx, ref, g, o)
		if err != nil {
			return first, 0, 0, err
		}
		defer s.Close()
		for {
			l, err := s.Next()
			if err == io.EOF {
				return first, n, octets, nil
			}
			if err != nil {
				return first, n, octets, err
			}
			if n == 0 {
				first = time.Now()
			}
			n++
			octets += int64(len(l.K) + len(l.V))
		}
	}
}

// rdmaRead is a verified RDMA READ: the layers are usable once all are
// there.
func rdmaRead(hc *client.Holder, r client.RDMAReader) fetchFunc {
	return func(ctx context.Context, ref client.BlockRef, g container.Geometry, o client.GetOptions) (time.Time, int, int64, error) {
		blk, release, err := hc.ReadBlockRDMA(ctx, ref, g, o, r)
		if err != nil {
			return time.Time{}, 0, 0, err
		}
		defer release()
		return time.Now(), blk.Header().LayerCount(), int64(blk.PayloadSize()), nil
	}
}

// measure fetches blocks of set from n streams for d, verifying every
// layer, and times the first layer and the rest.
func measure(ctx context.Context, fetch fetchFunc, scope kvsp.ScopeID, set *blockSet, layers string, n int, d time.Duration) benchResult {
	r := benchResult{BlockOctets: set.octets, Layers: layers, Streams: n}
	var rng *kvsp.LayerRange
	if layers != "all" {
		a, b, _ := parseLayerArg(layers)
		if b >= set.g.Layers {
			r.Errors, r.FirstError = 1, fmt.Sprintf("layers %s: the blocks have %d", layers, set.g.Layers)
			return r
		}
		rng = &kvsp.LayerRange{a, b}
	}
	var (
		mu        sync.Mutex
		first     []time.Duration
		rest      time.Duration
		restCount int
		wg        sync.WaitGroup
	)
	start := time.Now()
	deadline := start.Add(d)
	for w := range n {
		wg.Go(func() {
			var octets int64
			var gets, errs int
			var firstErr string
			var f []time.Duration
			var rs time.Duration
			var rc int
			for i := w; time.Now().Before(deadline); i += n {
				ref := client.BlockRef{Compat: set.compat, Scope: scope, Key: set.keys[i%len(set.keys)]}
				t0 := time.Now()
				t1, nl, got, err := fetch(ctx, ref, set.g, client.GetOptions{Layers: rng, LayerDigests: set.blk.LayerDigests()})
				if err != nil {
					errs++
					if firstErr == "" {
						firstErr = err.Error()
					}
					continue
				}
				end := time.Now()
				gets++
				octets += got
				f = append(f, t1.Sub(t0))
				if nl > 1 {
					rs += end.Sub(t1)
					rc += nl - 1
				}
			}
			mu.Lock()
			r.GETs += gets
			r.Octets += octets
			r.Errors += errs
			if r.FirstError == "" {
				r.FirstError = firstErr
			}
			first = append(first, f...)
			rest += rs
			restCount += rc
			mu.Unlock()
		})
	}
	wg.Wait()
	r.Seconds = time.Since(start).Seconds()
	r.GBPerS = float64(r.Octets) / r.Seconds / 1e9
	if len(first) > 0 {
		slices.Sort(first)
		r.FirstLayerP50Us = float64(first[len(first)/2].Microseconds())
		r.FirstLayerP99Us = float64(first[min(len(first)-1, len(first)*99/100)].Microseconds())
	}
	if restCount > 0 {
		r.PerLayerUs = float64(rest.Microseconds()) / float64(restCount)
	}
	return r
}

// sha256Bound is the SHA-256 rate over blk on one core, in GB/s: what the
// client's verification alone allows.
func sha256Bound(blk *container.Block) float64 {
	data := blk.Bytes()
	start := time.Now()
	n := 0
	for time.Since(start) < 300*time.Millisecond {
		sha256.Sum256(data)
		n++
	}
	return float64(n*len(data)) / time.Since(start).Seconds() / 1e9
}

// shortErr keeps the end of an error, where its cause is (the beginning
// repeats the URL).
func shortErr(s string) string {
	if len(s) > 120 {
		return "..." + s[len(s)-117:]
	}
	return s
}

func sizeName(octets int) string {
	if octets >= 1<<20 && octets%(1<<20) == 0 {
		return strconv.Itoa(octets>>20) + "MiB"
	}
	return strconv.Itoa(octets>>10) + "KiB"
}

func writeBenchTable(w io.Writer, rep *benchReport) {
	fmt.Fprintf(w, "\n%-9s %7s %6s %7s %8s %7s %12s %12s %10s %6s\n", "transport", "block", "layers", "streams", "GB/s", "GETs", "1st layer p50", "p99 (ms)", "layer (us)", "errors")
	for _, r := range rep.Results {
		fmt.Fprintf(w, "%-9s %7s %6s %7d %8.3f %7d %12.2f %12.2f %10.1f %6d\n", r.Transport, sizeName(r.BlockOctets), r.Layers, r.Streams, r.GBPerS, r.GETs,
			r.FirstLayerP50Us/1000, r.FirstLayerP99Us/1000, r.PerLayerUs, r.Errors)
	}
	fmt.Fprintf(w, "\nbound: SHA-256 %.2f GB/s on one core; %d CPUs; %s\n", rep.BoundSHA256, rep.CPUs, rep.GoVersion)
	if rep.BoundQUIC > 0 {
		fmt.Fprintf(w, "bound: QUIC alone (quic-go, no HTTP; 8 streams, 4 connections) %.3f GB/s, %.3f GB/s hashing as verification does: the ceiling of h3 and quicbulk\n", rep.BoundQUIC, rep.BoundQUICVerified)
	}
	if rep.UDPBuffers != "" {
		fmt.Fprintln(w, rep.UDPBuffers)
	}
}

// chartStreams is the stream count the chart shows: 8 when measured, else
// the largest.
func chartStreams(rep *benchReport) int {
	best := 0
	for _, r := range rep.Results {
		if r.Streams == 8 {
			return 8
		}
		best = max(best, r.Streams)
	}
	return best
}

func writeBenchChart(path string, rep *benchReport) error {
	n := chartStreams(rep)
	c := &chart.Chart{Title: fmt.Sprintf("kvsp bench: whole-block GETs, verified, %d streams (%d CPUs)", n, rep.CPUs),
		XLabel: "block size", YLabel: "GB/s", LogX: true, XTick: func(x float64) string { return sizeName(int(x)) }}
	for _, tr := range benchTransports {
		s := chart.Series{Name: tr}
		for _, r := range rep.Results {
			if r.Transport == tr && r.Layers == "all" && r.Streams == n && r.GETs > 0 {
				s.Points = append(s.Points, chart.Point{X: float64(r.BlockOctets), Y: r.GBPerS})
			}
		}
		if len(s.Points) > 0 {
			c.Series = append(c.Series, s)
		}
	}
	if len(c.Series) == 0 {
		return errors.New("bench: no whole-block result to chart (add all to --layers)")
	}
	return c.WritePNGFile(path)
}

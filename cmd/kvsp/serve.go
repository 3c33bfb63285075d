package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"reflect"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/controlplane/instance"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/engine/connected"
	"github.com/kvsp/kvsp/engine/llamacpp"
	"github.com/kvsp/kvsp/engine/sim"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/quicbulk"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/server"
	"github.com/kvsp/kvsp/tier"
)

// cmdServe runs `kvsp serve --config FILE` until SIGTERM or SIGINT.
func cmdServe(args []string, stdout, stderr io.Writer) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	return serve(ctx, args, stderr, hup, nil)
}

// serve is cmdServe with its context and signals injectable; ready, if
// set, receives the listening address.
func serve(ctx context.Context, args []string, stderr io.Writer, hup <-chan os.Signal, ready chan<- string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	path := fs.String("config", "", "configuration file")
	if err := fs.Parse(args); err != nil || *path == "" || fs.NArg() != 0 {
		return usageError("serve takes --config FILE")
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	cfg, err := config.Load(*path)
	if err != nil {
		return err // before anything listens
	}
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: cfg.TLS.Cert, Key: cfg.TLS.Key, ClientCA: cfg.TLS.ClientCA}, log)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if _, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: cfg.TLS.ClientCert, Key: cfg.TLS.ClientKey, ClientCA: cfg.TLS.ClientCA}, log); err != nil {
		return fmt.Errorf("config: tls.client_cert/client_key: %w", err)
	}
	policy, err := server.LoadPolicyStore(cfg.Policy, log)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	scfg := server.Config{Credentials: creds, Policy: policy, HTTP3: cfg.HTTP3, UDPBuffer: cfg.UDPBufferBytes, Logger: log, Registerer: reg,
		WriteGrace: time.Duration(cfg.WriteGraceMs) * time.Millisecond}
	if r := cfg.MinWriteRate; r != nil {
		scfg.MinWriteRate = int64(*r)
		if *r == 0 {
			scfg.MinWriteRate = -1 // 0 in the file turns it off; server.Config's 0 is its default
		}
	}
	var bulk *quicbulk.Server
	if cfg.QUICBulk {
		bulk = &quicbulk.Server{Logger: log}
		scfg.QUIC = map[string]server.QUICHandler{quicbulk.ALPN: bulk}
		scfg.QUICConfig = quicbulk.DefaultConfig()
	}
	srv, err := server.New(scfg)
	if err != nil {
		return err
	}
	if bulk != nil {
		bulk.Handler = srv.Handler()
	}
	var roles mounted
	closeRoles, err := mountRoles(srv, cfg, log, reg, &roles)
	if err != nil {
		return err
	}
	defer closeRoles()
	if cfg.Gateway != nil {
		stopGateway, err := startGateway(cfg, creds, policy, log, reg)
		if err != nil {
			return err
		}
		defer stopGateway()
	}

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	var metrics *http.Server
	if cfg.MetricsListen != "" {
		mln, err := net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			ln.Close()
			return fmt.Errorf("metrics_listen: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		if roles.pc != nil {
			mux.Handle("/", newStatusPage(cfg, roles.pc, reg))
		}
		metrics = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go metrics.Serve(mln)
	}
	wctx, cancelWatch := context.WithCancel(ctx)
	defer cancelWatch()
	go policy.Watch(wctx, 2*time.Second)
	go func() {
		for {
			select {
			case <-wctx.Done():
				return
			case <-hup:
				if err := policy.Reload(); err != nil {
					log.Error("SIGHUP: policy reload failed; the previous policy stays in force", "err", err)
				} else {
					log.Info("SIGHUP: policy reloaded")
				}
			}
		}
	}()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	log.Info("serving", "listen", ln.Addr().String(), "roles", cfg.Roles(), "http3", cfg.HTTP3, "quicbulk", cfg.QUICBulk)
	if ready != nil {
		ready <- ln.Addr().String()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	if metrics != nil {
		metrics.Shutdown(sctx)
	}
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

// newInstance builds an instance agent over its engine: the simulated
// engine, or a real one that attaches at the engine's socket (package
// connected); stop ends what it started.
func newInstance(x *config.Instance, c *client.Client, keys []kvsp.ScopeKey, log *slog.Logger, reg prometheus.Registerer) (*instance.Agent, func(), error) {
	var (
		d   kvsp.Descriptor
		err error
	)
	if x.Engine.Descriptor != "" {
		if d, err = loadDescriptor(x.Engine.Descriptor); err != nil {
			return nil, nil, fmt.Errorf("descriptor %s: %w", x.Engine.Descriptor, err)
		}
	}
	var (
		eng  engine.Engine
		stop = func() {}
	)
	switch x.Engine.Kind {
	case "llamacpp":
		le, err := llamacpp.New(llamacpp.Config{Model: x.Engine.Model, Name: x.Engine.Name, Library: x.Engine.Library,
			ContextTokens: x.Engine.ContextTokens, BatchSize: x.Engine.BatchSize, PrefillChunk: x.Engine.PrefillChunk,
			Threads: x.Engine.Threads, KVCapacity: x.Engine.KVCapacity, FlashAttention: x.Engine.FlashAttention, BlockTokens: x.Engine.BlockTokens,
			NoPrefixCache: x.Engine.PrefixCache != nil && !*x.Engine.PrefixCache})
		if err != nil {
			return nil, nil, fmt.Errorf("engine: %w", err)
		}
		if x.Engine.Descriptor != "" && !reflect.DeepEqual(d, le.Descriptor()) {
			le.Close()
			return nil, nil, fmt.Errorf("engine.descriptor %s is not the model's descriptor (kvsp model descriptor %s prints it)", x.Engine.Descriptor, x.Engine.Model)
		}
		log.Info("llama.cpp engine", "model", le.Descriptor().Model, "release", llamacpp.Release, "layers", le.Descriptor().Layers, "vocab", le.Vocab())
		if reg != nil {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvsp_llamacpp_evaluated_tokens_total",
				Help: "Tokens llama.cpp evaluated, by its own count (llama_perf_context): prompt tokens prefilled, and tokens decoded."},
				func() float64 { return float64(le.Evaluated()) })) // labelled with the instance (ii) by reg
		}
		eng, stop = le, func() { le.Close() }
	case "connected":
		g, err := geometryOf(d)
		if err != nil {
			return nil, nil, err
		}
		dev, err := tier.OpenDevice(x.Engine.Device)
		if err != nil {
			return nil, nil, fmt.Errorf("engine.device: %w", err)
		}
		ce, err := connected.New(d, g, dev)
		if err != nil {
			dev.Close()
			return nil, nil, err
		}
		sock := x.Engine.AttachSocket
		stopAttach, err := serveAttach(sock, ce)
		if err != nil {
			dev.Close()
			return nil, nil, fmt.Errorf("engine.attach_socket: %w", err)
		}
		stop = func() { stopAttach(); dev.Close() } // sessions end (their pools unmapped) before the device
		log.Info("the engine attaches here", "socket", sock, "instance", x.Base)
		eng = ce
	default:
		sc := sim.Config{Descriptor: d, PrefillTokensPerS: x.Engine.PrefillTokensPerS, DecodeTokensPerS: x.Engine.DecodeTokensPerS,
			NoPrefixCache: x.Engine.PrefixCache != nil && !*x.Engine.PrefixCache, ContextTokens: uint64(x.Engine.ContextTokens)}
		if a := x.Engine.AnswerTokens; len(a) == 2 {
			sc.AnswerTokens = [2]int{a[0], a[1]}
		}
		if eng, err = sim.New(sc); err != nil {
			return nil, nil, err
		}
	}
	var links []kvsp.Link
	for _, l := range x.Links {
		links = append(links, kvsp.Link{Holder: l.Holder, MbitPerS: l.MbitPerS, RTTUs: l.RTTUs})
	}
	icfg := instance.Config{Base: x.Base, Engine: eng, Client: c, Controller: x.Controller, Controllers: x.Controllers, Index: x.Index, Holder: x.Holder,
		OffloadBuffer: int64(x.OffloadBuffer),
		Links:         links, Scopes: keys, EpochFile: x.EpochFile, ProducerDigests: x.ProducerDigests, Logger: log, Registerer: reg}
	// The agent's Fetcher: a GET through the process's block transport
	// (HTTPS, or quicbulk where transport is quicbulk: processClient),
	// or an RDMA READ that falls back to that GET.
	get := instance.GetFetcher{Client: c}
	icfg.Fetcher = get
	if x.RDMA != nil {
		v, err := rdma.OpenVerbs(x.RDMA.Device)
		if err != nil {
			stop()
			return nil, nil, fmt.Errorf("rdma: %w", err)
		}
		r := rdma.NewReader(v)
		icfg.Fetcher = instance.RDMAFetcher{Client: c, Reader: r, Fallback: get, Logger: log}
		engStop := stop
		stop = func() { engStop(); r.Close(); v.Close() }
		if err := registerReaderMetrics(reg, r); err != nil {
			stop()
			return nil, nil, err
		}
		log.Info("RDMA reads", "instance", x.Base, "device", v.Name())
	}
	a, err := instance.New(icfg)
	if err != nil {
		stop()
		return nil, nil, err
	}
	return a, stop, nil
}

// processClient is the client this process calls other roles with, under
// its one identity (tls.client_cert).
func processClient(cfg *config.Config, log *slog.Logger) (*client.Client, error) {
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: cfg.TLS.ClientCert, Key: cfg.TLS.ClientKey, ClientCA: cfg.TLS.ClientCA}, log)
	if err != nil {
		return nil, fmt.Errorf("config: tls.client_cert: %w", err)
	}
	tc := mtls.ClientTLSConfig(creds)
	cc := client.Config{TLS: tc, Logger: log, HTTP3: cfg.Transport == "h3", QUICConns: cmp.Or(cfg.QUICConns, 4)}
	if cfg.Transport == "quicbulk" {
		cc.Bulk = &quicbulk.Transport{TLS: tc, Conns: cmp.Or(cfg.QUICConns, 4), BufferSize: cfg.UDPBufferBytes, Logger: log}
	}
	return client.New(cc)
}

// descriptorGeometry reads a descriptor file: the block geometry and the
// Compatibility ID of its model.
func descriptorGeometry(path string) (container.Geometry, kvsp.CompatID, error) {
	d, err := loadDescriptor(path)
	if err != nil {
		return container.Geometry{}, kvsp.CompatID{}, fmt.Errorf("descriptor %s: %w", path, err)
	}
	g, err := geometryOf(d)
	if err != nil {
		return container.Geometry{}, kvsp.CompatID{}, err
	}
	id, err := d.CompatID()
	return g, id, err
}

// newHolder builds a holder from its configuration: the geometries of its
// own descriptors and of the instances whose holder it is.
func newHolder(cfg *config.Config, hcfg *config.Holder, c *client.Client, target *rdma.Target, log *slog.Logger, reg prometheus.Registerer) (*holder.Holder, error) {
	geoms := map[kvsp.CompatID]container.Geometry{}
	paths := append([]string(nil), hcfg.Descriptors...)
	for _, x := range cfg.Instances {
		if x.Holder == hcfg.Base {
			paths = append(paths, x.Engine.Descriptor)
		}
	}
	for _, p := range paths {
		g, id, err := descriptorGeometry(p)
		if err != nil {
			return nil, err
		}
		geoms[id] = g
	}
	var capacity int64
	var rate, diskRate uint64
	var disk *tier.Disk
	hc := holder.Config{}
	for _, t := range hcfg.Tiers {
		switch t.Name {
		case kvsp.TierDevice:
			d, err := tier.OpenDevice(t.Device)
			if err != nil {
				return nil, fmt.Errorf("tiers: device: %w", err)
			}
			hc.Device, hc.DeviceCapacity, hc.DeviceLayers, hc.DeviceReadMbitPerS = d, int64(t.Capacity), t.Layers, t.ReadMbitPerS
		case kvsp.TierHost:
			capacity, rate = int64(t.Capacity), t.ReadMbitPerS
		case kvsp.TierLocalStorage:
			d, err := tier.OpenDisk(tier.DiskConfig{Dir: t.Path, Capacity: int64(t.Capacity), MasterKeyFile: hcfg.MasterKeyFile, Logger: log})
			if err != nil {
				return nil, err
			}
			disk, diskRate = d, t.ReadMbitPerS
		default:
			log.Warn("tier not built yet", "base", hcfg.Base, "tier", t.Name)
		}
	}
	if capacity == 0 {
		return nil, fmt.Errorf("tiers: a host tier is required")
	}
	hc.Base, hc.Geometries, hc.Capacity, hc.ReadMbitPerS, hc.Disk, hc.DiskReadMbitPerS = hcfg.Base, geoms, capacity, rate, disk, diskRate
	hc.LeaseQuota = holder.LeaseQuota{Octets: int64(hcfg.LeaseQuota.Octets), MaxTTL: time.Duration(hcfg.LeaseQuota.MaxTTLMs) * time.Millisecond, MaxLeases: hcfg.LeaseQuota.MaxLeases}
	hc.Index, hc.RecordTTL, hc.Logger, hc.Registerer = c.Index(hcfg.Index), time.Duration(hcfg.RecordTTLMs)*time.Millisecond, log, reg
	hc.MinBodyRate, hc.BodyGrace = int64(hcfg.MinBodyRate), time.Duration(hcfg.BodyGraceMs)*time.Millisecond
	hc.MaxReadPerClient = int64(hcfg.MaxReadPerClient)
	// Without descriptors of its own, a holder is a cache server: any
	// compat_id is stored (those of its instances still checked against
	// their geometry).
	hc.AnyCompat, hc.MaxBlockSize = len(hcfg.Descriptors) == 0, int64(hcfg.MaxBlockSize)
	if target != nil {
		hc.RDMA = target
	}
	return holder.New(hc)
}

// indexBackend opens the configured index backend.
func indexBackend(cfg *config.Config) (index.Backend, error) {
	if cfg.Index.Backend != "redis" {
		return index.NewMemory(time.Second), nil
	}
	pw, err := cfg.Redis.Password()
	if err != nil {
		return nil, fmt.Errorf("config: redis.password_file: %w", err)
	}
	rc := index.RedisConfig{Addrs: cfg.Redis.Addrs, Username: cfg.Redis.Username, Password: pw}
	if cfg.Redis.TLSCA != "" {
		pem, err := os.ReadFile(cfg.Redis.TLSCA)
		if err != nil {
			return nil, fmt.Errorf("config: redis.tls_ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("config: redis.tls_ca: no PEM certificate")
		}
		rc.TLS = &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool}
	}
	return index.NewRedis(context.Background(), rc)
}

// basePath is the path of a base URI ("https://h:8443/is/" -> "/is/").
func basePath(base string) string {
	u, err := url.Parse(base)
	if err != nil || u.Path == "" {
		return "/"
	}
	return u.Path
}

// newStatusPage is the PC's status page, with the models of the
// descriptors the configuration names and the engines of its instances.
func newStatusPage(cfg *config.Config, pc *placement.Controller, reg prometheus.Gatherer) *statusPage {
	p := &statusPage{pc: pc, reg: reg, models: map[kvsp.CompatID]string{}, engines: map[string]string{}}
	var paths []string
	if cfg.Controller != nil {
		paths = append(paths, cfg.Controller.Descriptors...)
	}
	for _, x := range cfg.Instances {
		p.engines[x.Base] = x.Engine.Kind
		if x.Engine.Descriptor != "" {
			paths = append(paths, x.Engine.Descriptor)
		}
	}
	for _, path := range paths {
		if d, err := loadDescriptor(path); err == nil {
			if c, err := d.CompatID(); err == nil {
				p.models[c] = d.Model
			}
		}
	}
	return p
}

// descriptorSizes maps the compat_id of every descriptor the
// configuration names to its block_tokens and its layers.
func descriptorSizes(cfg *config.Config) (blockTokens, layers map[kvsp.CompatID]int, err error) {
	m, ls := map[kvsp.CompatID]int{}, map[kvsp.CompatID]int{}
	var paths []string
	if cfg.Controller != nil {
		paths = append(paths, cfg.Controller.Descriptors...)
	}
	for _, h := range cfg.Holders {
		paths = append(paths, h.Descriptors...)
	}
	for _, x := range cfg.Instances {
		paths = append(paths, x.Engine.Descriptor)
	}
	for _, p := range paths {
		d, err := loadDescriptor(p)
		if err != nil {
			return nil, nil, fmt.Errorf("descriptor %s: %w", p, err)
		}
		c, err := d.CompatID()
		if err != nil {
			return nil, nil, err
		}
		m[c], ls[c] = d.BlockTokens, d.Layers
	}
	return m, ls, nil
}

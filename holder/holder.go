package holder

import (
	"container/list"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/server"
	"github.com/kvsp/kvsp/tier"
)

// Config configures a holder.
type Config struct {
	// Base is the holder's base URI, as published in its records.
	Base string
	// Geometries maps each compat_id whose descriptor the holder knows to
	// its geometry: its blocks are checked against it (Token Count, section
	// lengths, the model's layers). Other compat_ids get 409
	// kvsp-incompatible, unless AnyCompat.
	Geometries map[kvsp.CompatID]container.Geometry
	// AnyCompat stores blocks of any compat_id (the spec's "cache server",
	// shared by models none of its instances run): those without a
	// geometry are checked for what needs no descriptor (container's
	// Geometry.Unknown: version, flags, layer count, lengths summing to
	// the body, MaxBlockSize, the digests); the rest is the consumer's,
	// whose client checks it against the descriptor.
	AnyCompat bool
	// MaxBlockSize bounds a block of a compat_id without a geometry;
	// default 64 MiB (a 512-token block of an 8B model).
	MaxBlockSize int64
	// Capacity of the host tier, in octets.
	Capacity int64
	// ReadMbitPerS of the host tier, published in residency.
	ReadMbitPerS uint64
	// LeaseQuota bounds each client's leases.
	LeaseQuota LeaseQuota
	// Device, when set, is the device tier: the first DeviceLayers layers
	// of each block (all of them when 0) go to its memory while it has
	// DeviceCapacity octets free, the rest to host memory; least recently
	// used device parts are demoted to host memory.
	Device             *tier.Device
	DeviceCapacity     int64
	DeviceLayers       int
	DeviceReadMbitPerS uint64
	// Disk, when set, is the local-storage tier blocks are demoted to.
	Disk *tier.Disk
	// DiskReadMbitPerS is the local-storage tier's read rate (R-PLC-5).
	DiskReadMbitPerS uint64
	// MaxInFlight bounds the octets of block PUTs being received at once
	// (beyond it, 503); default a quarter of Capacity, at least 64 MiB.
	// MaxInFlightPerClient is one client's share of it (beyond it, 429);
	// default a quarter of MaxInFlight, at least the largest block.
	MaxInFlight, MaxInFlightPerClient int64
	// MaxReadPerClient is one client's allowance of memory its block GETs
	// hold beyond the host tier's capacity (RELIABILITY B12): blocks read
	// back from local storage or copied (from device memory, into another
	// codec) for one GET, and blocks evicted or demoted while its GETs
	// still send them. A GET whose copies do not fit is refused with 429;
	// a GET whose block is evicted past it is cut. GETs of blocks in host
	// memory take nothing from it. Default DefaultMaxReadPerClient, at
	// least four of the largest block.
	MaxReadPerClient int64
	// MinBodyRate is the average rate, in octets per second, at which a
	// block body must arrive once BodyGrace has passed (slower: 408, the
	// reservation released); defaults DefaultMinBodyRate and
	// DefaultBodyGrace; a negative rate turns the check off.
	MinBodyRate int64
	BodyGrace   time.Duration
	// RDMA, when set, serves one-sided RDMA reads of blocks in host
	// memory (POST rdma/reads, a kvsp extension).
	RDMA RDMA
	// Index, when set, receives the holder's replica records.
	Index *client.Index
	// RecordTTL is the ttl_ms asked for published records; refreshed at a
	// third of the effective TTL (R-OPS-1). Default 60s.
	RecordTTL  time.Duration
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Validate reports a bad field.
func (c *Config) Validate() error {
	switch {
	case c.Capacity <= 0:
		return errors.New("holder: capacity required")
	case c.LeaseQuota.Octets <= 0 || c.LeaseQuota.MaxTTL <= 0 || c.LeaseQuota.MaxLeases <= 0:
		return errors.New("holder: lease_quota: octets, max_ttl_ms and max_leases required")
	case c.Device != nil && (c.DeviceCapacity <= 0 || c.DeviceLayers < 0):
		return errors.New("holder: device tier: capacity required, layers >= 0")
	}
	return kvsp.ValidateBaseURI("holder: base", c.Base)
}

// Holder serves blocks and leases.
type Holder struct {
	cfg    Config
	log    *slog.Logger
	store  *store
	leases *leases
	rdma   *rdmaReads
	m      *metrics
	// res holds the octets of PUTs being received (MaxInFlight).
	res *reservations
	// reads is the memory GETs hold beyond the host tier (MaxReadPerClient).
	reads *readMemory

	pubMu   sync.Mutex
	pubWake chan struct{}
	pending []pubOp // new records and withdrawals, first
	renew   []pubOp // refreshes of records already published, after them
	stop    chan struct{}
	done    chan struct{}
}

type pubOp struct {
	e        *entry
	withdraw bool
}

// New returns a Holder; Close stops its publisher.
func New(cfg Config) (*Holder, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.RecordTTL == 0 {
		cfg.RecordTTL = time.Minute
	}
	if cfg.MaxInFlight == 0 {
		cfg.MaxInFlight = max(cfg.Capacity/4, 64<<20)
	}
	if cfg.MaxBlockSize == 0 {
		cfg.MaxBlockSize = 64 << 20
	}
	if cfg.MaxInFlightPerClient == 0 {
		cfg.MaxInFlightPerClient = min(cfg.MaxInFlight, max(cfg.MaxInFlight/4, largestBlock(cfg)))
	}
	if cfg.MaxReadPerClient == 0 {
		cfg.MaxReadPerClient = max(DefaultMaxReadPerClient, 4*largestBlock(cfg))
	}
	if cfg.MinBodyRate == 0 {
		cfg.MinBodyRate = DefaultMinBodyRate
	}
	if cfg.BodyGrace == 0 {
		cfg.BodyGrace = DefaultBodyGrace
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	l := newLeases(cfg.LeaseQuota)
	h := &Holder{cfg: cfg, log: cfg.Logger, leases: l, res: &reservations{byClient: map[string]int64{}, max: cfg.MaxInFlight, each: cfg.MaxInFlightPerClient}, rdma: newRDMAReads(), store: newStore(cfg.Capacity, l, cfg.Disk), m: newMetrics(cfg.Registerer),
		pubWake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	h.reads = newReadMemory(cfg.MaxReadPerClient, h.m)
	if cfg.Registerer != nil {
		const readHeld = "Memory block GETs hold beyond the host tier's capacity, by kind: evicted (blocks evicted or demoted from host memory while GETs still send them) and copy (blocks read back from local storage, or copied out of device memory or into another codec, for one GET); each client's is bounded by its read allowance (max_read_per_client)."
		cfg.Registerer.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_read_held_bytes", Help: readHeld, ConstLabels: prometheus.Labels{"kind": "evicted"}},
				func() float64 { return float64(h.store.evictedHeld()) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_read_held_bytes", Help: readHeld, ConstLabels: prometheus.Labels{"kind": "copy"}},
				func() float64 { return float64(h.reads.copied()) }))
		cfg.Registerer.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_active_leases", Help: "Leases not expired (released or expired ones are dropped)."},
				func() float64 { n, _ := l.live(time.Now()); return float64(n) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_leased_bytes", Help: "Octets of blocks under live leases (pinned against eviction)."},
				func() float64 { _, o := l.live(time.Now()); return float64(o) }))
	}
	if cfg.Device != nil {
		layers := cfg.DeviceLayers
		if layers == 0 {
			layers = math.MaxInt
		}
		h.store.dev = &deviceTier{d: cfg.Device, layers: layers, capacity: cfg.DeviceCapacity, lru: list.New()}
		name, standIn := cfg.Device.Name(), cfg.Device.StandIn()
		h.m.device.WithLabelValues(name, strconv.FormatBool(standIn)).Set(1)
		if standIn {
			h.log.Warn("the device tier is a host-memory stand-in (built with -tags nogpu): its blocks are in host memory", "device", name)
		} else {
			h.log.Info("device tier", "device", name, "capacity", cfg.DeviceCapacity)
		}
		if cfg.Registerer != nil { // the device's own figures (NVML on a GPU), read at each scrape
			tel := func(f func(tier.DeviceTelemetry) float64) func() float64 {
				return func() float64 {
					t, err := cfg.Device.Telemetry()
					if err != nil {
						return math.NaN()
					}
					return f(t)
				}
			}
			cfg.Registerer.MustRegister(
				prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_device_memory_used_bytes",
					Help: "Memory in use on the device tier's device (all users), as the device reports it."}, tel(func(t tier.DeviceTelemetry) float64 { return float64(t.MemoryUsed) })),
				prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_device_memory_total_bytes",
					Help: "Memory of the device tier's device."}, tel(func(t tier.DeviceTelemetry) float64 { return float64(t.MemoryTotal) })),
				prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvsp_holder_device_link_mbit_per_s",
					Help: "The device's host link rate (PCIe generation x width; 0 when unknown)."}, tel(func(t tier.DeviceTelemetry) float64 { return float64(t.LinkMbitPerS) })),
			)
		}
	}
	h.recover()
	h.store.startDemoter(h.demoted)
	go h.publisher()
	return h, nil
}

// DefaultMaxReadPerClient is Config.MaxReadPerClient's least default:
// sixteen blocks of 4 MiB read back from local storage at once (an
// instance prefetching a prompt's blocks from a holder that demoted them).
const DefaultMaxReadPerClient = 64 << 20

// largestBlock is the largest block cfg stores (MaxBlockSize filled in).
func largestBlock(cfg Config) int64 {
	largest := int64(0)
	if cfg.AnyCompat {
		largest = cfg.MaxBlockSize
	}
	for _, g := range cfg.Geometries {
		largest = max(largest, maxBlockLen(g))
	}
	return largest
}

// demoted publishes what left the host tier: the new residency of blocks
// demoted to local storage, the withdrawal of those evicted.
func (h *Holder) demoted(demoted, evicted []*entry) {
	for _, v := range evicted {
		h.enqueue(v, true)
	}
	for _, v := range demoted {
		h.enqueue(v, false) // new residency: local-storage
	}
	h.m.evictions.Add(float64(len(evicted)))
	h.m.demotions.Add(float64(len(demoted)))
}

// recover registers the blocks the local-storage tier kept across a
// restart, after reading each back (a block that fails is deleted), so
// they are served and published again.
func (h *Holder) recover() {
	if h.cfg.Disk == nil {
		return
	}
	for _, n := range h.cfg.Disk.List() {
		id := blockID{n.Compat, n.Scope, n.Key}
		g, err := h.geometry(id.compat)
		if err != nil {
			continue // kept for a configuration that knows its model
		}
		blk, err := h.cfg.Disk.Get(n, g)
		if err != nil {
			h.log.Warn("dropping a stored block that failed verification", "err", err)
			h.cfg.Disk.Delete(n)
			continue
		}
		e := newEntry(id, blk, g)
		h.store.addDisk(e)
		h.enqueue(e, false)
	}
}

// geometry is what a compat_id's blocks are checked against: its
// descriptor's geometry; the unknown geometry under AnyCompat; else 409.
func (h *Holder) geometry(c kvsp.CompatID) (container.Geometry, error) {
	if g, ok := h.cfg.Geometries[c]; ok {
		return g, nil
	}
	if h.cfg.AnyCompat {
		return container.Geometry{}, nil
	}
	return container.Geometry{}, fmt.Errorf("%w: this holder does not store compat_id %s", kvsp.ErrIncompatible, c)
}

// maxBlock is the largest block of geometry g this holder takes.
func (h *Holder) maxBlock(g container.Geometry) int64 {
	if g.Unknown() {
		return h.cfg.MaxBlockSize
	}
	return maxBlockLen(g)
}

// allLayers is A-16's default range of a GET without layers: the model's
// layers, or without its geometry those the block holds.
func allLayers(g container.Geometry, hdr *container.Header) (uint32, uint32) {
	if g.Unknown() {
		return hdr.FirstLayer, hdr.LastLayer()
	}
	return 0, g.Layers - 1
}

// Mount adds the holder routes of the resource table under r.
func (h *Holder) Mount(r *server.Router) error {
	if h.cfg.RDMA != nil {
		h.mountRDMA(r)
	}
	return server.MountRole(r, server.RoleHolder, map[string]server.HandlerFunc{
		"GET blocks/{compat}/{scope}/{key}": h.getBlock,
		"PUT blocks/{compat}/{scope}/{key}": h.putBlock,
		"POST leases":                       h.createLease,
		"PUT leases/{id}":                   h.renewLease,
		"DELETE leases/{id}":                h.releaseLease,
	})
}

// parseBlockPath reads the ids of the path and checks the scope before
// anything else (R-BLK-13, R-BLK-19: 403 before any storage probe).
func parseBlockPath(r *http.Request) (blockID, error) {
	var id blockID
	var err error
	if id.compat, err = kvsp.ParseCompatID(r.PathValue("compat")); err != nil {
		return id, err
	}
	if id.scope, err = kvsp.ParseScopeID(r.PathValue("scope")); err != nil {
		return id, err
	}
	if id.key, err = kvsp.ParseBlockKey(r.PathValue("key")); err != nil {
		return id, err
	}
	if !server.PrincipalFrom(r.Context()).MayUseScope(id.scope) {
		return id, fmt.Errorf("%w: block", kvsp.ErrScopeDenied)
	}
	return id, nil
}

// parseLayers reads "a-b": syntax errors are 400.
func parseLayers(s string) (uint32, uint32, error) {
	a, b, ok := strings.Cut(s, "-")
	x, err1 := strconv.ParseUint(a, 10, 32)
	y, err2 := strconv.ParseUint(b, 10, 32)
	if !ok || err1 != nil || err2 != nil || x > y || a == "" || b == "" || a[0] == '+' || b[0] == '+' {
		return 0, 0, fmt.Errorf("%w: layers must be a-b with a <= b", kvsp.ErrInvalid)
	}
	return uint32(x), uint32(y), nil
}

func (h *Holder) getBlock(w http.ResponseWriter, r *http.Request) error {
	id, err := parseBlockPath(r)
	if err != nil {
		return err
	}
	q := r.URL.Query()
	var first, last uint32
	ranged := q.Has("layers")
	if ranged {
		if first, last, err = parseLayers(q.Get("layers")); err != nil {
			return err
		}
	}
	var codec uint16
	if q.Has("codec") {
		c, err := strconv.ParseUint(q.Get("codec"), 10, 16)
		if err != nil || c == 0 {
			return fmt.Errorf("%w: codec must be a decimal 1..65535 (A-15)", kvsp.ErrInvalid)
		}
		codec = uint16(c)
	}
	g, err := h.geometry(id.compat)
	if err != nil {
		return err
	}
	e := h.store.get(id)
	if e == nil {
		h.m.getMisses.Inc()
		return fmt.Errorf("%w: block", kvsp.ErrNotFound)
	}
	hdr := &e.hdr
	if !ranged { // all the model's layers
		first, last = allLayers(g, hdr)
	}
	if first < hdr.FirstLayer || last > hdr.LastLayer() {
		return fmt.Errorf("%w: layers %d-%d", kvsp.ErrLayersUnavailable, first, last)
	}
	rd, err := h.reads.open(server.PrincipalFrom(r.Context()).ID, w)
	if err != nil {
		return err
	}
	defer rd.done() // after release: no charge comes once the reference is given back
	res, release, err := h.store.acquireFor(e, g, rd)
	if errors.Is(err, errGone) {
		h.m.getMisses.Inc()
		return err
	}
	if errors.Is(err, kvsp.ErrTooManyRequests) {
		return err
	}
	if err != nil {
		// Tampered with at rest: drop it, withdraw it, and fail this GET
		// rather than serve wrong bytes.
		h.store.drop(e)
		h.enqueue(e, true)
		h.m.corrupt.Inc()
		h.log.Error("a stored block failed verification; dropped and withdrawn", "err", err)
		return fmt.Errorf("%w: the stored block failed verification", kvsp.ErrUnavailable)
	}
	defer release()
	maxAge := 0
	e.mu.Lock()
	if rem := time.Until(e.published); rem > 0 {
		maxAge = int(rem / time.Second) // floor, no longer than the record
	}
	e.mu.Unlock()
	wh := w.Header()
	wh.Set("Content-Type", kvsp.MediaTypeBlock)
	wh.Set("Cache-Control", "private, immutable, max-age="+strconv.Itoa(maxAge))
	if codec != 0 && codec != hdr.Codec && !g.Unknown() { // transcoding needs the geometry
		copies := e.octets // the transcoded body (no larger than the raw one)
		if _, inHost := res.(hostBlock); !inHost {
			if _, readBack := res.(diskBlock); !readBack {
				copies += e.octets // and the block assembled in host memory
			}
		}
		if err := rd.reserve(copies); err != nil {
			return err
		}
		blk, done, err := res.materialize()
		if err != nil {
			return fmt.Errorf("%w: reading the block from device memory: %v", kvsp.ErrUnavailable, err)
		}
		defer done()
		v, err := blk.Range(first, last)
		if err != nil {
			return fmt.Errorf("%w: layers %d-%d", kvsp.ErrLayersUnavailable, first, last)
		}
		if body, d, ok := h.transcode(v, codec, g); ok {
			wh.Set("Repr-Digest", container.ReprDigest(d))
			wh.Set("Content-Length", strconv.Itoa(len(body)))
			_, err := w.Write(body)
			return err
		}
		// Not transcodable: the native codec, which the header names.
	}
	body, err := res.body(spanOf(e, first, last))
	if err != nil {
		return err
	}
	d, err := e.rangeDigest(first, last, body.Digest)
	if err != nil {
		return fmt.Errorf("%w: reading the block from device memory: %v", kvsp.ErrUnavailable, err)
	}
	wh.Set("Repr-Digest", container.ReprDigest(d))
	wh.Set("Content-Length", strconv.FormatInt(body.Len(), 10))
	var out io.Writer = w
	if failpoint.Armed("holder/corrupt-on-read") { // RELIABILITY F1: bitrot after the stored digest was computed
		out = &bitrot{w: w, at: body.Len() / 2}
	}
	if failpoint.Active("holder/get-midway") { // RELIABILITY F3: the rest of the body read from the block after a pause
		out = &midway{w: out, at: body.Len() / 2}
	}
	n, err := body.WriteTo(out)
	h.m.gets.Inc()
	h.m.served(res.where(), r.Proto).Add(float64(n))
	return err
}

// oversized answers a PUT that declares more octets than a block of its
// geometry can have: if its header is valid, the octets after the last
// section are the defect, 400 naming the mismatch (R-CNT-6); a body no
// valid header explains is 413 (B5). Only the header is read, with no
// reservation.
func (h *Holder) oversized(w http.ResponseWriter, r *http.Request, g container.Geometry, max int64) error {
	tooLarge := fmt.Errorf("%w: a block of this geometry is at most %d octets", kvsp.ErrTooLarge, max)
	body := newMinRateBody(w, r.Body, h.cfg.MinBodyRate, h.cfg.BodyGrace)
	defer body.done()
	hdr := make([]byte, container.HeaderLen(int(g.Layers)))
	n, _ := io.ReadFull(body, hdr[:container.FixedHeaderLen])
	if n < container.FixedHeaderLen {
		return tooLarge
	}
	if count := int(binary.BigEndian.Uint32(hdr[12:])); count >= 1 && count <= int(g.Layers) {
		m, _ := io.ReadFull(body, hdr[container.FixedHeaderLen:container.HeaderLen(count)])
		hdr = hdr[:container.FixedHeaderLen+m]
	}
	hd, _, err := container.ParseHeader(hdr, g)
	if err != nil {
		return tooLarge
	}
	return fmt.Errorf("%w: Content-Length is %d octets, the header makes %d: octets after the last section (R-CNT-6)", kvsp.ErrInvalid, r.ContentLength, hd.Size())
}

// maxBlockLen is the largest container of geometry g (all layers, raw).
func maxBlockLen(g container.Geometry) int64 {
	return int64(container.HeaderLen(int(g.Layers))) + 2*int64(g.Layers)*int64(g.RawSectionLen())
}

// transcode re-encodes a raw view into codec c; transcoded representations
// are protected by Repr-Digest only (R-BLK-11).
func (h *Holder) transcode(v container.View, c uint16, g container.Geometry) ([]byte, container.Digest, bool) {
	codec := container.LookupCodec(c)
	b := v.Block()
	if codec == nil || b.Header().Codec != container.CodecRaw {
		return nil, container.Digest{}, false
	}
	hdr, err := container.NewHeader(c, v.FirstLayer(), uint32(v.LayerCount()), g)
	if err != nil {
		return nil, container.Digest{}, false
	}
	var buf strings.Builder
	buf.Grow(int(hdr.Size()))
	w := container.NewWriter(&buf, hdr)
	kb, vb := make([]byte, codec.SectionLen(g)), make([]byte, codec.SectionLen(g))
	for l := v.FirstLayer(); l < v.FirstLayer()+uint32(v.LayerCount()); l++ {
		k, vv, _ := b.Layer(l)
		if codec.FromRaw(kb, k, g) != nil || codec.FromRaw(vb, vv, g) != nil || w.WriteLayer(kb, vb) != nil {
			return nil, container.Digest{}, false
		}
	}
	d, err := w.Close()
	if err != nil {
		return nil, container.Digest{}, false
	}
	return []byte(buf.String()), d.Container, true
}

func (h *Holder) putBlock(w http.ResponseWriter, r *http.Request) (err error) {
	defer func() {
		if err != nil {
			h.m.putRejected.Inc()
		}
	}()
	id, err := parseBlockPath(r)
	if err != nil {
		return err
	}
	if r.Header.Get("If-None-Match") != "*" {
		return fmt.Errorf("%w: PUT needs If-None-Match: * (A-10)", kvsp.ErrPreconditionRequired)
	}
	if err := server.RequireMediaType(r, kvsp.MediaTypeBlock); err != nil {
		return err
	}
	g, err := h.geometry(id.compat)
	if err != nil {
		return err
	}
	if h.store.has(id) {
		return errExists // early, before the body; the store decides (L4)
	}
	failpoint.Eval("holder/put-checked") // RELIABILITY L4: PUTs of one key all past the early check
	var want *container.Digest
	for _, f := range []string{"Repr-Digest", "Content-Digest"} {
		if v := r.Header.Get(f); v != "" {
			d, err := container.ParseReprDigest(v)
			if err != nil {
				return fmt.Errorf("%w: %s: %v", kvsp.ErrInvalid, f, err)
			}
			want = &d
		}
	}
	max := h.maxBlock(g)
	if r.ContentLength > max {
		if g.Unknown() {
			return fmt.Errorf("%w: a block is at most %d octets here", kvsp.ErrTooLarge, max)
		}
		return h.oversized(w, r, g, max)
	}
	var (
		blk *container.Block
		buf []byte // recycled memory, the pool's again unless stored
	)
	defer func() {
		if buf != nil {
			h.store.bufs.put(buf)
		}
	}()
	// Memory held by PUTs being received is bounded, in all and per
	// client: a chunked PUT counts as the largest block of its geometry.
	reserve := r.ContentLength
	if reserve < 0 {
		reserve = max
	}
	client := server.PrincipalFrom(r.Context()).ID
	if err := h.res.reserve(client, reserve); err != nil {
		return err
	}
	h.m.inFlight.Add(float64(reserve))
	defer func() { h.res.release(client, reserve); h.m.inFlight.Sub(float64(reserve)) }()
	// The body keeps up the minimum rate, or is cut (B8: a stalled body
	// holds its reservation for as long as it stays open).
	body := newMinRateBody(w, r.Body, h.cfg.MinBodyRate, h.cfg.BodyGrace)
	defer body.done()
	var pre *preload // the device part, copied layer by layer as it arrives
	defer func() {
		if pre != nil {
			pre.release()
		}
	}()
	if n := r.ContentLength; n >= 0 {
		// Validated as it arrives, hashed while the rest is arriving; with
		// a device tier, its first layers are copied to device memory as
		// they arrive.
		opts := container.ReadOptions{Alloc: func(n int) []byte { buf = h.store.bufs.get(n); return buf }}
		if h.store.dev != nil {
			opts.Header = func(hd *container.Header) { pre = h.store.preload(hd) }
			opts.Layer = func(i int, octets []byte) {
				if pre != nil {
					pre.layer(i, octets)
				}
			}
		}
		blk, err = container.ReadBlockWith(body, n, g, opts)
		if pre != nil && !pre.finish() {
			pre = nil // freed: placed by a copy, if at all
		}
	} else {
		var data []byte
		data, err = io.ReadAll(io.LimitReader(body, max+1))
		if err == nil && int64(len(data)) > max {
			err = fmt.Errorf("%w: a block of this geometry is at most %d octets", kvsp.ErrTooLarge, max)
		}
		if err == nil {
			blk, err = container.OpenBlock(data, g)
		}
	}
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) || errors.Is(err, kvsp.ErrTooLarge) {
			return err
		}
		if errors.Is(err, errSlowBody) {
			h.m.slowBodies.Inc()
			return err
		}
		return fmt.Errorf("%w: %v", kvsp.ErrInvalid, err)
	}
	if want != nil && *want != blk.ContainerDigest() {
		return fmt.Errorf("%w: Repr-Digest differs from the body", kvsp.ErrDigestMismatch)
	}
	e, evicted, demoted, err := h.store.putWith(id, blk, g, pre)
	if err == nil {
		buf = nil // the store's now
	}
	h.demoted(demoted, evicted)
	if err != nil {
		return err
	}
	h.m.puts.Inc()
	h.enqueue(e, false)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusCreated)
	return nil
}

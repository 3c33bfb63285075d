package index

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/bytebufferpool"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/server"
)

// Config configures a Service.
type Config struct {
	// MaxTTL caps every record's ttl_ms (R-IS-5).
	MaxTTL time.Duration
	// MaxLookupKeys bounds a lookup (413 above it, A-27; R-SEC-14).
	MaxLookupKeys int
	// Status, when set, gives lookups their estimates.
	Status StatusSource
	// ProducerDigests accepts a replica record only with the digest the
	// block's producer stated (PUT producers/{key}, from an identity of
	// the instance or producer role that speaks for the producer and may
	// use the scope): without a statement, or with another digest, the
	// publish is refused (409), so every replica a lookup returns carries
	// its producer's digest (R-SEC-8, RELIABILITY S13).
	ProducerDigests bool
	// BlockTokens gives B for a compat_id, for recompute_us;
	// without it targets get no estimates.
	BlockTokens func(kvsp.CompatID) (int, bool)
	// Layers gives a compat_id's layer count (its descriptor's): a record
	// lists at most that many layer digests and residency entries, and
	// MaxRecordLayers where the IS has no descriptor (RELIABILITY B9: a
	// record of 15,000 layer digests made every lookup naming it 1 MiB).
	Layers          func(kvsp.CompatID) (int, bool)
	MaxRecordLayers int
	// MaxHolderRecords bounds the live records of one holder (429 beyond
	// it); default DefaultMaxHolderRecords.
	MaxHolderRecords int
	// MaxResponseBytes bounds a lookup's answer (413 beyond it, naming
	// the bound); default DefaultMaxResponseBytes.
	MaxResponseBytes int
	// Logger and Registerer are optional.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Defaults of the IS's record and answer bounds (B9).
const (
	DefaultMaxRecordLayers  = 1024    // layers of a model the IS has no descriptor for
	DefaultMaxHolderRecords = 1 << 22 // about 4 M records of one holder
	DefaultMaxResponseBytes = 32 << 20
	// maxPooledBody bounds the answer buffers kept for reuse: a larger one
	// goes back to the collector, so one huge answer does not stay in the
	// heap for good.
	maxPooledBody = 1 << 20
)

// Validate reports a bad field.
func (c *Config) Validate() error {
	switch {
	case c.MaxTTL <= 0:
		return errors.New("index: max_ttl_ms: required")
	case c.MaxLookupKeys <= 0:
		return errors.New("index: max_lookup_keys: required")
	case c.MaxRecordLayers < 0 || c.MaxHolderRecords < 0 || c.MaxResponseBytes < 0:
		return errors.New("index: negative bound")
	}
	return nil
}

// Service is the Index Service's HTTP handlers over a Backend.
type Service struct {
	cfg Config
	b   Backend
	m   *metrics
}

// New returns a Service storing records in b.
func New(cfg Config, b Backend) (*Service, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxRecordLayers == 0 {
		cfg.MaxRecordLayers = DefaultMaxRecordLayers
	}
	if cfg.MaxHolderRecords == 0 {
		cfg.MaxHolderRecords = DefaultMaxHolderRecords
	}
	if cfg.MaxResponseBytes == 0 {
		cfg.MaxResponseBytes = DefaultMaxResponseBytes
	}
	s := &Service{cfg: cfg, b: b, m: newMetrics(cfg.Registerer)}
	if mem, ok := b.(*Memory); ok {
		f := func(n int) { s.m.expirations.Add(float64(n)) }
		mem.onExpire.Store(&f) // its sweeper is already running
	}
	return s, nil
}

// Mount adds the IS routes of the resource table under r, and PUT
// producers/{key}, kvsp's extension for producers' digests (callers: the
// instance and producer roles).
func (s *Service) Mount(r *server.Router) error {
	r.Handle("PUT", "producers/{key}", server.Route{Roles: []server.Role{server.RoleInstance, server.RoleProducer}}, s.stateDigest)
	return server.MountRole(r, server.RoleIndex, map[string]server.HandlerFunc{
		"POST lookup":                    s.lookup,
		"PUT replicas/{holder}/{key}":    s.publish,
		"DELETE replicas/{holder}/{key}": s.withdraw,
	})
}

// stateDigest stores a producer's statement of a block's digest (kvsp's
// extension, R-SEC-8: "the producing instance can publish the digest
// itself"): the scope is checked first, then that the caller speaks for
// the producer it names.
func (s *Service) stateDigest(w http.ResponseWriter, r *http.Request) error {
	var rec kvsp.ProducerRecord
	if err := server.DecodeJSON(r, &rec); err != nil {
		return err
	}
	p := server.PrincipalFrom(r.Context())
	if !p.MayUseScope(rec.ScopeID) {
		return fmt.Errorf("%w: producer record", kvsp.ErrScopeDenied)
	}
	if key, err := kvsp.ParseBlockKey(r.PathValue("key")); err != nil || key != rec.BlockKey {
		return fmt.Errorf("%w: the path's key is not the record's", kvsp.ErrInvalid)
	}
	if !p.SpeaksFor(rec.Producer) {
		return fmt.Errorf("%w: not authorized to state digests for this producer", kvsp.ErrForbidden)
	}
	ttl := min(kvsp.Millis(rec.TTLMs), s.cfg.MaxTTL)
	rec.TTLMs = remainingMs(ttl)
	if err := s.b.Pin(r.Context(), &rec, ttl); err != nil {
		if errors.Is(err, ErrProducerConflict) {
			s.m.rejected.WithLabelValues("producer").Inc()
		}
		return err
	}
	s.m.statements.Inc()
	return server.WriteJSON(w, http.StatusOK, &rec)
}

func (s *Service) publish(w http.ResponseWriter, r *http.Request) error {
	var rec kvsp.ReplicaRecord
	if err := server.DecodeJSON(r, &rec); err != nil {
		s.m.rejected.WithLabelValues("invalid").Inc()
		return err
	}
	key, err := kvsp.ParseBlockKey(r.PathValue("key"))
	if err != nil {
		s.m.rejected.WithLabelValues("invalid").Inc()
		return err
	}
	if key != rec.BlockKey || r.PathValue("holder") != kvsp.ResourceID(rec.Holder) {
		s.m.rejected.WithLabelValues("path").Inc()
		return fmt.Errorf("%w: path and record disagree (A-28)", kvsp.ErrInvalid)
	}
	p := server.PrincipalFrom(r.Context())
	if !p.SpeaksFor(rec.Holder) {
		s.m.rejected.WithLabelValues("holder").Inc()
		return fmt.Errorf("%w: not authorized to publish for this holder (R-IS-2)", kvsp.ErrForbidden)
	}
	if !p.MayUseScope(rec.ScopeID) {
		s.m.rejected.WithLabelValues("scope").Inc()
		return fmt.Errorf("%w: publish", kvsp.ErrScopeDenied)
	}
	if err := s.checkLayers(&rec); err != nil {
		s.m.rejected.WithLabelValues("layers").Inc()
		return err
	}
	if s.cfg.ProducerDigests {
		// The digest binds the layer digests only if they hash to it: a
		// holder publishing the producer's digest beside layer digests of
		// its own would have consumers verify layers against the latter.
		if len(rec.LayerDigests) > 0 && !layersMatch(&rec) {
			s.m.rejected.WithLabelValues("layers").Inc()
			return fmt.Errorf("%w: layer_digests do not hash to the digest", kvsp.ErrInvalid)
		}
	}
	ttl := kvsp.Millis(rec.TTLMs)
	if ttl > s.cfg.MaxTTL {
		ttl = s.cfg.MaxTTL
		rec.TTLMs = remainingMs(ttl)
	}
	created, err := s.b.Put(r.Context(), &rec, ttl, PutOptions{PinDigest: s.cfg.ProducerDigests, MaxHolderRecords: s.cfg.MaxHolderRecords})
	switch {
	case errors.Is(err, ErrDigestConflict):
		s.m.rejected.WithLabelValues("digest").Inc()
	case errors.Is(err, ErrNoProducerDigest):
		s.m.rejected.WithLabelValues("no_producer").Inc()
	case errors.Is(err, ErrRecordQuota):
		s.m.rejected.WithLabelValues("quota").Inc()
	}
	if err != nil {
		return err
	}
	status := http.StatusOK
	if created {
		status = http.StatusCreated
		s.m.publishes.Inc()
	} else {
		s.m.refreshes.Inc()
	}
	return server.WriteJSON(w, status, &rec)
}

// layersMatch reports whether a record's layer digests, one per layer of
// the block, hash to its digest (spec "KV Block Container": the replica
// digest is the SHA-256 of the layer digests in ascending order).
func layersMatch(rec *kvsp.ReplicaRecord) bool {
	h := sha256.New()
	for i := range rec.LayerDigests {
		h.Write(rec.LayerDigests[i][:])
	}
	var d kvsp.Digest
	h.Sum(d[:0])
	return d == rec.Digest
}

// checkLayers bounds a record by its model's layers (B9): its layer
// digests and residency entries, and the layers these name.
func (s *Service) checkLayers(rec *kvsp.ReplicaRecord) error {
	layers, known := 0, false
	if s.cfg.Layers != nil {
		layers, known = s.cfg.Layers(rec.CompatID)
	}
	if !known {
		layers = s.cfg.MaxRecordLayers
	}
	what := "the model's"
	if !known {
		what = "the index's bound of"
	}
	switch {
	case len(rec.LayerDigests) > layers:
		return fmt.Errorf("%w: layer_digests: %d, more than %s %d layers", kvsp.ErrInvalid, len(rec.LayerDigests), what, layers)
	case len(rec.Residency) > layers:
		return fmt.Errorf("%w: residency: %d entries, more than %s %d layers", kvsp.ErrInvalid, len(rec.Residency), what, layers)
	}
	for i, x := range rec.Residency {
		if int64(x.Layers[1]) >= int64(layers) {
			return fmt.Errorf("%w: residency[%d].layers: past %s %d layers", kvsp.ErrInvalid, i, what, layers)
		}
	}
	return nil
}

func (s *Service) withdraw(w http.ResponseWriter, r *http.Request) error {
	key, err := kvsp.ParseBlockKey(r.PathValue("key"))
	if err != nil {
		return err
	}
	p := server.PrincipalFrom(r.Context())
	id := r.PathValue("holder")
	holder := ""
	for _, b := range p.Bases {
		if kvsp.ResourceID(b) == id {
			holder = b
			break
		}
	}
	if holder == "" {
		return fmt.Errorf("%w: not authorized to withdraw for this holder", kvsp.ErrForbidden)
	}
	err = s.b.Delete(r.Context(), holder, key, func(rec *kvsp.ReplicaRecord) error {
		if !p.MayUseScope(rec.ScopeID) {
			return fmt.Errorf("%w: withdraw", kvsp.ErrScopeDenied)
		}
		return nil
	})
	if err != nil {
		return err
	}
	s.m.withdrawals.Inc()
	return server.NoContent(w)
}

func (s *Service) lookup(w http.ResponseWriter, r *http.Request) error {
	var q kvsp.LookupRequest
	if err := server.DecodeJSON(r, &q); err != nil {
		return err
	}
	if !server.PrincipalFrom(r.Context()).MayUseScope(q.ScopeID) {
		return fmt.Errorf("%w: lookup", kvsp.ErrScopeDenied) // before any probe
	}
	if len(q.BlockKeys) > s.cfg.MaxLookupKeys {
		return kvsp.NewProblem(kvsp.ErrTooLarge, fmt.Sprintf("at most %d block keys per lookup", s.cfg.MaxLookupKeys)).
			With("max_block_keys", s.cfg.MaxLookupKeys)
	}
	res := resultPool.Get().(*Result)
	defer putResult(res)
	if i, j, ok := res.repeatedKey(q.BlockKeys); ok { // a chain never repeats a key: B9's amplification did
		return fmt.Errorf("%w: block_keys[%d] repeats block_keys[%d]", kvsp.ErrInvalid, j, i)
	}
	if err := s.b.Lookup(r.Context(), q.ScopeID, q.CompatID, q.BlockKeys, res); err != nil {
		if errors.Is(err, kvsp.ErrUnavailable) {
			return err
		}
		return fmt.Errorf("%w: index backend: %v", kvsp.ErrUnavailable, err)
	}
	reps := res.Replicas
	resp := kvsp.LookupResponse{Matched: len(reps), Replicas: reps}
	if len(q.Targets) > 0 && s.cfg.Status != nil && s.cfg.BlockTokens != nil {
		if b, ok := s.cfg.BlockTokens(q.CompatID); ok {
			for _, t := range q.Targets {
				st, ok := s.cfg.Status.Status(t)
				if !ok {
					continue // no estimate for an unknown target (R-IS-16)
				}
				if f, rc, ok := Estimate(&st, reps, b); ok {
					resp.Targets = append(resp.Targets, kvsp.TargetEstimate{Instance: t, FetchUs: f, RecomputeUs: rc})
				}
			}
		}
	}
	s.m.lookups.Inc()
	s.m.matched.Observe(float64(resp.Matched))
	s.m.keysAsked.Add(float64(len(q.BlockKeys)))
	s.m.keysMatched.Add(float64(resp.Matched))
	if n := answerSize(&resp); n > s.cfg.MaxResponseBytes { // before it is encoded
		return kvsp.NewProblem(kvsp.ErrTooLarge, fmt.Sprintf("the answer would be about %d octets, above the bound of %d: ask for fewer keys", n, s.cfg.MaxResponseBytes)).
			With("max_response_octets", s.cfg.MaxResponseBytes)
	}
	bb := bodyPool.Get()
	defer func() {
		if cap(bb.B) <= maxPooledBody { // an oversized answer's buffer is not kept (B9)
			bodyPool.Put(bb)
		}
	}()
	bb.B = resp.AppendJSON(bb.B[:0])
	return server.WriteJSONBody(w, http.StatusOK, bb.B)
}

// repeatedKey finds a key listed twice (their indexes), in a set kept
// with the Result for reuse.
func (r *Result) repeatedKey(keys []kvsp.BlockKey) (int, int, bool) {
	if len(keys) < 2 {
		return 0, 0, false
	}
	if r.seen == nil {
		r.seen = make(map[kvsp.BlockKey]int, len(keys))
	}
	defer clear(r.seen)
	for j, k := range keys {
		if i, dup := r.seen[k]; dup {
			return i, j, true
		}
		r.seen[k] = j
	}
	return 0, 0, false
}

// answerSize bounds the encoded size of a lookup's answer from above,
// without encoding it: per record its fixed members and hex, plus each
// layer digest and residency entry at their longest.
func answerSize(r *kvsp.LookupResponse) int {
	n := 64
	for _, reps := range r.Replicas {
		n += 4
		for i := range reps {
			x := &reps[i]
			n += 512 + len(x.Holder) + 70*len(x.LayerDigests) + 96*len(x.Residency)
		}
	}
	return n + 160*len(r.Targets)
}

// bodyPool holds the answers' buffers: bytebufferpool sizes a new one to
// the answers most often seen (BenchmarkBodyPool: as fast as a sync.Pool
// of fixed 64 KiB slices, fewer octets allocated).
var bodyPool bytebufferpool.Pool

var resultPool = sync.Pool{New: func() any { return new(Result) }}

// putResult returns a lookup's Result to the pool unless it grew past what
// ordinary lookups need.
func putResult(r *Result) {
	if cap(r.flat) > 1<<14 || r.reply.Cap() > maxPooledBody || cap(r.arena.residency) > 1<<14 || cap(r.args) > 1<<14 || cap(r.names) > maxPooledBody {
		return
	}
	resultPool.Put(r)
}

type metrics struct {
	lookups, publishes, refreshes, withdrawals, expirations prometheus.Counter
	statements                                              prometheus.Counter
	keysAsked, keysMatched                                  prometheus.Counter
	matched                                                 prometheus.Histogram
	rejected                                                *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	c := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsp_index_" + name, Help: help})
	}
	m := &metrics{
		lookups:     c("lookups_total", "Lookups answered."),
		publishes:   c("publishes_total", "Records created."),
		statements:  c("producer_statements_total", "Producers' digests stated (PUT producers/{key}) and stored."),
		refreshes:   c("refreshes_total", "Records refreshed."),
		withdrawals: c("withdrawals_total", "Records withdrawn."),
		expirations: c("expirations_total", "Records expired and swept."),
		keysAsked:   c("lookup_keys_total", "Block keys asked in lookups."),
		keysMatched: c("lookup_keys_matched_total", "Block keys matched in lookups (hit ratio = matched / asked)."),
		matched: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvsp_index_lookup_matched", Help: "Matched prefix length per lookup.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 13)}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvsp_index_publish_rejected_total", Help: "Publishes rejected, by reason."}, []string{"reason"}),
	}
	if reg != nil {
		reg.MustRegister(m.lookups, m.publishes, m.refreshes, m.withdrawals, m.expirations, m.keysAsked, m.keysMatched, m.matched, m.rejected, m.statements)
	}
	return m
}

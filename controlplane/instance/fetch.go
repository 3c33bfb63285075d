package instance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
)

// The fetch side of the agent: a block is loaded once however many
// directives want it (load), from the first source that serves it
// verified (transfer), through the agent's Fetcher (a GET, a quicbulk
// stream or an RDMA READ, as cmd configures it).

// Fetcher brings one block of geometry g from one holder (src, its base
// URI): its layers in order, each checked against o.LayerDigests where
// they are given, else the block checked whole (Repr-Digest) by the
// stream's end. cmd chooses the implementation: GetFetcher (HTTPS GET
// over HTTP/1.1, HTTP/2 or HTTP/3), GetFetcher over a client whose block
// transport is quicbulk, or RDMAFetcher (one-sided READ, falling back to
// another Fetcher).
type Fetcher interface {
	Fetch(ctx context.Context, src string, ref client.BlockRef, g container.Geometry, o client.GetOptions) (Layers, error)
}

// Layers is a fetched block's layers as they arrive: io.EOF after the
// last, once the block is verified.
type Layers interface {
	Next() (container.Layer, error)
	Close() error
}

// wholeBlock is the optional capability of Layers whose block was read
// and verified whole before its first layer (an RDMA READ into registered
// memory): its layers go to the engine as they are, none held back for a
// verification still to come.
type wholeBlock interface {
	Whole() *container.Block
}

// GetFetcher fetches by GET through Client's block transport (HTTP/1.1,
// HTTP/2 or HTTP/3; quicbulk when the client's Config.Bulk is a
// quicbulk.Transport).
type GetFetcher struct {
	Client *client.Client
}

// Fetch implements Fetcher.
func (f GetFetcher) Fetch(ctx context.Context, src string, ref client.BlockRef, g container.Geometry, o client.GetOptions) (Layers, error) {
	return f.Client.Holder(src).GetBlock(ctx, ref, g, o)
}

// RDMAFetcher fetches by one-sided RDMA READ from holders that serve
// rdma/reads, and through Fallback from the others: a holder without
// RDMA answers 404 like a missing block, so either way the GET (which
// says which) is tried. A digest mismatch is not retried by GET.
type RDMAFetcher struct {
	Client   *client.Client
	Reader   client.RDMAReader
	Fallback Fetcher
	Logger   *slog.Logger
}

// Fetch implements Fetcher.
func (f RDMAFetcher) Fetch(ctx context.Context, src string, ref client.BlockRef, g container.Geometry, o client.GetOptions) (Layers, error) {
	blk, release, err := f.Client.Holder(src).ReadBlockRDMA(ctx, ref, g, o, f.Reader)
	if err == nil {
		return &readBlock{blk: blk, release: release, next: blk.Header().FirstLayer}, nil
	}
	if f.Fallback == nil || ctx.Err() != nil || errors.Is(err, kvsp.ErrDigestMismatch) {
		return nil, err
	}
	if f.Logger != nil {
		f.Logger.Debug("RDMA read failed; fetching by GET", "holder", src, "err", err)
	}
	return f.Fallback.Fetch(ctx, src, ref, g, o)
}

// readBlock is a block read whole (and verified) into registered memory,
// given as its layers; Close gives the memory back.
type readBlock struct {
	blk     *container.Block
	release func()
	next    uint32
	done    bool
}

func (r *readBlock) Whole() *container.Block { return r.blk }

func (r *readBlock) Next() (container.Layer, error) {
	if r.done {
		return container.Layer{}, io.EOF
	}
	k, v, err := r.blk.Layer(r.next)
	if err != nil {
		return container.Layer{}, err
	}
	l := container.Layer{Index: r.next, K: k, V: v}
	if r.done = r.next == r.blk.Header().LastLayer(); !r.done {
		r.next++
	}
	return l, nil
}

func (r *readBlock) Close() error {
	r.release()
	return nil
}

// layerSet is what the IS's records say of a directive's blocks' layer
// digests: each (holder, key)'s own, and for each key the one list every
// record of it agrees on (with the IS's producer_digests, the producer's).
type layerSet struct {
	of     map[string][]container.Digest // holder|key
	agreed map[kvsp.BlockKey][]container.Digest
	differ map[kvsp.BlockKey]bool // records disagree: no agreed list
}

// forSource gives the layer digests to check src's replica of key with:
// its own record's, or, for a source the IS has no record of (a
// directive may name any holder), the digests the key's records agree
// on, so that an unrecorded holder's self-consistent bytes are held to
// what the recorded replicas are (RELIABILITY S8). Nil: none known, the
// block is verified whole (Repr-Digest) before any layer is placed.
func (s layerSet) forSource(src string, key kvsp.BlockKey) []container.Digest {
	if ds, ok := s.of[src+"|"+key.String()]; ok {
		return ds
	}
	return s.agreed[key]
}

// layerDigests looks the directive's keys up at the IS for the layer
// digests of each (holder, key), so layers are verified as they arrive;
// without them (IS unreachable), blocks are verified whole (Repr-Digest)
// before any layer is placed. The PC looked the same keys up to place
// the request, but a directive carries no digests (the spec's prefetch
// block is a key and its sources), and the IS is where a producer's
// digests are pinned (producer_digests, RELIABILITY S8): one lookup per
// directive, not per block, asked of the party that vouches for them
// rather than taken from the one that relays them.
func (a *Agent) layerDigests(ctx context.Context, d *kvsp.PrefetchDirective) layerSet {
	out := layerSet{of: map[string][]container.Digest{}, agreed: map[kvsp.BlockKey][]container.Digest{}, differ: map[kvsp.BlockKey]bool{}}
	if a.cfg.Index == "" {
		return out
	}
	keys := make([]kvsp.BlockKey, len(d.Blocks))
	for i, b := range d.Blocks {
		keys[i] = b.BlockKey
	}
	resp, err := a.cfg.Client.Index(a.cfg.Index).Lookup(ctx, &kvsp.LookupRequest{ScopeID: d.ScopeID, CompatID: d.CompatID, BlockKeys: keys})
	if err != nil {
		a.log.Warn("lookup for layer digests failed; verifying whole blocks", "err", err)
		return out
	}
	for _, reps := range resp.Replicas {
		for _, r := range reps {
			ds := make([]container.Digest, len(r.LayerDigests))
			for i, l := range r.LayerDigests {
				ds[i] = container.Digest(l)
			}
			out.of[r.Holder+"|"+r.BlockKey.String()] = ds
			k := r.BlockKey
			switch prev, seen := out.agreed[k]; {
			case len(ds) == 0 || out.differ[k]:
			case !seen:
				out.agreed[k] = ds
			case !slices.Equal(prev, ds):
				delete(out.agreed, k)
				out.differ[k] = true
			}
		}
	}
	return out
}

// flight is one block's transfer in progress, which other directives
// wanting the block wait for instead of fetching it again.
type flight struct {
	done    chan struct{} // closed when the transfer ended
	waiters int           // directives that waited for it (under Agent.mu)
}

// load makes one block resident: already there, by the transfer of it
// in progress for another directive (waited for: however many
// directives want a block at once, it is fetched once), or from the first
// source that serves it verified. own reports that this call transferred
// the block and no other directive waited for it.
func (a *Agent) load(ctx context.Context, x *directive, b kvsp.PrefetchBlock, digests layerSet, leased bool) (own bool, err error) {
	kv := a.cfg.Engine.KV()
	for !kv.Has(b.BlockKey) {
		a.mu.Lock()
		f := a.flights[b.BlockKey]
		if f == nil {
			f = &flight{done: make(chan struct{})}
			a.flights[b.BlockKey] = f
			a.mu.Unlock()
			err := a.transfer(ctx, x, b, digests, leased)
			a.mu.Lock()
			delete(a.flights, b.BlockKey)
			shared := f.waiters > 0
			a.mu.Unlock()
			close(f.done)
			return err == nil && !shared, err
		}
		f.waiters++
		a.mu.Unlock()
		select {
		case <-f.done: // resident now, or this call tries itself
		case <-ctx.Done():
			a.m.blocks.WithLabelValues("failed").Inc()
			return false, ctx.Err()
		}
		if kv.Has(b.BlockKey) {
			a.m.blocks.WithLabelValues("shared").Inc()
		}
	}
	return false, nil
}

// transfer fetches one block from the first of its sources that serves
// it verified.
func (a *Agent) transfer(ctx context.Context, x *directive, b kvsp.PrefetchBlock, digests layerSet, leased bool) error {
	kv := a.cfg.Engine.KV()
	var errs []error
	for i, src := range b.Sources {
		err := a.fetch(ctx, x, b.BlockKey, src, digests.forSource(src, b.BlockKey), leased && i == 0)
		if err == nil {
			a.m.blocks.WithLabelValues("loaded").Inc()
			return nil
		}
		kv.Drop(b.BlockKey) // nothing unverified stays
		if errors.Is(err, container.ErrDigestMismatch) || errors.Is(err, kvsp.ErrDigestMismatch) {
			a.m.digestFailures.Inc()
			a.log.Error("a replica failed verification; trying the next source", "holder", src)
		}
		errs = append(errs, fmt.Errorf("%s: %w", src, err))
		if ctx.Err() != nil {
			break
		}
	}
	a.m.blocks.WithLabelValues("failed").Inc()
	return errors.Join(errs...)
}

// errLease and errEngine mark a block's failure at its lease and at the
// engine's KV (failureReason).
var (
	errLease  = errors.New("lease")
	errEngine = errors.New("engine KV")
)

// fetch loads one block from one source under a lease (its own, unless
// the block is covered by its group's), through the agent's Fetcher.
// Layers with their digests, or of a block verified whole before its
// first layer, are placed as they arrive; without either they are held
// until the stream's end has verified the block.
func (a *Agent) fetch(ctx context.Context, x *directive, key kvsp.BlockKey, src string, layerDigests []container.Digest, leased bool) error {
	d := &x.d
	if !leased {
		h := a.cfg.Client.Holder(src)
		ls, err := h.Lease(ctx, &kvsp.LeaseRequest{ScopeID: d.ScopeID, CompatID: d.CompatID, BlockKeys: []kvsp.BlockKey{key}, TTLMs: d.LeaseMs})
		if err != nil {
			return fmt.Errorf("%w: %w", errLease, err)
		}
		defer func() { // the lease only covers the transfer
			rctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			h.ReleaseLease(rctx, ls.Lease)
		}()
	}
	ref := client.BlockRef{Compat: d.CompatID, Scope: d.ScopeID, Key: key}
	start := time.Now()
	s, err := a.fetcher.Fetch(ctx, src, ref, a.g, client.GetOptions{LayerDigests: layerDigests, ReplicaCodec: container.CodecRaw})
	if err != nil {
		return err
	}
	defer s.Close()
	_, whole := s.(wholeBlock)
	kv := a.cfg.Engine.KV()
	var held []container.Layer // placed once the whole block verified
	var streamed uint64        // octets after the first layer (links)
	for i := 0; ; i++ {
		l, err := s.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		n := uint64(len(l.K) + len(l.V))
		if i == 0 {
			if since, first := x.firstFrom(src, start); first {
				a.links.roundTrip(src, time.Since(since))
			}
			done := a.links.streaming(src)
			defer func() { done(streamed) }()
		} else {
			streamed += n
		}
		x.moved.Add(n)
		a.m.fetched.WithLabelValues(x.purpose).Add(float64(n))
		if layerDigests != nil || whole {
			if err := kv.WriteLayer(key, l.Index, l.K, l.V); err != nil {
				return fmt.Errorf("%w: %w", errEngine, err)
			}
			continue
		}
		held = append(held, container.Layer{Index: l.Index, K: bytes.Clone(l.K), V: bytes.Clone(l.V)})
	}
	for _, l := range held {
		if err := kv.WriteLayer(key, l.Index, l.K, l.V); err != nil {
			return fmt.Errorf("%w: %w", errEngine, err)
		}
	}
	if whole {
		a.m.rdmaBlocks.Inc()
	}
	return a.loaded(src, ref)
}

// loaded finishes a block fetched from src: every layer must be resident,
// and a copy goes to the instance's own holder when that is closer than
// src (copyCloser), for the next request here.
func (a *Agent) loaded(src string, ref client.BlockRef) error {
	if !a.cfg.Engine.KV().Has(ref.Key) {
		return fmt.Errorf("%w: the block's layers are not all resident", kvsp.ErrLayersUnavailable)
	}
	if src == a.cfg.Holder || a.cfg.Holder == "" {
		return nil
	}
	if !a.copyCloser(src) {
		a.m.offloads.WithLabelValues("not_closer").Inc()
		return nil
	}
	a.offload(ref.Scope, ref.Compat, ref.Key, copyPosition)
	return nil
}

// copyCloser reports whether a block loaded from src is worth a copy at
// the instance's own holder: that holder's link (as configured: where a
// holder sits, not how loaded it was at one transfer; the own holder is
// rarely fetched from, so a measured link would be compared with a
// configured one) moves a
// block faster than src's, or the links are not both known. A copy over
// a link no faster is a PUT (a body sent, hashed twice, stored, published)
// for no quicker load: in kvsp demo --speed 24, whose instances reach
// both holders over one loopback, those copies took the CPU that the
// first copies of computed blocks needed.
func (a *Agent) copyCloser(src string) bool {
	var own, from *kvsp.Link
	for i := range a.cfg.Links {
		switch l := &a.cfg.Links[i]; l.Holder {
		case a.cfg.Holder:
			own = l
		case src:
			from = l
		}
	}
	if own == nil || from == nil || own.MbitPerS == 0 || from.MbitPerS == 0 {
		return true
	}
	bits := float64(8 * a.off.blockOctets)
	us := func(l *kvsp.Link) float64 { return float64(l.RTTUs) + bits/float64(l.MbitPerS) }
	return us(own) < us(from)
}

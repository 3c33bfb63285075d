package holder

import (
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsp/kvsp"
)

// record is the Replica Record of a stored block (R-IS-1, A-1, A-8, A-14).
// Only blocks of all the model's layers are published: a partial block's
// record could not carry the producer's digests of the layers it lacks.
func (h *Holder) record(e *entry) (*kvsp.ReplicaRecord, bool) {
	hdr := &e.hdr
	g, err := h.geometry(e.id.compat)
	if err != nil || hdr.FirstLayer != 0 || (!g.Unknown() && uint32(hdr.LayerCount()) != g.Layers) {
		return nil, false
	}
	if g.Unknown() { // without the descriptor: the layers the block holds, from 0
		g.Layers = uint32(hdr.LayerCount())
	}
	lds := e.layers
	res := h.store.residence(e).residency(g.Layers, rates{host: h.cfg.ReadMbitPerS, device: h.cfg.DeviceReadMbitPerS, disk: h.cfg.DiskReadMbitPerS})
	rec := &kvsp.ReplicaRecord{
		BlockKey: e.id.key, CompatID: e.id.compat, ScopeID: e.id.scope, Holder: h.cfg.Base,
		Codec: kvsp.Codec(hdr.Codec), Size: e.payload, Digest: kvsp.Digest(e.replica),
		LayerDigests: make([]kvsp.LayerDigest, len(lds)),
		Residency:    res,
		TTLMs:        uint64(h.cfg.RecordTTL.Milliseconds()),
	}
	for i := range lds {
		rec.LayerDigests[i] = kvsp.LayerDigest(lds[i])
	}
	return rec, true
}

// enqueue schedules a publish or a withdrawal.
func (h *Holder) enqueue(e *entry, withdraw bool) {
	if h.cfg.Index == nil {
		return
	}
	h.pubMu.Lock()
	h.pending = append(h.pending, pubOp{e, withdraw})
	h.pubMu.Unlock()
	select {
	case h.pubWake <- struct{}{}:
	default:
	}
}

// Publishing: a pass sends up to publishConcurrency index updates at a
// time (one HTTPS request each: the IS has no batch form), new records
// and withdrawals before refreshes, and at most refreshPerPass refreshes,
// so a block stored now is published now, not after a refresh of every
// record the holder has (tens of thousands under load: sharing
// collapsed behind that backlog).
const (
	publishConcurrency = 16
	refreshPerPass     = 1024
)

// publisher publishes and withdraws as blocks come and go, and refreshes
// every record at a third of its effective TTL; failed operations are
// retried with backoff, so an IS outage is survived. An update the IS
// did not answer ends the pass (the rest waits for the next one, not one
// timeout each), one it refused for good (a 4xx other than 408 and 429)
// is dropped and counted, and a stop is seen between any two updates:
// Close never waits for a backlog to drain against an IS that is gone.
func (h *Holder) publisher() {
	defer close(h.done)
	if h.cfg.Index == nil { // nothing to publish to (the refresh below would have called it)
		<-h.stop
		return
	}
	refresh := time.NewTicker(h.cfg.RecordTTL / 3)
	defer refresh.Stop()
	backoff := 100 * time.Millisecond
	retry := time.NewTimer(time.Hour)
	defer retry.Stop()
	more := false // refreshes left over from the last pass
	for {
		if !more {
			select {
			case <-h.stop:
				return
			case <-h.pubWake:
			case <-retry.C:
			case <-refresh.C:
				all := h.store.all()
				h.pubMu.Lock()
				for _, e := range all {
					h.renew = append(h.renew, pubOp{e: e})
				}
				h.pubMu.Unlock()
			}
		}
		h.pubMu.Lock()
		ops := h.pending
		h.pending = nil
		n := min(len(h.renew), refreshPerPass)
		ops = append(ops, h.renew[:n]...)
		h.renew = h.renew[n:]
		h.pubMu.Unlock()
		failed, stopped := h.pass(ops)
		h.pubMu.Lock()
		if len(failed) > 0 {
			h.pending = append(failed, h.pending...)
		}
		more = len(h.renew) > 0 && len(failed) == 0
		// Counted when Close came too: the backlog left behind is shown.
		h.m.publishPending.Set(float64(len(h.pending) + len(h.renew)))
		h.pubMu.Unlock()
		if stopped {
			return
		}
		if len(failed) > 0 {
			retry.Reset(backoff)
			backoff = min(2*backoff, 10*time.Second)
		} else {
			backoff = 100 * time.Millisecond
		}
	}
}

// pass sends ops in publishConcurrency lanes, a block's updates in one
// lane in their order (a withdrawal never overtakes the publish before
// it), and returns those to retry: the failed ones and, after an update
// the IS did not answer or a stop, the rest of their lanes (stopped when
// Close came).
func (h *Holder) pass(ops []pubOp) (retry []pubOp, stopped bool) {
	lanes := make([][]pubOp, publishConcurrency)
	for _, op := range ops {
		k := op.e.id.key
		i := int(binary.LittleEndian.Uint32(k[:4]) % publishConcurrency)
		lanes[i] = append(lanes[i], op)
	}
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		halt atomic.Bool // the IS did not answer: the rest waits
	)
	for _, lane := range lanes {
		if len(lane) == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j, op := range lane {
				select {
				case <-h.stop:
					halt.Store(true)
				default:
				}
				if halt.Load() {
					mu.Lock()
					retry = append(retry, lane[j:]...)
					mu.Unlock()
					return
				}
				err := h.apply(op)
				if err == nil {
					continue
				}
				why := publishFailure(err)
				h.m.publishFailures.WithLabelValues(why).Inc()
				h.log.Warn("index update failed", "withdraw", op.withdraw, "why", why, "err", err)
				if why == "refused" {
					continue // it would be refused again
				}
				mu.Lock()
				retry = append(retry, lane[j:]...) // the block's later updates stay behind it
				mu.Unlock()
				if why == "unreachable" {
					halt.Store(true)
				}
				return
			}
		}()
	}
	wg.Wait()
	select {
	case <-h.stop:
		stopped = true
	default:
	}
	return retry, stopped
}

// publishFailure classifies a failed index update: refused (a 4xx other
// than 408 and 429: the same update would be refused again), unavailable
// (429, 408, 5xx) or unreachable (no answer).
func publishFailure(err error) string {
	var p *kvsp.Problem
	switch {
	case !errors.As(err, &p):
		return "unreachable"
	case p.Status >= 400 && p.Status < 500 && p.Status != 408 && p.Status != 429:
		return "refused"
	}
	return "unavailable"
}

func (h *Holder) apply(op pubOp) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if op.withdraw {
		op.e.mu.Lock()
		op.e.published = time.Time{}
		op.e.mu.Unlock()
		return h.cfg.Index.Withdraw(ctx, h.cfg.Base, op.e.id.key)
	}
	if h.store.peek(op.e.id) != op.e {
		return nil // evicted meanwhile; its withdrawal is queued
	}
	rec, ok := h.record(op.e)
	if !ok {
		return nil
	}
	got, _, err := h.cfg.Index.Publish(ctx, rec)
	if err != nil {
		return err
	}
	op.e.mu.Lock()
	op.e.published = time.Now().Add(kvsp.Millis(got.TTLMs))
	op.e.mu.Unlock()
	if h.log.Enabled(ctx, slog.LevelDebug) { // one per record: its arguments are not built for nothing
		h.log.Debug("replica published", "scope", rec.ScopeID, "compat", rec.CompatID, "block", rec.BlockKey, "ttl_ms", got.TTLMs)
	}
	return nil
}

// Close stops the publisher and withdraws every record it published
// (best effort, bounded by ctx): a record never published is not
// withdrawn, and an IS that does not answer ends the withdrawals (the
// records expire by their TTL).
func (h *Holder) Close(ctx context.Context) error {
	close(h.stop)
	<-h.done
	h.rdma.closeAll()
	defer h.store.close() // device memory
	if h.cfg.Index == nil {
		return nil
	}
	for _, e := range h.store.all() {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		e.mu.Lock()
		published := !e.published.IsZero()
		e.mu.Unlock()
		if _, ok := h.record(e); !ok || !published {
			continue
		}
		if err := h.cfg.Index.Withdraw(ctx, h.cfg.Base, e.id.key); err != nil && publishFailure(err) == "unreachable" {
			h.m.publishFailures.WithLabelValues("unreachable").Inc()
			return nil
		}
	}
	return nil
}

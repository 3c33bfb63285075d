package dsim_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/simnet"
)

// TestDS1_Simulation (RELIABILITY DS1): per seed, an IS, a PC with its
// state in a bbolt file, three holders and three instances run four
// sessions (greedy and top-p) while a seeded scheduler crashes and
// restarts instances, holders and the PC (restarted instances have their
// clock stepped back), and drops and delays messages. Checked:
//
//   - F9, F10: every session's output has each index exactly once and
//     equals its uninterrupted run; no top-p token is delivered before the
//     PC recorded a checkpoint covering it; the epochs a front end sees
//     never go back.
//   - F2: no instance ever received bytes that failed their digests (no
//     corruption is injected, so a failure means a block served from
//     reused or wrong memory).
//   - F12: reshards of a context run among the faults (the PC may crash
//     in the middle of one); once they stop, every instance holding part
//     of the map is at the PC's version with exactly its shards.
//   - F7: once the faults stop and two record TTLs pass, every replica
//     the IS returns for the sessions' prompts is served by its holder
//     (no phantom records).
//
// The seed is printed on failure; KVSP_SIM_SEED replays it alone;
// KVSP_SIM_SEEDS (make sim SEEDS=1000) sets how many run.
func TestDS1_Simulation(t *testing.T) {
	x := identities(t, 3, 3)
	var total ds1Stats
	list := seedList("KVSP_SIM_SEEDS", 10)
	// Seeds that once failed run in make test too. 73: a stream refused
	// 403 (the grant of the session's former placement) ended the session
	// instead of asking the PC where it went on (client.RunSessionWithin,
	// found by make sim on 2026-12-07).
	if os.Getenv("KVSP_SIM_SEED") == "" {
		for _, s := range []uint64{73} {
			if !slices.Contains(list, s) {
				list = append(list, s)
			}
		}
	}
	for _, seed := range list {
		stop := watchdog(seed, 2*time.Minute)
		ok := t.Run(fmt.Sprint(seed), func(t *testing.T) {
			defer stop()
			synctest.Test(t, func(t *testing.T) {
				total.add(ds1Run(t, x, seed))
			})
		})
		if !ok {
			t.Fatalf("seed %d failed: KVSP_SIM_SEED=%d KVSP_SIM_LOG=1 go test -run 'TestDS1_' ./internal/dsim/ replays it", seed, seed)
		}
	}
	t.Logf("%+v", total)
	s := total
	figures.Report(t, figures.Row{Row: "DS1", Faults: int64(s.InstanceCrashes + s.HolderCrashes + s.PCCrashes + s.FaultPeriods), Requests: int64(s.Requests),
		Held: fmt.Sprintf("%d seeds, %d sessions: %d tokens delivered exactly once through %d instance, %d holder and %d PC crashes, %d lossy periods and %d reshards (%d committed); %d requests (%d dropped, %d refused by a host that was down); 0 invariant broken",
			s.Seeds, s.Sessions, s.Tokens, s.InstanceCrashes, s.HolderCrashes, s.PCCrashes, s.FaultPeriods, s.Reshards, s.Committed, s.Requests, s.Dropped, s.Refused),
		Detail: map[string]float64{"seeds": float64(s.Seeds), "tokens": float64(s.Tokens), "reshards": float64(s.Reshards), "dropped": float64(s.Dropped)}})
}

type ds1Stats struct {
	Seeds, Sessions, Tokens, InstanceCrashes, HolderCrashes, PCCrashes, FaultPeriods, Reshards, Committed, Holding, Requests, Dropped, Refused int
}

func (s *ds1Stats) add(o ds1Stats) {
	s.Seeds++
	s.Sessions += o.Sessions
	s.Tokens += o.Tokens
	s.InstanceCrashes += o.InstanceCrashes
	s.HolderCrashes += o.HolderCrashes
	s.PCCrashes += o.PCCrashes
	s.FaultPeriods += o.FaultPeriods
	s.Reshards += o.Reshards
	s.Committed += o.Committed
	s.Holding += o.Holding
	s.Requests += o.Requests
	s.Dropped += o.Dropped
	s.Refused += o.Refused
}

func ds1Run(t *testing.T, x *ids, seed uint64) (st ds1Stats) {
	w := newWorld(t, x, seed, options{holders: 3, instances: 3, decode: 300, durablePC: true})
	defer w.close()
	const sessions, maxTokens = 4, 400
	qs := make([]*kvsp.PlaceRequest, sessions)
	for i := range qs {
		id := kvsp.NewUUID()
		qs[i] = &kvsp.PlaceRequest{ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: promptTokens(int(seed%31)+i%2, 2*blockToks+i), MaxTokens: maxTokens, Session: &id}
		if i%2 == 1 {
			qs[i].Sampler = &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: seed + uint64(i)}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	outs := make([][]uint32, sessions)
	errs := make([]error, sessions)
	var wg sync.WaitGroup
	var pcMu sync.Mutex // the PC object changes when it restarts
	pcSession := func(id kvsp.UUID) (uint64, uint64, bool) {
		pcMu.Lock()
		defer pcMu.Unlock()
		if !w.pcUp() {
			return 0, 0, false
		}
		s, ok := w.pc.Session(w.scope.ID(), id)
		if !ok || s.Checkpoint == nil {
			return s.Epoch, 0, ok
		}
		return s.Epoch, s.Checkpoint.OutputOffset, true
	}
	for i, q := range qs {
		stagger := time.Duration(w.rng.IntN(2000)) * time.Millisecond // drawn here: one goroutine draws, so a seed replays
		wg.Go(func() {
			time.Sleep(stagger)
			_, errs[i] = w.front.RunSession(ctx, w.front.Controller(pcBase), q, 100*time.Millisecond, func(idx uint64, tok uint32) error {
				if idx != uint64(len(outs[i])) {
					return fmt.Errorf("index %d delivered after %d tokens", idx, len(outs[i]))
				}
				if q.Sampler != nil {
					if _, off, ok := pcSession(*q.Session); ok && off <= idx {
						return fmt.Errorf("top-p token %d delivered before a checkpoint covered it (recorded %d)", idx, off)
					}
				}
				outs[i] = append(outs[i], tok)
				return nil
			})
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()

	var (
		resharding atomic.Bool
		reshards   sync.WaitGroup
		committed  atomic.Int64
	)
	// The scheduler: one goroutine (this one) decides every fault.
	type pending struct {
		at time.Time
		p  *proc
	}
	var back []pending
	for running := true; running; {
		select {
		case <-done:
			running = false
			continue
		case <-time.After(time.Duration(100+w.rng.IntN(700)) * time.Millisecond):
		}
		now := time.Now()
		back = slices.DeleteFunc(back, func(b pending) bool {
			if now.Before(b.at) {
				return false
			}
			pcMu.Lock()
			w.skew = time.Duration(w.rng.IntN(3)) * time.Hour // a clock stepped back, or not
			w.restart(b.p)
			pcMu.Unlock()
			return true
		})
		switch r := w.rng.IntN(100); {
		case r < 30: // an instance crashes
			p := w.insts[w.rng.IntN(len(w.insts))]
			if p.up {
				w.crash(p)
				st.InstanceCrashes++
				back = append(back, pending{now.Add(time.Duration(300+w.rng.IntN(3000)) * time.Millisecond), p})
			}
		case r < 45: // a holder crashes (its memory tiers are lost)
			p := w.holders[w.rng.IntN(len(w.holders)-1)]
			if p.up {
				w.crash(p)
				st.HolderCrashes++
				back = append(back, pending{now.Add(time.Duration(300+w.rng.IntN(3000)) * time.Millisecond), p})
			}
		case r < 52: // the PC crashes
			p := w.holders[len(w.holders)-1]
			if p.up {
				pcMu.Lock()
				w.crash(p)
				pcMu.Unlock()
				st.PCCrashes++
				back = append(back, pending{now.Add(time.Duration(200+w.rng.IntN(2000)) * time.Millisecond), p})
			}
		case r < 70: // a period of lossy, slow messages
			w.net.SetFaults(simnet.Faults{Drop: float64(w.rng.IntN(4)) / 100, Delay: time.Duration(w.rng.IntN(20)) * time.Millisecond})
			st.FaultPeriods++
		case r < 85:
			w.net.SetFaults(simnet.Faults{})
		case r < 95: // a reshard of the first session's context (F12)
			if !resharding.Load() && w.pcUp() {
				pcMu.Lock()
				pc := w.pc
				pcMu.Unlock()
				cur, _ := pc.ShardMap(w.scope.ID(), ds1Map)
				a, b := w.insts[w.rng.IntN(len(w.insts))].base, w.insts[w.rng.IntN(len(w.insts))].base
				next := kvsp.ShardMap{Map: ds1Map, Version: cur.Version + 1, Shards: []kvsp.Shard{
					{Tokens: kvsp.TokenRange{0, blockToks}, Instance: a}, {Tokens: kvsp.TokenRange{blockToks, 2 * blockToks}, Instance: b}}}
				q := &placement.ReshardRequest{Next: next, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: time.Duration(200+w.rng.IntN(1800)) * time.Millisecond}
				if cur.Version == 0 {
					q.Tokens = qs[0].Tokens[:2*blockToks]
				}
				resharding.Store(true)
				st.Reshards++
				reshards.Go(func() {
					defer resharding.Store(false)
					if _, err := pc.Reshard(context.Background(), q); err == nil {
						committed.Add(1)
					}
				})
			}
		}
	}
	reshards.Wait()
	// Faults stop; everything comes back.
	w.net.SetFaults(simnet.Faults{})
	pcMu.Lock()
	for _, b := range back {
		w.restart(b.p)
	}
	pcMu.Unlock()
	for i, q := range qs {
		if errs[i] != nil {
			t.Fatalf("session %d: %d tokens: %v (stats %+v)", i, len(outs[i]), errs[i], st)
		}
		if want := w.uninterrupted(q); !slices.Equal(outs[i], want) {
			t.Fatalf("session %d (%v): %d tokens, not its uninterrupted output (%d); stats %+v", i, q.Sampler, len(outs[i]), len(want), st)
		}
		st.Tokens += len(outs[i])
	}
	st.Sessions = sessions
	// F12: the group converged to one version: every instance that holds
	// a part of the map is at the PC's version and holds exactly its
	// shards; the others (restarted incarnations, or not members) hold
	// nothing of it.
	st.Holding = checkOneVersion(t, w)
	st.Committed = int(committed.Load())
	// F2: no wrong bytes ever reached an instance.
	for _, reg := range w.instRegs {
		if v := kvsptest.MetricSum(t, reg, "kvsp_instance_digest_failures_total", nil); v > 0 {
			t.Fatalf("F2: an instance received %v blocks that failed their digests", v)
		}
	}
	// F7: after two record TTLs, the IS returns no replica its holder
	// does not serve.
	time.Sleep(25 * time.Second)
	checkNoPhantoms(t, w, qs)
	fs := w.net.Stats()
	st.Requests, st.Dropped, st.Refused = fs.Requests, fs.Dropped, fs.Refused
	return st
}

// checkNoPhantoms looks up every prompt's blocks and GETs each replica
// returned from its holder: 200 with verified bytes, never 404.
func checkNoPhantoms(t *testing.T, w *world, qs []*kvsp.PlaceRequest) {
	t.Helper()
	idx := w.front.Index(isBase)
	for _, q := range qs {
		keys, _ := kvsp.BlockKeys(w.scope, w.compat, blockToks, q.Tokens)
		resp, err := idx.Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: w.scope.ID(), CompatID: w.compat, BlockKeys: keys})
		if err != nil {
			t.Fatalf("lookup: %v", err)
		}
		for i, reps := range resp.Replicas {
			for _, r := range reps {
				ds := make([]container.Digest, len(r.LayerDigests))
				for j, d := range r.LayerDigests {
					ds[j] = container.Digest(d)
				}
				s, err := w.front.Holder(r.Holder).GetBlock(context.Background(), client.BlockRef{Compat: w.compat, Scope: w.scope.ID(), Key: keys[i]}, w.g,
					client.GetOptions{LayerDigests: ds, ReplicaCodec: uint16(r.Codec)})
				if err != nil {
					if errors.Is(err, kvsp.ErrNotFound) {
						t.Fatalf("F7: a phantom record: the IS lists block %d at %s, which does not hold it, two TTLs after the faults stopped", i, r.Holder)
					}
					t.Fatalf("GET block %d at %s: %v", i, r.Holder, err)
				}
				for {
					if _, err := s.Next(); err != nil {
						if !errors.Is(err, io.EOF) {
							s.Close()
							t.Fatalf("block %d at %s: %v", i, r.Holder, err)
						}
						break
					}
				}
				s.Close()
			}
		}
	}
}

const ds1Map = "ds1"

// checkOneVersion checks F12's convergence once the faults stopped: the
// PC's map is the one version its members hold, and nobody holds ranges
// of another.
func checkOneVersion(t *testing.T, w *world) (holding int) {
	t.Helper()
	m, _ := w.pc.ShardMap(w.scope.ID(), ds1Map)
	want := map[string][]kvsp.TokenRange{}
	for _, s := range m.Shards {
		want[s.Instance] = append(want[s.Instance], s.Tokens)
	}
	for base, ranges := range want { // adjacent ranges are reported merged
		slices.SortFunc(ranges, func(a, b kvsp.TokenRange) int { return int(a[0]) - int(b[0]) })
		merged := ranges[:1]
		for _, r := range ranges[1:] {
			if last := &merged[len(merged)-1]; last[1] == r[0] {
				last[1] = r[1]
			} else {
				merged = append(merged, r)
			}
		}
		want[base] = merged
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for base, a := range w.agents {
		if a.ShardPlanOpen(w.scope.ID(), ds1Map) {
			t.Fatalf("F12: %s still has a plan open (its fetched blocks pinned) after the faults stopped; the PC is at version %d", base, m.Version)
		}
		v, got := a.ShardRanges(w.scope.ID(), ds1Map)
		switch {
		case v > m.Version:
		case len(got) == 0 && (v == 0 || want[base] == nil): // a fresh incarnation, or not a member (it may have left at an earlier version)
			continue
		case v == m.Version && slices.Equal(got, want[base]):
			holding++
			continue
		}
		t.Fatalf("F12: %s holds %v at version %d; the PC's map is version %d with %v for it", base, got, v, m.Version, want[base])
	}
	return holding
}

package dsim_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/figures"
)

// TestF10_ExactlyOnceAcrossMigrations (RELIABILITY F10; R-SES-5, R-SES-6,
// R-SES-9, R-SES-10, A-23): for each seed, a greedy and a seeded top-p
// session run at once on three instances (simulated engines) with two
// holders, a PC and an IS; the instance serving a session is crashed at
// one to three random tokens of it (the session migrates each time; the
// crashed instance restarts later, at a higher epoch). Each session's
// delivered output has every index exactly once, in order, and equals the
// uninterrupted run of its request; no token of the top-p session is
// delivered before the PC recorded a checkpoint covering it. 100 seeds in
// make test; KVSP_F10_SEEDS=10000 for the plan's full run; a failing seed
// replays alone with KVSP_SIM_SEED.
func TestF10_ExactlyOnceAcrossMigrations(t *testing.T) {
	x := identities(t, 2, 3)
	var migrations, kills int
	for _, seed := range seedList("KVSP_F10_SEEDS", 100) {
		stop := watchdog(seed, 2*time.Minute)
		ok := t.Run(fmt.Sprint(seed), func(t *testing.T) {
			defer stop()
			synctest.Test(t, func(t *testing.T) {
				m, k := f10Run(t, x, seed)
				migrations += m
				kills += k
			})
		})
		if !ok {
			t.Fatalf("seed %d failed: KVSP_SIM_SEED=%d go test -run 'TestF10_' ./internal/dsim/ replays it", seed, seed)
		}
	}
	if kills == 0 || migrations < kills {
		t.Fatalf("%d kills and %d migrations: the runs did not exercise migration", kills, migrations)
	}
	t.Logf("%d kills of serving instances, %d migrations; every output exactly once and equal to its uninterrupted run", kills, migrations)
	figures.Report(t, figures.Row{Row: "F10", Faults: int64(kills),
		Held:   fmt.Sprintf("%d seeds: %d kills of the serving instance, %d migrations, every output exactly once and equal to its uninterrupted run", len(seedList("KVSP_F10_SEEDS", 100)), kills, migrations),
		Detail: map[string]float64{"kills": float64(kills), "migrations": float64(migrations)}})
}

func f10Run(t *testing.T, x *ids, seed uint64) (migrations, kills int) {
	w := newWorld(t, x, seed, options{holders: 2, instances: 3, decode: 2000})
	defer w.close()
	const maxTokens = 160
	qs := []*kvsp.PlaceRequest{
		{ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: promptTokens(int(seed%97), 3*blockToks+5), MaxTokens: maxTokens},
		{ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: promptTokens(int(seed%89)+100, 2*blockToks+3), MaxTokens: maxTokens,
			Sampler: &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: seed}},
	}
	for _, q := range qs { // fixed session ids, so the test can follow them
		id := kvsp.NewUUID()
		q.Session = &id
	}
	// Kill points: one to three tokens of each session, increasing.
	killAt := make([][]uint64, len(qs))
	for i := range qs {
		n := 1 + w.rng.IntN(3)
		for range n {
			killAt[i] = append(killAt[i], uint64(1+w.rng.IntN(maxTokens-2)))
		}
		slices.Sort(killAt[i])
		killAt[i] = slices.Compact(killAt[i])
	}
	type kill struct{ session kvsp.UUID }
	killc := make(chan kill, 8)
	restartc := make(chan struct{}, 8) // a crashed instance's time to come back
	chaosDone := make(chan struct{})
	var restarts sync.WaitGroup
	// The one goroutine that crashes and restarts; it ends once killc is
	// closed and every restart it scheduled has come (restarts are
	// scheduled by it alone, so restarts.Go never races restarts.Wait,
	// which the test calls after it ended).
	go func() {
		defer close(chaosDone)
		pending := 0
		for kc := killc; kc != nil || pending > 0; {
			select {
			case k, ok := <-kc:
				if !ok {
					kc = nil
					continue
				}
				s, ok := w.pc.Session(w.scope.ID(), k.session)
				if !ok {
					continue
				}
				for _, p := range w.insts {
					if p.base == s.Instance && p.up {
						w.crash(p)
						kills++
						pending++
						back := time.Duration(500+w.rng.IntN(2500)) * time.Millisecond
						restarts.Go(func() {
							time.Sleep(back)
							restartc <- struct{}{}
						})
					}
				}
			case <-restartc:
				pending--
				for _, p := range w.insts {
					w.restart(p)
				}
			}
		}
	}()
	outs := make([][]uint32, len(qs))
	errs := make([]error, len(qs))
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for i, q := range qs {
		wg.Go(func() {
			next := 0
			_, err := w.front.RunSession(ctx, w.front.Controller(pcBase), q, 100*time.Millisecond, func(idx uint64, tok uint32) error {
				if idx != uint64(len(outs[i])) {
					return fmt.Errorf("index %d delivered after %d tokens", idx, len(outs[i]))
				}
				if q.Sampler != nil { // R-SES-6: released only once acknowledged
					sess, _ := w.pc.Session(w.scope.ID(), *q.Session)
					if sess.Checkpoint == nil || sess.Checkpoint.OutputOffset <= idx {
						return fmt.Errorf("token %d of the top-p session delivered before a checkpoint covered it (%v)", idx, sess.Checkpoint)
					}
				}
				outs[i] = append(outs[i], tok)
				if next < len(killAt[i]) && idx == killAt[i][next] {
					next++
					killc <- kill{session: *q.Session}
				}
				return nil
			})
			errs[i] = err
		})
	}
	wg.Wait()
	close(killc)
	<-chaosDone
	restarts.Wait()
	for i, q := range qs {
		if errs[i] != nil {
			t.Fatalf("session %d (kills at %v): %d tokens: %v", i, killAt[i], len(outs[i]), errs[i])
		}
		if want := w.uninterrupted(q); !slices.Equal(outs[i], want) {
			t.Fatalf("session %d (%v, kills at %v): %d tokens, not its uninterrupted output (%d)", i, q.Sampler, killAt[i], len(outs[i]), len(want))
		}
	}
	for _, s := range w.pc.Sessions() {
		migrations += int(s.Epoch - 1)
	}
	return migrations, kills
}

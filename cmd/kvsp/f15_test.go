package main

import (
	"context"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/internal/failpoint"
)

// TestF15_SessionEpochsSurviveCrashes (RELIABILITY F15; R-SES-4, R-SES-15,
// the PC, in its own process with a bbolt state file, crashes
// (failpoint kill: SIGKILL to itself) at the two steps that split a
// decision from its announcement, while a top-p session runs:
//
//   - epoch: right after persisting a migration's new epoch, before the
//     resume is sent (the serving instance was SIGKILLed at token 300);
//   - checkpoint: right after persisting a checkpoint, before the
//     acknowledgement.
//
// After each crash the state file holds the new epoch (no epoch can be
// issued twice) and a checkpoint covering every token the front end was
// given (tokens of a non-deterministic sampler are released only on
// acknowledgement, so an acknowledged checkpoint was not lost). The PC is
// restarted, the session finishes with one consistent sample equal to an
// uninterrupted run, and its epoch never went back.
func TestF15_SessionEpochsSurviveCrashes(t *testing.T) {
	for _, v := range []struct{ name, point string }{{"epoch", "pc/epoch-persisted"}, {"checkpoint", "pc/checkpoint-persisted"}} {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			arm := failpoint.Env + "=" + v.point + "=kill"
			o := clusterOptions{sampler: &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: 15}, pc: "bolt"}
			if v.name == "epoch" {
				o.pcEnv = []string{arm}
			}
			c := startSessionClusterWith(t, o)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			var (
				mu        sync.Mutex
				got       []uint32
				triggered bool
				wg        sync.WaitGroup
				saved     *placement.Session
			)
			delivered := func() int { mu.Lock(); defer mu.Unlock(); return len(got) }
			// crashed waits for the PC to die at its failpoint, reads its
			// state file as a restarted PC would, and restarts it.
			crashed := func() {
				for deadline := time.Now().Add(30 * time.Second); !c.pcProc.exited(); time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Error("the PC never reached its failpoint")
						return
					}
				}
				st, err := placement.OpenBoltStore(filepath.Join(filepath.Dir(c.pcCfg), "pc.db"))
				if err != nil {
					t.Error(err)
					return
				}
				state, err := st.Load()
				st.Close()
				n := delivered() // after the crash: nothing more can be acknowledged
				if err != nil {
					t.Error(err)
					return
				}
				for _, x := range state.Sessions {
					if x.ID == c.session {
						saved = x
					}
				}
				if saved == nil {
					t.Errorf("the session is not in the saved state (%d sessions)", len(state.Sessions))
					return
				}
				if saved.Checkpoint == nil || saved.Checkpoint.OutputOffset < uint64(n) {
					t.Errorf("the front end has %d tokens, released on acknowledged checkpoints, but the saved checkpoint is %+v", n, saved.Checkpoint)
				}
				c.restartPC(t)
			}
			_, err := c.front.RunSession(ctx, c.front.Controller(c.pc), c.q, 100*time.Millisecond, func(i uint64, tok uint32) error {
				mu.Lock()
				got = append(got, tok)
				mu.Unlock()
				if i == 300 && !triggered {
					triggered = true
					if v.name == "epoch" {
						c.serve(t).kill() // the PC migrates the session: epoch 2, then its crash
					} else {
						c.restartPC(t, arm) // the next checkpoint persisted kills it
					}
					wg.Go(crashed)
				}
				return nil
			})
			wg.Wait()
			if err != nil || !triggered {
				t.Fatalf("session: %d tokens, %v", len(got), err)
			}
			if saved == nil {
				t.Fatal("no state was read after the crash")
			}
			if want := c.uninterrupted(); !slices.Equal(got, want) {
				t.Fatalf("delivered %d tokens; not one consistent sample (%d)", len(got), len(want))
			}
			wantEpoch := uint64(1)
			if v.name == "epoch" {
				wantEpoch = 2 // persisted before the crash, never handed out
			}
			q := *c.q
			epoch, finish := finishedSession(t, c.front.Controller(c.pc), &q)
			if saved.Epoch != wantEpoch || epoch < saved.Epoch || finish != kvsp.FinishLength {
				t.Fatalf("epochs: saved at the crash %d (want %d), after the restart %d (finish %q)", saved.Epoch, wantEpoch, epoch, finish)
			}
			t.Logf("crash at %s: saved epoch %d, checkpoint at %d; session finished at epoch %d with %d tokens", v.point, saved.Epoch, saved.Checkpoint.OutputOffset, epoch, len(got))
		})
	}
}

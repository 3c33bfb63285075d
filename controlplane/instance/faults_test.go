package instance_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/instance"
	"github.com/kvsp/kvsp/engine/sim"
	"github.com/kvsp/kvsp/internal/faultproxy"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestF13_PrefetchUnderBadNetworks (RELIABILITY F13, R-PF-*): with the
// holder behind a faulty network (latency 200±50 ms, 10 MB/s, resets,
// slicing, a black hole), every directive ends by its deadline (plus a
// margin) as complete, partial or failed; what it lists as loaded is a
// prefix of its blocks, resident with exactly the engine's own bytes; no
// block it lists as failed is resident; a request admitted meanwhile runs
// unhindered. Each case requires what its fault permits: every block
// where the deadline allows it (a reset source served by the second),
// none where it does not; leases are released by the agent where their
// answer can reach it, and expire where it cannot.
//
// Not covered: a deadline that falls mid-transfer on a slow link. The
// directive's blocks are fetched at once and share the link, so none is
// complete at half the transfer time (measured: 0 of 8 at 2 s of 4 s) and
// the directive fails where fetching in prefix order would leave half.
func TestF13_PrefetchUnderBadNetworks(t *testing.T) {
	holderReg := prometheus.NewRegistry()
	w := newRig(t, rigOptions{noStore: true, holderReg: holderReg})
	keys := w.fill(t, prompt(8), 8)
	p, err := faultproxy.Start(w.srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	src := "https://" + p.Addr() + "/h1/"
	direct := w.url("/h1/")
	leases := func() float64 { return kvsptest.MetricSum(t, holderReg, "kvsp_holder_active_leases", nil) }
	// Each case requires what its fault permits: every block where the
	// deadline allows the transfer under the fault (a reset source is
	// served by the second one), none where it does not. Where the
	// lease's answer can reach the agent, the agent releases it: the
	// holder's active leases are back to 0 within a second, with lease_ms
	// a minute (not by expiry). Where the fault can hold the lease
	// request past the deadline, or cut its answer (the holder may grant
	// it after the agent gave up, or with the answer lost), the lease
	// expires: lease_ms 1500, checked at the end. Those cases run last.
	for _, tc := range []struct {
		name       string
		f          faultproxy.Faults
		deadlineMs uint64
		second     bool   // the holder directly, as the blocks' second source
		want       string // "all" blocks loaded or "none"
		released   bool   // the lease released by the agent (else it may only expire)
	}{
		{"latency, long deadline", faultproxy.Faults{Latency: 200 * time.Millisecond, Jitter: 50 * time.Millisecond}, 6000, false, "all", true},
		{"10 MB/s", faultproxy.Faults{BytesPerSecond: 10e6}, 1000, false, "all", true},
		{"slicer", faultproxy.Faults{SliceBytes: 7}, 3000, false, "all", true},
		// A reset can cut a lease's answer after the holder granted it.
		{"reset after 3000 octets, a second source", faultproxy.Faults{ResetAfter: 3000}, 2000, true, "all", false},
		{"latency 200±50ms past a 50 ms deadline", faultproxy.Faults{Latency: 200 * time.Millisecond, Jitter: 50 * time.Millisecond}, 50, false, "none", false},
		{"black hole", faultproxy.Faults{BlackHole: true}, 200, false, "none", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, k := range keys {
				w.eng.KV().Drop(k)
			}
			p.Set(tc.f)
			defer p.Set(faultproxy.Faults{})
			d := w.directive(keys, func(int) []string {
				if tc.second {
					return []string{src, direct}
				}
				return []string{src}
			}, tc.deadlineMs)
			d.LeaseMs = 60000
			if !tc.released {
				d.LeaseMs = 1500
			}
			start := time.Now()
			if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
				t.Fatal(err)
			}
			if tc.name == "10 MB/s" { // the lease is held while the blocks trickle in: the gauge sees it
				for deadline := time.Now().Add(time.Second); kvsptest.MetricSum(t, holderReg, "kvsp_holder_active_leases", nil) == 0; time.Sleep(5 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("no lease was ever live: the counters below prove nothing")
					}
				}
			}
			// Admitted requests are not blocked meanwhile: a prompt of
			// its own (no directive, no shared block) gets its first
			// token promptly.
			own := prompt(1)
			for i := range own {
				own[i] += 7
			}
			probe := time.Now()
			err := w.front.Instance(w.url("/ii1/")).Generate(context.Background(), w.granted(t, &kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1,
				ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: own, MaxTokens: 1}), func(kvsp.GeneratedToken) error { return nil })
			if err != nil || time.Since(probe) > time.Second {
				t.Errorf("a request during the prefetch: %v after %v", err, time.Since(probe))
			}
			st := w.wait(t, d.Directive)
			took := time.Since(start)
			if limit := time.Duration(tc.deadlineMs)*time.Millisecond + 1500*time.Millisecond; took > limit {
				t.Errorf("the directive ended after %v, deadline %d ms", took, tc.deadlineMs)
			}
			if !slices.Equal(st.Loaded, keys[:len(st.Loaded)]) || len(st.Loaded)+len(st.Failed) != len(keys) {
				t.Fatalf("loaded %d, failed %d: not a prefix and the rest", len(st.Loaded), len(st.Failed))
			}
			switch {
			case st.State == kvsp.PrefetchComplete && len(st.Loaded) != len(keys),
				st.State != kvsp.PrefetchComplete && len(st.Failed) == 0:
				t.Fatalf("state %s with %d loaded", st.State, len(st.Loaded))
			case tc.want == "all" && st.State != kvsp.PrefetchComplete:
				t.Fatalf("%s with %d of %d loaded: the fault permits every block by the deadline", st.State, len(st.Loaded), len(keys))
			case tc.want == "none" && (st.State != kvsp.PrefetchFailed || len(st.Loaded) != 0):
				t.Fatalf("%s with %d loaded: the fault permits none by the deadline", st.State, len(st.Loaded))
			}
			k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
			wk, wv := make([]byte, len(k)), make([]byte, len(v))
			for _, key := range st.Loaded {
				for l := uint32(0); l < w.g.Layers; l++ {
					if err := w.eng.KV().ReadLayer(key, l, k, v); err != nil {
						t.Fatalf("a loaded block is not resident: %v", err)
					}
					sim.BlockContent(w.g, key, l, wk, wv)
					if !bytes.Equal(k, wk) || !bytes.Equal(v, wv) {
						t.Fatal("a loaded block's bytes are not the engine's own")
					}
				}
			}
			for _, key := range st.Failed {
				if w.eng.KV().Has(key) {
					t.Fatal("a block the directive failed is resident")
				}
			}
			if tc.released {
				for deadline := time.Now().Add(time.Second); leases() != 0; time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("%v leases live a second after the directive ended (lease_ms %d): not released", leases(), d.LeaseMs)
					}
				}
			}
			t.Logf("%s: %s, %d of %d loaded in %v", tc.name, st.State, len(st.Loaded), len(keys), took.Round(time.Millisecond))
		})
	}
	// The leases the last three cases may have left expire (lease_ms 1500):
	// the holders' counters return to zero.
	for deadline := time.Now().Add(4 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		n, b := kvsptest.MetricSum(t, holderReg, "kvsp_holder_active_leases", nil), kvsptest.MetricSum(t, holderReg, "kvsp_holder_leased_bytes", nil)
		if n == 0 && b == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v leases of %v octets still live after the directives' lease_ms", n, b)
		}
	}
}

// TestF11_EpochMonotonicAcrossRestarts (RELIABILITY F11; R-ST-4, R-ST-5,
// R-ST-6, A-12): an instance restarted with its clock stepped back an hour
// still starts at a higher epoch, from the counter it persisted
// (Config.EpochFile); the PC accepts it as a restart and refuses the old
// incarnation's late status with 409 kvsp-stale-epoch carrying the new
// epoch, keeping the new record. Without the file the stepped-back start
// gets a lower epoch, which the PC refuses: what the counter is for. A
// damaged file stops the start with a clear error rather than guess.
func TestF11_EpochMonotonicAcrossRestarts(t *testing.T) {
	w := newRig(t, rigOptions{})
	file := filepath.Join(t.TempDir(), "ii2.epoch")
	now := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	start := func(clock time.Time, epochFile string) (*instance.Agent, error) {
		eng, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 5000})
		return instance.New(instance.Config{Base: w.url("/ii2/"), Engine: eng, Client: w.as(agentID), Controller: w.url("/pc/"),
			Scopes: []kvsp.ScopeKey{w.scopeKey}, EpochFile: epochFile, Now: func() time.Time { return clock }})
	}
	ctl := w.as(agentID).Controller(w.url("/pc/"))
	first, err := start(now, file)
	if err != nil {
		t.Fatal(err)
	}
	old := first.Status()
	if old.Epoch != uint64(now.UnixMilli()) {
		t.Fatalf("first epoch %d, want the start time in ms %d", old.Epoch, now.UnixMilli())
	}
	if _, err := ctl.PutStatus(context.Background(), old); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(file); err != nil || fi.Mode().Perm()&0o077 != 0 {
		t.Fatalf("epoch file: %v %v", fi, err)
	}
	// The restart, an hour back in time.
	second, err := start(now.Add(-time.Hour), file)
	if err != nil {
		t.Fatal(err)
	}
	cur := second.Status()
	if cur.Epoch <= old.Epoch {
		t.Fatalf("epoch after a restart with the clock stepped back: %d, not above %d", cur.Epoch, old.Epoch)
	}
	if _, err := ctl.PutStatus(context.Background(), cur); err != nil {
		t.Fatalf("the restarted instance's status: %v", err)
	}
	_, err = ctl.PutStatus(context.Background(), old)
	var p *kvsp.Problem
	if !errors.Is(err, kvsp.ErrStaleEpoch) || !errors.As(err, &p) || numberText(p.Extensions["epoch"]) != fmt.Sprint(cur.Epoch) {
		t.Fatalf("the old incarnation's status: %v, want 409 kvsp-stale-epoch with epoch %d", err, cur.Epoch)
	}
	if s, _ := w.ctl.Registry().Get(w.url("/ii2/")); s.Status.Epoch != cur.Epoch {
		t.Fatalf("the PC's record after the stale status: epoch %d, want %d", s.Status.Epoch, cur.Epoch)
	}
	// Without the counter, the same restart goes below: refused.
	third, err := start(now.Add(-time.Hour), "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.PutStatus(context.Background(), third.Status()); !errors.Is(err, kvsp.ErrStaleEpoch) {
		t.Fatalf("a stepped-back epoch without the counter: %v, want 409 kvsp-stale-epoch", err)
	}
	os.WriteFile(file, []byte("17x\n"), 0o600)
	if _, err := start(now, file); err == nil || !strings.Contains(err.Error(), "not a decimal epoch") {
		t.Fatalf("a damaged epoch file: %v", err)
	}
}

// numberText is a JSON number of a problem's extension member in decimal.
func numberText(v any) string {
	if f, ok := v.(float64); ok {
		return strconv.FormatFloat(f, 'f', -1, 64)
	}
	return fmt.Sprint(v)
}

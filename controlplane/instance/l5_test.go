package instance_test

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestL5_FairPlacementUnderUnusedPlacements (RELIABILITY L5, red team D5:
// each place held room until the next status record with no share per
// tenant, and 4 to 12 workers placing about 1,000 requests they never
// generated took another tenant's TTFT from 7 ms to about 900 ms). Tenant
// A (ClientA, scope A) places 1,000 requests from 8 workers and generates
// none; tenant B (clientB, scope B) places and generates beside it on the
// same instance. A holds at most the PC's share of the instance's room
// and is refused the rest with 429 and Retry-After, counted under its
// principal; every one of B's requests is placed and runs, its TTFT p50
// within 2x of its baseline (plus 20 ms for 2 loaded cores); and once A
// stops, its placements release their room when their grants expire.
func TestL5_FairPlacementUnderUnusedPlacements(t *testing.T) {
	const ttl = 800 * time.Millisecond
	reg := prometheus.NewRegistry()
	w := newRig(t, rigOptions{scopeB: true, ctlReg: reg, pc: func(c *placement.Config) { c.PlacementTTL, c.CapacityWait = ttl, 50*time.Millisecond }})
	w.runAgents(t, "/ii1/")
	ctx := context.Background()
	ii1 := w.url("/ii1/")
	ctlB := w.as(clientB).Controller(w.url("/pc/"))
	runB := func(i int) (time.Duration, error) {
		toks := slices.Repeat([]uint32{uint32(1000 + i)}, 2*16+3)
		q := &kvsp.PlaceRequest{ScopeID: w.scopeB.ID(), CompatID: w.compat, Tokens: toks, MaxTokens: 4}
		start := time.Now()
		pl, err := ctlB.Place(ctx, q)
		if err != nil {
			return 0, err
		}
		var first time.Duration
		err = w.as(clientB).Instance(pl.Instance).Generate(ctx, &kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, ScopeID: q.ScopeID,
			CompatID: q.CompatID, Tokens: toks, MaxTokens: 4, Grant: pl.Grant}, func(kvsp.GeneratedToken) error {
			if first == 0 {
				first = time.Since(start)
			}
			return nil
		})
		return first, err
	}
	p50 := func(from, n int) (time.Duration, int) {
		var d []time.Duration
		failed := 0
		for i := range n {
			ttft, err := runB(from + i)
			if err != nil {
				t.Logf("tenant B's request %d: %v", from+i, err)
				failed++
				continue
			}
			d = append(d, ttft)
		}
		if len(d) == 0 {
			return 0, failed
		}
		slices.Sort(d)
		return d[len(d)/2], failed
	}
	base, failed := p50(0, 20)
	if failed > 0 {
		t.Fatalf("tenant B alone: %d of 20 requests failed", failed)
	}

	// Tenant A's flood: 1,000 places from 8 workers, none generated.
	ctlA := w.front.Controller(w.url("/pc/"))
	var attempts, placed, tooMany, other atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for attempts.Add(1) <= 1000 {
				_, err := ctlA.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: prompt(2), MaxTokens: 4})
				switch {
				case err == nil:
					placed.Add(1)
				case errors.Is(err, kvsp.ErrTooManyRequests):
					tooMany.Add(1)
				default:
					other.Add(1)
				}
			}
		})
	}
	go func() { wg.Wait(); close(done) }()
	time.Sleep(100 * time.Millisecond) // A holds what it can
	held := 0
	if s, ok := w.ctl.Registry().Get(ii1); ok {
		held = s.Placed
	}
	// One refusal as it reaches the wire: 429 with Retry-After.
	st, hdr := w.rawPlace(t, kvsptest.ClientA, `{"scope_id":"`+w.scopeKey.ID().String()+`","compat_id":"`+w.compat.String()+`","tokens":[1,2,3],"max_tokens":4}`)
	during, failed := p50(100, 20)
	<-done
	if failed > 0 {
		t.Fatalf("tenant B beside the flood: %d of 20 requests failed", failed)
	}
	t.Logf("tenant B's TTFT p50: %v alone, %v beside tenant A's flood (%d places: %d placed, %d refused 429, %d other; %d held at ii1 while B ran)",
		base, during, attempts.Load()-8, placed.Load(), tooMany.Load(), other.Load(), held)
	if st != 429 || hdr.Get("Retry-After") == "" {
		t.Fatalf("tenant A past its share: %d, Retry-After %q; want 429 with Retry-After", st, hdr.Get("Retry-After"))
	}
	if tooMany.Load() == 0 || other.Load() != 0 {
		t.Fatalf("tenant A's flood: %d refused with 429, %d otherwise", tooMany.Load(), other.Load())
	}
	if room := 2 * 4; held > room/2 {
		t.Fatalf("tenant A held %d placements at ii1, past its share of a room of %d", held, room)
	}
	if n := testutil.ToFloat64(counterOf(t, reg, "kvsp_pc_share_refused_total", kvsptest.ClientA)); n == 0 {
		t.Fatal("no share refusal counted under tenant A's principal")
	}
	if during > 2*base+20*time.Millisecond {
		t.Fatalf("tenant B's TTFT p50 went from %v to %v beside the flood", base, during)
	}
	// A's unused placements release their room when their grants expire.
	deadline := time.Now().Add(ttl + 2*time.Second)
	for {
		s, _ := w.ctl.Registry().Get(ii1)
		if s.Placed == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d unused placements still hold room %v after the flood", s.Placed, ttl+2*time.Second)
		}
		time.Sleep(50 * time.Millisecond)
	}
	figures.Report(t, figures.Row{Row: "L5", Requests: attempts.Load() - 8 + 40, Inputs: placed.Load(),
		Held: "a tenant's unused placements held at most its share of the room and released it at their grant's expiry; the other tenant's requests all ran, TTFT p50 within 2x",
		Detail: map[string]float64{"b_ttft_p50_alone_ms": float64(base.Microseconds()) / 1000, "b_ttft_p50_flood_ms": float64(during.Microseconds()) / 1000,
			"a_refused_429": float64(tooMany.Load())}})
}

// rawPlace posts a place body as identity id and returns the status and
// headers.
func (w *rig) rawPlace(t *testing.T, id, body string) (int, http.Header) {
	t.Helper()
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: w.tls(id), ForceAttemptHTTP2: true}}
	defer c.CloseIdleConnections()
	req, _ := http.NewRequest(http.MethodPost, w.url("/pc/place"), strings.NewReader(body))
	req.Header.Set("Content-Type", kvsp.MediaType)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Header
}

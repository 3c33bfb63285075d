package instance_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestB11_ZeroWindowGenerates (RELIABILITY B11, the generate variant; red
// team D1: one tenant placed 10 sessions and sent their generate on one
// HTTP/2 connection whose initial stream window was 0; the stalled
// handlers counted as accepted, both instances reported running 0, queued
// 5, batch 4 with idle engines, and the PC refused the other tenant's
// places with 503 for 40 s). Tenant A (scope A) sends its 10 placed
// generates on one connection with window 0, and an eleventh, long one;
// tenant B (scope B) places and generates beside it on the same instance.
//   - The engine makes A's short answers and the instance reports no
//     request running or queued: they only wait for their client.
//   - Every one of B's places succeeds and its TTFT p50 stays within 2x
//     of its baseline (plus 20 ms).
//   - Every stalled stream is reset within the server's write grace (plus
//     slack), its handler ends, and the long generation is cancelled
//     there, its sequence freed long before its max_tokens; the
//     generations cut are counted; goroutines return to their level.
func TestB11_ZeroWindowGenerates(t *testing.T) {
	const (
		grace = 3 * time.Second // B runs, and the instance is read, while A's streams stall
		slack = 2 * time.Second // 2 loaded cores, -race
	)
	w := newRig(t, rigOptions{scopeB: true, writeGrace: grace})
	w.runAgents(t, "/ii1/")
	ctx := context.Background()
	cB := w.as(clientB)
	ctlB := cB.Controller(w.url("/pc/"))
	runB := func(i int) (time.Duration, error) {
		toks := slices.Repeat([]uint32{uint32(2000 + i)}, 2*16+3)
		start := time.Now()
		pl, err := ctlB.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeB.ID(), CompatID: w.compat, Tokens: toks, MaxTokens: 4})
		if err != nil {
			return 0, err
		}
		var first time.Duration
		err = cB.Instance(pl.Instance).Generate(ctx, &kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, ScopeID: w.scopeB.ID(),
			CompatID: w.compat, Tokens: toks, MaxTokens: 4, Grant: pl.Grant}, func(kvsp.GeneratedToken) error {
			if first == 0 {
				first = time.Since(start)
			}
			return nil
		})
		return first, err
	}
	p50 := func(from, n int) time.Duration {
		t.Helper()
		var d []time.Duration
		for i := range n {
			ttft, err := runB(from + i)
			if err != nil {
				t.Fatalf("tenant B's request %d: %v", from+i, err)
			}
			d = append(d, ttft)
		}
		slices.Sort(d)
		return d[len(d)/2]
	}
	base := p50(0, 10)
	baseG := kvsptest.QuietGoroutines()

	// Tenant A: 10 short generates and a long one, placed, then sent on a
	// connection that grants no window.
	ctlA := w.front.Controller(w.url("/pc/"))
	a := kvsptest.DialStalled(t, w.srv.Addr, w.tls(kvsptest.ClientA))
	const short, long = 10, 60000
	sent := time.Now()
	for i := range short + 1 {
		maxTokens := uint64(16)
		if i == short {
			maxTokens = long // 48 s at the engine's decode rate if it ran to its end
		}
		toks := prompt(1 + i%2)
		toks[0] += uint32(i)
		var pl *kvsp.PlaceResponse
		var err error
		for try := 0; ; try++ { // A's own placements may wait for room, as any tenant's
			if pl, err = ctlA.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: toks, MaxTokens: maxTokens}); err == nil || try == 20 || !errors.Is(err, kvsp.ErrUnavailable) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("tenant A's place %d: %v", i, err)
		}
		body, _ := kvsp.Marshal(&kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, ScopeID: w.scopeKey.ID(), CompatID: w.compat,
			Tokens: toks, MaxTokens: maxTokens, Grant: pl.Grant})
		if err := a.Send(uint32(2*i+1), "POST", "/ii1/generate", kvsp.MediaType, body); err != nil {
			t.Fatal(err)
		}
	}
	// The engine makes the short answers at once: nothing of A's is
	// running or queued but the long generation, though 11 streams wait.
	for {
		st := w.agent.Status()
		if st.Running+st.Queued <= 1 && a.Answered() == short+1 {
			break
		}
		if time.Since(sent) > grace/2 {
			t.Fatalf("the instance reports %d running and %d queued %v after A's 11 generates, whose short answers the engine made: handlers waiting on a client counted as engine work",
				st.Running, st.Queued, time.Since(sent).Round(time.Millisecond))
		}
		time.Sleep(5 * time.Millisecond)
	}
	during := p50(100, 10)
	if st := w.agent.Status(); st.Queued != 0 {
		t.Fatalf("the instance reports %d queued beside A's stalled streams (running %d): handlers waiting on a client counted as engine work", st.Queued, st.Running)
	}
	if n := a.ResetCount(); n != 0 {
		t.Fatalf("%d of A's streams were reset before B ran: B was not measured beside the stall", n)
	}
	// Every stalled stream is reset within the grace.
	limit := grace + slack
	for a.ResetCount() < short+1 && time.Since(sent) < limit+5*time.Second {
		select {
		case <-a.Changed():
		case <-time.After(100 * time.Millisecond):
		}
	}
	var worst time.Duration
	for i := range short + 1 {
		_, reset, after, code := a.Stream(uint32(2*i + 1))
		if !reset || (code != http2.ErrCodeCancel && code != http2.ErrCodeInternal) {
			t.Fatalf("A's stream %d: reset %v with %v; want reset (CANCEL) within %v", 2*i+1, reset, code, limit)
		}
		worst = max(worst, after)
	}
	if worst > limit+time.Duration(short+1)*50*time.Millisecond {
		t.Fatalf("a stalled stream was reset %v after its request, past the grace %v and slack", worst, grace)
	}
	// The long generation was cancelled: the engine runs nothing.
	kvsptest.WaitFor(t, "the engine idle once A's long generation was cut", func() bool { st := w.eng.Stats(); return st.Running == 0 && st.Queued == 0 })
	// Each handler counts its cut as it returns, which can trail the
	// engine going idle on a loaded machine.
	kvsptest.WaitFor(t, "every cut generation counted", func() bool {
		return metric(t, w.reg, "kvsp_instance_generations_unread_total") >= short+1
	})
	if cut := metric(t, w.reg, "kvsp_instance_generations_unread_total"); cut != short+1 {
		t.Fatalf("%v generations counted cut for an unread stream, want %d", cut, short+1)
	}
	a.Close()
	g := kvsptest.SettleGoroutines(baseG+8, 5*time.Second)
	t.Logf("tenant B's TTFT p50: %v alone, %v beside A's 11 stalled generates; A's streams reset at most %v after their request (grace %v); goroutines %d, baseline %d",
		base, during, worst.Round(time.Millisecond), grace, g, baseG)
	if g > baseG+8 {
		t.Fatalf("%d goroutines after A's connection closed, baseline %d", g, baseG)
	}
	if during > 2*base+20*time.Millisecond {
		t.Fatalf("tenant B's TTFT p50 went from %v to %v beside the stalled streams", base, during)
	}
	figures.Report(t, figures.Row{Row: "B11", Inputs: short + 1, Requests: 20,
		Held: "11 zero-window generates reset within the write grace, their handlers ended and the long one cancelled; nothing counted queued; the other tenant's places all succeeded, TTFT p50 within 2x",
		Detail: map[string]float64{"b_ttft_p50_alone_ms": float64(base.Microseconds()) / 1000, "b_ttft_p50_stalled_ms": float64(during.Microseconds()) / 1000,
			"worst_reset_ms": float64(worst.Milliseconds())}})
}

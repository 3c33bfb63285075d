package main

import (
	"compress/gzip"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/internal/chart"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/mtls"
)

// replayer is the front end of a trace replay: it places each request
// with the PC at its (sped-up) time and runs it on the instance chosen.
type replayer struct {
	c         *client.Client
	ctl       *client.Controller
	scope     kvsp.ScopeID
	compat    kvsp.CompatID
	speed     float64
	maxOutput int
	vocab     int // prompt token ids are below it (0: 32000)
	// status, when set, adds to the progress line.
	status func() string
}

// replayResult is one replayed request.
type replayResult struct {
	instance         string // where it ran ("" when it failed)
	ttft             time.Duration
	cached, computed int // prompt tokens, as the instance reported them
	err              error
}

// run replays reqs, with a progress line on stderr, and returns each
// request's result, the measured hit ratio as requests completed, and
// the wall time.
func (rp *replayer) run(ctx context.Context, reqs []traceRequest, stderr io.Writer) ([]replayResult, []chart.Point, time.Duration) {
	results := make([]replayResult, len(reqs))
	var finished, cached, prompt atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	var progress []chart.Point
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	report := func(final bool) {
		ratio := 0.0
		if p := prompt.Load(); p > 0 {
			ratio = float64(cached.Load()) / float64(p)
		}
		n := finished.Load()
		if n > 0 {
			progress = append(progress, chart.Point{X: float64(n), Y: ratio})
		}
		fmt.Fprintf(stderr, "\r\033[K[%5.1fs] %d/%d requests done, prefix hit ratio %.3f", time.Since(start).Seconds(), n, len(reqs), ratio)
		if rp.status != nil {
			fmt.Fprint(stderr, ", ", rp.status())
		}
		if final {
			fmt.Fprintln(stderr)
		}
	}
	sem := make(chan struct{}, 256) // requests in flight, at most
	for i := range reqs {
		at := start.Add(time.Duration(reqs[i].Timestamp / rp.speed * float64(time.Millisecond)))
		for wait := time.Until(at); wait > 0; wait = time.Until(at) {
			select {
			case <-tick.C:
				report(false)
			case <-time.After(wait):
			}
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			r := rp.one(ctx, &reqs[i], at)
			results[i] = r
			if r.err == nil {
				cached.Add(int64(r.cached))
				prompt.Add(int64(r.cached + r.computed))
			}
			finished.Add(1)
		}()
	}
	all := make(chan struct{})
	go func() { wg.Wait(); close(all) }()
	for waiting := true; waiting; {
		select {
		case <-all:
			waiting = false
		case <-tick.C:
			report(false)
		}
	}
	report(true)
	return results, progress, time.Since(start)
}

// one places a request with the PC and runs it on the instance chosen,
// timing its first token from arrival, the time the trace gives it: a
// request that waited for a place in flight (the replay's own bound) or
// for capacity waited as a user would.
func (rp *replayer) one(ctx context.Context, q *traceRequest, arrival time.Time) replayResult {
	var r replayResult
	vocab := rp.vocab
	if vocab == 0 {
		vocab = 32000
	}
	tokens := demoTokens(q, vocab)
	out := uint64(max(1, min(q.OutputLength, rp.maxOutput)))
	var at *kvsp.PlaceResponse
	var err error
	for try := 0; ; try++ { // no capacity: the PC says when to come back
		at, err = rp.ctl.Place(ctx, &kvsp.PlaceRequest{ScopeID: rp.scope, CompatID: rp.compat, Tokens: tokens, MaxTokens: out})
		if err == nil || try == 50 || ctx.Err() != nil || !(errors.Is(err, kvsp.ErrUnavailable) || errors.Is(err, kvsp.ErrTooManyRequests)) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		r.err = fmt.Errorf("place: %w", err)
		return r
	}
	first := true
	err = rp.c.Instance(at.Instance).Generate(ctx, &kvsp.GenerateRequest{Session: at.Session, Epoch: at.Epoch, ScopeID: rp.scope, CompatID: rp.compat,
		Tokens: tokens, MaxTokens: out, Grant: at.Grant}, func(t kvsp.GeneratedToken) error {
		if first {
			r.ttft, first = time.Since(arrival), false
			r.computed = q.InputLength
			if t.Prefill != nil {
				r.cached, r.computed = int(t.Prefill.CachedTokens), int(t.Prefill.ComputedTokens)
			}
		}
		return nil
	})
	if err != nil {
		r.err = fmt.Errorf("generate: %w", err)
		return r
	}
	r.instance = at.Instance
	return r
}

// replaySummary is what a replay measured, in the JSON reports.
type replaySummary struct {
	Requests     int     `json:"requests"`
	Errors       int     `json:"errors"`
	Speed        float64 `json:"speed"`
	WallSeconds  float64 `json:"wall_seconds"`
	HitRatio     float64 `json:"hit_ratio"`            // cached / all prompt tokens, as the instances reported
	BoundRatio   float64 `json:"bound_ratio"`          // infinite cache
	LocalRatio   float64 `json:"modelled_local_ratio"` // per-instance LRU caches only (a model, not run)
	CachedTokens int64   `json:"cached_tokens"`
	Computed     int64   `json:"computed_tokens"`
	// TTFT p50 and p90 in ms: "measured" (wall clock, place to first
	// token); with a prefill rate (kvsp replay --prefill-rate), the rate
	// applied to the tokens each case computes, a model:
	// "modelled_kvsp", "modelled_local_only", "modelled_no_cache".
	TTFT     map[string][2]float64 `json:"ttft_ms"`
	Progress []chart.Point         `json:"hit_ratio_progress"` // (requests done, measured hit ratio)
}

// summarize computes a replay's figures; prefillRate > 0 adds the modeled
// TTFTs.
func summarize(reqs []traceRequest, results []replayResult, progress []chart.Point, wall time.Duration, speed, prefillRate float64) (replaySummary, []int) {
	s := replaySummary{Requests: len(reqs), Speed: speed, WallSeconds: wall.Seconds(), TTFT: map[string][2]float64{}, Progress: progress}
	index := map[string]int{}
	instanceOf := make([]int, len(results))
	for i, r := range results {
		instanceOf[i] = -1
		if r.err != nil {
			s.Errors++
			continue
		}
		if _, ok := index[r.instance]; !ok {
			index[r.instance] = len(index)
		}
		instanceOf[i] = index[r.instance]
		s.CachedTokens += int64(r.cached)
		s.Computed += int64(r.computed)
	}
	if t := s.CachedTokens + s.Computed; t > 0 {
		s.HitRatio = float64(s.CachedTokens) / float64(t)
	}
	bc, bt := prefixBound(reqs)
	s.BoundRatio = float64(bc) / float64(bt)
	local := localOnly(reqs, instanceOf, len(index))
	var lc int64
	model := func(tokens int) time.Duration {
		return time.Duration(float64(tokens) / prefillRate * float64(time.Second))
	}
	cases := map[string][]time.Duration{}
	for i, r := range results {
		if r.err != nil {
			continue
		}
		lc += int64(local[i])
		cases["measured"] = append(cases["measured"], r.ttft)
		if prefillRate > 0 {
			cases["modelled_kvsp"] = append(cases["modelled_kvsp"], model(r.computed))
			cases["modelled_local_only"] = append(cases["modelled_local_only"], model(reqs[i].InputLength-local[i]))
			cases["modelled_no_cache"] = append(cases["modelled_no_cache"], model(reqs[i].InputLength))
		}
	}
	s.LocalRatio = float64(lc) / float64(bt)
	for name, ds := range cases {
		slices.Sort(ds)
		s.TTFT[name] = [2]float64{percentileMs(ds, 0.5), percentileMs(ds, 0.9)}
	}
	return s, local
}

// hitRatioChart draws the measured hit ratio as the trace is replayed,
// against the infinite-cache bound and per-instance local caches.
func hitRatioChart(title string, reqs []traceRequest, local []int, progress []chart.Point) *chart.Chart {
	bound, loc := chart.Series{Name: "infinite cache"}, chart.Series{Name: "local caches only"}
	seen := map[int64]bool{}
	var bc, lc, total int64
	step := max(1, len(reqs)/100)
	for i, q := range reqs {
		n := 0
		for n < len(q.HashIDs) && seen[q.HashIDs[n]] {
			n++
		}
		bc += int64(min(n, q.InputLength/q.bt()) * q.bt())
		lc += int64(local[i])
		total += int64(q.InputLength)
		for _, id := range q.HashIDs {
			seen[id] = true
		}
		if (i+1)%step == 0 || i == len(reqs)-1 {
			bound.Points = append(bound.Points, chart.Point{X: float64(i + 1), Y: float64(bc) / float64(total)})
			loc.Points = append(loc.Points, chart.Point{X: float64(i + 1), Y: float64(lc) / float64(total)})
		}
	}
	c := &chart.Chart{Title: title, XLabel: "requests replayed", YLabel: "hit ratio", XTick: func(x float64) string { return fmt.Sprint(int(x)) },
		Series: []chart.Series{{Name: "KVSP (measured)", Points: progress}, bound, loc}}
	if len(progress) == 0 {
		c.Series = c.Series[1:]
	}
	return c
}

// openTrace opens a Mooncake-format trace (gzip when it ends in .gz), or
// the embedded one when path is empty.
func openTrace(path string) ([]traceRequest, error) {
	if path == "synth" || strings.HasPrefix(path, "synth:") {
		p, err := parseSynth(path)
		if err != nil {
			return nil, usageError("%v", err)
		}
		return synthTrace(p), nil
	}
	var r io.Reader
	if path == "" {
		zr, err := gzip.NewReader(strings.NewReader(string(embeddedTrace)))
		if err != nil {
			return nil, err
		}
		r = zr
	} else {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
		if strings.HasSuffix(path, ".gz") {
			if r, err = gzip.NewReader(f); err != nil {
				return nil, err
			}
		}
	}
	return loadTrace(r)
}

const replayUsage = `kvsp replay: replay a trace against a running deployment

The front end of kvsp demo against an existing deployment: each request of
a Mooncake-format trace (equal hash ids, equal 512-token blocks) is placed
with the PC at its time (sped up) and run on the instance chosen. It
reports the prefix hit ratio the instances achieved against the trace's
infinite-cache bound, and TTFT; a JSON report and a PNG chart.

Usage: kvsp replay --config FILE [flags]
`

// cmdReplay runs kvsp replay.
func cmdReplay(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, replayUsage); fs.PrintDefaults() }
	cfgPath := fs.String("config", "", "a kvsp configuration: its CA bundle and first scope key are the front end's")
	cert := fs.String("cert", "", "the front end's certificate, an identity with the client role and the scope (default: the configuration's tls.client_cert)")
	key := fs.String("key", "", "its key (default: tls.client_key)")
	tracePath := fs.String("trace", "", "the trace (default: the embedded Mooncake synthetic trace)")
	pc := fs.String("pc", "", "the PC's base URI (default: the configuration's controller, or its first instance's)")
	descriptor := fs.String("descriptor", "", "the model's descriptor (default: the configuration's first)")
	speed := fs.Float64("speed", 1, "replay speed-up of the trace's timestamps")
	requests := fs.Int("requests", 0, "requests to replay (default: all)")
	maxOutput := fs.Int("max-output", 8, "cap on output tokens per request")
	prefillRate := fs.Float64("prefill-rate", 0, "the engines' prefill rate, tokens/s, for the modeled TTFTs (0: measured only)")
	jsonPath := fs.String("json", "kvsp-replay.json", "JSON report")
	pngPath := fs.String("png", "kvsp-replay.png", "PNG chart")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usageError("replay: %v", err)
	}
	if *cfgPath == "" || *speed <= 0 || *requests < 0 || *maxOutput < 1 || *prefillRate < 0 {
		return usageError("replay: --config is required; --speed > 0, --requests >= 0, --max-output >= 1")
	}
	if (*cert == "") != (*key == "") {
		return usageError("replay: --cert and --key go together")
	}
	cfg, err := config.Load(*cfgPath)
	if err != nil {
		return err
	}
	if len(cfg.ScopeKeys) == 0 {
		return errors.New("replay: the configuration names no scope key")
	}
	if *pc == "" {
		switch {
		case cfg.Controller != nil:
			*pc = cfg.Controller.Base
		case len(cfg.Instances) > 0:
			*pc = cfg.Instances[0].Controller
		default:
			return usageError("replay: --pc: the configuration names no controller")
		}
	}
	if *descriptor == "" {
		switch {
		case cfg.Controller != nil && len(cfg.Controller.Descriptors) > 0:
			*descriptor = cfg.Controller.Descriptors[0]
		case len(cfg.Instances) > 0:
			*descriptor = cfg.Instances[0].Engine.Descriptor
		case len(cfg.Holders) > 0 && len(cfg.Holders[0].Descriptors) > 0:
			*descriptor = cfg.Holders[0].Descriptors[0]
		default:
			return usageError("replay: --descriptor: the configuration names none")
		}
	}
	_, compat, err := descriptorGeometry(*descriptor)
	if err != nil {
		return err
	}
	reqs, err := openTrace(*tracePath)
	if err != nil {
		return err
	}
	if *requests > 0 && *requests < len(reqs) {
		reqs = reqs[:*requests]
	}
	if *cert == "" {
		*cert, *key = cfg.TLS.ClientCert, cfg.TLS.ClientKey
	}
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: *cert, Key: *key, ClientCA: cfg.TLS.ClientCA}, nil)
	if err != nil {
		return fmt.Errorf("replay: the front end's certificate: %w", err)
	}
	c, err := client.New(client.Config{TLS: mtls.ClientTLSConfig(creds), Timeout: 30 * time.Second})
	if err != nil {
		return err
	}
	defer c.Close()
	rp := &replayer{c: c, ctl: c.Controller(*pc), scope: cfg.ScopeKeys[0].ID, compat: compat, speed: *speed, maxOutput: *maxOutput}
	fmt.Fprintf(stderr, "kvsp replay: %d requests at %gx through %s\n", len(reqs), *speed, *pc)
	results, progress, wall := rp.run(context.Background(), reqs, stderr)
	s, local := summarize(reqs, results, progress, wall, *speed, *prefillRate)
	fmt.Fprintf(stdout, "\nkvsp replay: %d requests at %gx in %.0f s through %s\n\n", s.Requests, s.Speed, s.WallSeconds, *pc)
	fmt.Fprintln(stdout, "  The kvsp mode only, measured: the local-cache and no-cache baselines need control of the instances")
	fmt.Fprintln(stdout, "  (kvsp demo runs all three on a system it starts).")
	fmt.Fprintln(stdout)
	writeReplayRows(stdout, &s)
	fmt.Fprintln(stdout)
	if err := writeJSONReport(stdout, *jsonPath, &s); err != nil {
		return err
	}
	if *pngPath != "" {
		if err := hitRatioChart(fmt.Sprintf("kvsp replay: prefix hit ratio of prompt tokens, %d requests at %gx", s.Requests, s.Speed), reqs, local, progress).WritePNGFile(*pngPath); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s\n", *pngPath)
	}
	if s.Errors > 0 {
		return fmt.Errorf("replay: %d of %d requests failed (first: %v)", s.Errors, len(reqs), firstErr(results))
	}
	return nil
}

// writeReplayRows prints the figures every replay has.
func writeReplayRows(w io.Writer, s *replaySummary) {
	row := func(k, v string) { fmt.Fprintf(w, "  %-34s %s\n", k, v) }
	row("requests (failed)", fmt.Sprintf("%d (%d)", s.Requests, s.Errors))
	row("prefix hit ratio (prompt tokens)", fmt.Sprintf("%.3f: %.2f of the infinite-cache bound %.3f (per-instance LRU caches, MODELLED: %.3f)", s.HitRatio, s.HitRatio/max(s.BoundRatio, 1e-9), s.BoundRatio, s.LocalRatio))
	row("prompt tokens cached / computed", fmt.Sprintf("%d / %d", s.CachedTokens, s.Computed))
	row("TTFT p50 / p90, measured", fmt.Sprintf("%.0f / %.0f ms (wall clock, from the request's arrival in the trace to its first token)", s.TTFT["measured"][0], s.TTFT["measured"][1]))
	if t, ok := s.TTFT["modelled_kvsp"]; ok {
		row("TTFT p50 / p90, MODELLED", fmt.Sprintf("KVSP %.0f / %.0f ms, local caches only %.0f / %.0f ms, no cache %.0f / %.0f ms (--prefill-rate applied to the tokens each computes; not run)",
			t[0], t[1], s.TTFT["modelled_local_only"][0], s.TTFT["modelled_local_only"][1], s.TTFT["modelled_no_cache"][0], s.TTFT["modelled_no_cache"][1]))
	}
}

func firstErr(rs []replayResult) error {
	for _, r := range rs {
		if r.err != nil {
			return r.err
		}
	}
	return nil
}

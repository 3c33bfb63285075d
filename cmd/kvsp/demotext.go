package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvsp/kvsp/engine/llamacpp"
	"github.com/kvsp/kvsp/internal/chart"
)

// textModelID is the model's id at the demo's gateway.
const textModelID = "smollm2-135m-instruct"

// textSample is the request whose answer the demo prints in each mode:
// the first follow-up (its chat has a document, an answer and a question).
func textSample(w *textWorkload) int {
	for _, q := range w.Requests {
		if q.After != nil {
			return q.ID
		}
	}
	return 0
}

// textResult is one request's outcome through the gateway.
type textResult struct {
	replayResult
	e2e            time.Duration // arrival to the last token
	prompt, output int
	text           string
	done           time.Time
}

// textModeReport is one mode's figures on the text workload: what tools
// read (hit_ratio, errors, ttft_ms) and more beside.
type textModeReport struct {
	What     string  `json:"what"`
	Requests int     `json:"requests"`
	Errors   int     `json:"errors"`
	HitRatio float64 `json:"hit_ratio"` // cached_tokens over prompt_tokens, as the gateway's usage said
	OfBound  float64 `json:"hit_of_bound"`
	// TTFT and latency are from each request's arrival (its time in the
	// workload; a follow-up's: its think time after the answer it
	// follows) to its first token and to its last. p99 is null with
	// fewer than 100 requests.
	TTFT struct {
		P50 float64  `json:"p50"`
		P90 float64  `json:"p90"`
		P99 *float64 `json:"p99"`
	} `json:"ttft_ms"`
	Latency struct {
		P50 float64 `json:"p50"`
		P90 float64 `json:"p90"`
	} `json:"latency_ms"`
	PromptTokens int64 `json:"prompt_tokens"`
	CachedTokens int64 `json:"cached_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	// OutputRate is every stream's output over the wall time; StreamRate
	// the median stream's tokens after its first over the time they took.
	OutputRate    float64 `json:"output_tokens_per_s"`
	StreamRate    float64 `json:"stream_tokens_per_s"`
	FetchedOctets float64 `json:"fetched_octets"`
	StoredOctets  float64 `json:"stored_octets"`
	WallSeconds   float64 `json:"wall_seconds"`
	CPUSeconds    float64 `json:"cpu_seconds"`
	// PrefillRate is the prompt tokens the engines computed over the time
	// their prefill steps took (their own timing); PrefillThroughput the
	// same tokens over the wall time.
	PrefillRate       float64 `json:"prefill_tokens_per_s"`
	PrefillThroughput float64 `json:"prefill_tokens_per_wall_s"`
	Answer            string  `json:"answer"` // the sample request's
	// PerRequest is each request's outcome, in the workload's order.
	PerRequest []textRequestReport `json:"per_request"`
}

// textRequestReport is one request's outcome in a mode.
type textRequestReport struct {
	ID        int     `json:"id"`
	Prompt    int     `json:"prompt_tokens"`
	Cached    int     `json:"cached_tokens"`
	Bound     int     `json:"bound_cached_tokens"`
	Output    int     `json:"output_tokens"`
	TTFTMs    float64 `json:"ttft_ms"`
	LatencyMs float64 `json:"latency_ms"`
	Error     string  `json:"error,omitempty"`
}

// textDemoReport is kvsp-demo.json for the text workload.
type textDemoReport struct {
	Date        string                     `json:"date"`
	Workload    string                     `json:"workload"`
	Engine      string                     `json:"engine"`
	Model       string                     `json:"model"`
	Instances   int                        `json:"instances"`
	Holders     int                        `json:"holders"`
	Threads     int                        `json:"threads"`
	Speed       float64                    `json:"speed"`
	BlockTokens int                        `json:"block_tokens"`
	BlockOctets int                        `json:"block_octets"`
	Requests    int                        `json:"requests"`
	FollowUps   int                        `json:"follow_ups"`
	Documents   int                        `json:"documents"`
	Blocks      int                        `json:"distinct_blocks"`
	BoundRatio  float64                    `json:"bound_ratio"` // the infinite cache's, from the workload
	HitRatio    float64                    `json:"hit_ratio"`   // the kvsp mode's
	Errors      int                        `json:"errors"`      // in all modes
	Sample      int                        `json:"sample_request"`
	SampleAsk   string                     `json:"sample_question"`
	Modes       map[string]*textModeReport `json:"modes"`
}

// runTextDemo is kvsp demo --workload text.
func runTextDemo(dc *demoConfig, stdout, stderr io.Writer) error {
	w, err := loadTextWorkload(dc.workloadFile)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if dc.requests > 0 && dc.requests < len(w.Requests) {
		w.Requests = w.Requests[:dc.requests]
	}
	gguf, err := smolLM2Path(dc.modelFlag)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if dc.ggufPath, err = filepath.Abs(gguf); err != nil {
		return err
	}
	tok, _, closeVocab, err := vocabTokens(dc.ggufPath)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer closeVocab()
	if err := w.bound(tok); err != nil { // the requests replayed, counted by this tokenizer
		return fmt.Errorf("demo: %w", err)
	}
	info, err := llamacpp.Describe(dc.ggufPath, llamacpp.DescribeOptions{BlockTokens: textBlockTokens, KVType: "f16"})
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	desc, err := info.Descriptor.JCS()
	if err != nil {
		return err
	}
	d := info.Descriptor
	dc.desc, dc.modelName = string(desc), d.Model
	dc.octets = d.Layers * 2 * d.BlockTokens * d.KVHeads * d.HeadDim * 2
	longest := 0
	for _, q := range w.Requests {
		longest = max(longest, q.PromptTokens+q.MaxTokens)
	}
	dc.contextTokens = (longest + 16 + 255) &^ 255
	follow := w.followUps()
	fmt.Fprintf(stderr, "kvsp demo: %d chat requests (%d follow-ups, %d prompt tokens, infinite-cache bound %.3f) through the gateway at %gx; %d llama.cpp instances (%d thread each) on %s (%d KiB per %d-token block), %d holders; modes %s\n",
		len(w.Requests), follow, w.PromptTokens, w.Bound, dc.speed, dc.instances, dc.threads, dc.modelName, dc.octets>>10, dc.blockTokens, dc.holders, strings.Join(dc.modes, ", "))
	runs := map[string][]textResult{}
	rep := &textDemoReport{Date: time.Now().UTC().Format(time.RFC3339), Workload: "text", Engine: "llamacpp", Model: dc.modelName,
		Instances: dc.instances, Holders: dc.holders, Threads: dc.threads, Speed: dc.speed, BlockTokens: dc.blockTokens, BlockOctets: dc.octets,
		Requests: len(w.Requests), FollowUps: follow, Documents: len(w.Documents), Blocks: w.Blocks, BoundRatio: w.Bound,
		Sample: textSample(w), Modes: map[string]*textModeReport{}}
	rep.SampleAsk = w.Requests[rep.Sample].Messages[len(w.Requests[rep.Sample].Messages)-1].Content
	progress := map[string][]chart.Point{}
	for _, mode := range dc.modes {
		fmt.Fprintf(stderr, "mode %s: %s\n", mode, modeWhat(mode))
		res, m, wall, cpu, err := runTextMode(dc, mode, w, stderr)
		if err != nil {
			return fmt.Errorf("demo: mode %s: %w", mode, err)
		}
		runs[mode] = res
		rep.Modes[mode] = summarizeText(dc, mode, w, res, m, wall, cpu, rep.Sample)
		rep.Errors += rep.Modes[mode].Errors
		progress[mode] = textProgress(res)
	}
	if k := rep.Modes["kvsp"]; k != nil {
		rep.HitRatio = k.HitRatio
	}
	writeTextTable(stdout, dc, rep)
	if err := writeJSONReport(stdout, dc.jsonPath, rep); err != nil {
		return err
	}
	if dc.pngPath != "" {
		hit := &chart.Chart{Title: fmt.Sprintf("kvsp demo, text: prefix hit ratio of prompt tokens, %d chat requests", len(w.Requests)),
			XLabel: "requests answered", YLabel: "hit ratio"}
		mr := map[string]*modeRun{}
		for _, mode := range dc.modes { // in the TTFT panel's colours, the bound last
			hit.Series = append(hit.Series, chart.Series{Name: mode + " (measured)", Points: progress[mode]})
			r := &modeRun{}
			for _, x := range runs[mode] {
				r.results = append(r.results, x.replayResult)
			}
			mr[mode] = r
		}
		bound := chart.Series{Name: "bound"}
		var c, t int64
		for i, q := range w.Requests {
			c, t = c+int64(q.BoundTokens), t+int64(q.PromptTokens)
			bound.Points = append(bound.Points, chart.Point{X: float64(i + 1), Y: float64(c) / float64(t)})
		}
		hit.Series = append(hit.Series, bound)
		if err := chart.WritePanelsPNGFile(dc.pngPath, hit, ttftChart(dc, mr)); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s\n", dc.pngPath)
	}
	for _, mode := range dc.modes {
		if n := rep.Modes[mode].Errors; n > 0 {
			return fmt.Errorf("demo: mode %s: %d of %d requests failed (first: %v)", mode, n, len(w.Requests), firstTextErr(runs[mode]))
		}
	}
	if dc.requireOfBound > 0 {
		if failed := textHolds(rep, dc.requireOfBound); len(failed) > 0 {
			return fmt.Errorf("demo: does not hold: %s", strings.Join(failed, "; "))
		}
		fmt.Fprintf(stdout, "holds: the kvsp mode's hit ratio is %.2f of the bound (at least %g), %.3f above local's; its TTFT p50 and p90 are below local's and none's\n",
			rep.Modes["kvsp"].OfBound, dc.requireOfBound, rep.Modes["kvsp"].HitRatio-rep.Modes["local"].HitRatio)
	}
	return nil
}

// textHolds says what of the demo's bounds the run misses: the kvsp
// mode's hit ratio at least ofBound of the bound and 0.2 above local's,
// its TTFT p50 and p90 below local's and none's (the three modes run).
func textHolds(rep *textDemoReport, ofBound float64) []string {
	k, l, n := rep.Modes["kvsp"], rep.Modes["local"], rep.Modes["none"]
	if k == nil || l == nil || n == nil {
		return []string{"--require needs the three modes"}
	}
	var out []string
	if k.OfBound < ofBound {
		out = append(out, fmt.Sprintf("kvsp's hit ratio %.3f is %.2f of the bound %.3f (want %g)", k.HitRatio, k.OfBound, rep.BoundRatio, ofBound))
	}
	if k.HitRatio < l.HitRatio+0.2 {
		out = append(out, fmt.Sprintf("kvsp's hit ratio %.3f is not 0.2 above local's %.3f", k.HitRatio, l.HitRatio))
	}
	for _, name := range []string{"local", "none"} {
		if o := rep.Modes[name]; k.TTFT.P50 >= o.TTFT.P50 || k.TTFT.P90 >= o.TTFT.P90 {
			out = append(out, fmt.Sprintf("kvsp's TTFT p50 / p90 %.0f / %.0f ms is not below %s's %.0f / %.0f ms", k.TTFT.P50, k.TTFT.P90, name, o.TTFT.P50, o.TTFT.P90))
		}
	}
	return out
}

func firstTextErr(rs []textResult) error {
	for _, r := range rs {
		if r.err != nil {
			return r.err
		}
	}
	return nil
}

// runTextMode starts the system for mode and replays the workload through
// its gateway: first turns at their time, follow-ups their think time
// after the answer they follow.
func runTextMode(dc *demoConfig, mode string, w *textWorkload, stderr io.Writer) ([]textResult, map[string]float64, time.Duration, time.Duration, error) {
	s, err := startDemo(dc, mode, stderr)
	if err != nil {
		return nil, nil, 0, 0, err
	}
	defer s.stop()
	key, err := os.ReadFile(filepath.Join(s.dir, "api-key.txt"))
	if err != nil {
		return nil, nil, 0, 0, err
	}
	caPEM, err := os.ReadFile(filepath.Join(s.dir, "ca.pem"))
	if err != nil {
		return nil, nil, 0, 0, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13}, ForceAttemptHTTP2: true, MaxIdleConnsPerHost: 128}}
	defer hc.CloseIdleConnections()
	for deadline := time.Now().Add(15 * time.Second); ; { // the gateway listens
		c, err := net.DialTimeout("tcp", s.gateway, time.Second)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			return nil, nil, 0, 0, fmt.Errorf("the gateway does not listen on %s (log: %s)", s.gateway, s.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
	url := "https://" + s.gateway + "/v1/chat/completions"
	bearer := "Bearer " + strings.TrimSpace(string(key))
	n := len(w.Requests)
	results := make([]textResult, n)
	done := make([]chan struct{}, n)
	for i := range done {
		done[i] = make(chan struct{})
	}
	var finished, cached, prompt atomic.Int64
	cpu0, start := processCPU(), time.Now()
	var wg sync.WaitGroup
	for i := range w.Requests {
		wg.Add(1)
		go func(q *textRequest) {
			defer wg.Done()
			defer close(done[q.ID])
			at := start.Add(time.Duration(q.AtS / dc.speed * float64(time.Second)))
			if q.After != nil {
				<-done[*q.After]
				at = results[*q.After].done.Add(time.Duration(q.ThinkS / dc.speed * float64(time.Second)))
			}
			select {
			case <-time.After(time.Until(at)):
			case <-s.ctx.Done():
			}
			r := askGateway(s.ctx, hc, url, bearer, q, at)
			results[q.ID] = r
			finished.Add(1)
			cached.Add(int64(r.cached))
			prompt.Add(int64(r.prompt))
		}(&w.Requests[i])
	}
	all := make(chan struct{})
	go func() { wg.Wait(); close(all) }()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	line := func() {
		ratio := 0.0
		if p := prompt.Load(); p > 0 {
			ratio = float64(cached.Load()) / float64(p)
		}
		fmt.Fprintf(stderr, "\r\033[K[%5.1fs] %d/%d requests answered, prefix hit ratio %.3f (bound %.3f)", time.Since(start).Seconds(), finished.Load(), n, ratio, w.Bound)
	}
	for waiting := true; waiting; {
		select {
		case <-tick.C:
			line()
		case <-all:
			waiting = false
		}
	}
	line()
	fmt.Fprintln(stderr)
	wall, cpu := time.Since(start), processCPU()-cpu0
	m := s.scrape()
	s.stop()
	return results, m, wall, cpu, nil
}

// askGateway sends q as a streamed chat completion, greedy, with the
// usage asked for; the times are from at, its arrival.
func askGateway(ctx context.Context, hc *http.Client, url, bearer string, q *textRequest, at time.Time) (r textResult) {
	defer func() { r.done = time.Now() }()
	body, err := json.Marshal(map[string]any{"model": textModelID, "messages": q.Messages, "max_tokens": q.MaxTokens, "temperature": 0,
		"stream": true, "stream_options": map[string]bool{"include_usage": true}})
	if err != nil {
		r.err = err
		return r
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		r.err = err
		return r
	}
	req.Header.Set("Authorization", bearer)
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		r.err = err
		return r
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		r.err = fmt.Errorf("request %d: %s: %s", q.ID, resp.Status, strings.TrimSpace(string(b)))
		return r
	}
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue // a keep-alive comment, or the blank line between events
		}
		if data == "[DONE]" {
			break
		}
		var ev struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				Prompt     int `json:"prompt_tokens"`
				Completion int `json:"completion_tokens"`
				Details    struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			r.err = fmt.Errorf("request %d: an event that is not JSON: %w", q.ID, err)
			return r
		}
		if ev.Error != nil {
			r.err = fmt.Errorf("request %d: %s", q.ID, ev.Error.Message)
			return r
		}
		for _, c := range ev.Choices {
			if c.Delta.Content != "" && r.ttft == 0 {
				r.ttft = time.Since(at)
			}
			text.WriteString(c.Delta.Content)
		}
		if ev.Usage != nil {
			r.prompt, r.output, r.cached = ev.Usage.Prompt, ev.Usage.Completion, ev.Usage.Details.Cached
			r.computed = r.prompt - r.cached
		}
	}
	if err := sc.Err(); err != nil {
		r.err = fmt.Errorf("request %d: %w", q.ID, err)
		return r
	}
	r.e2e, r.text = time.Since(at), text.String()
	switch {
	case r.prompt == 0:
		r.err = fmt.Errorf("request %d: the stream ended without its usage", q.ID)
	case r.prompt != q.PromptTokens:
		r.err = fmt.Errorf("request %d: the gateway counted %d prompt tokens, the workload %d", q.ID, r.prompt, q.PromptTokens)
	case r.ttft == 0:
		r.ttft = r.e2e // an empty answer: its end is its first token
	}
	return r
}

// textProgress is the measured hit ratio as requests were answered.
func textProgress(res []textResult) []chart.Point {
	order := make([]int, len(res))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return res[a].done.Compare(res[b].done) })
	var pts []chart.Point
	var c, t int64
	for k, i := range order {
		c, t = c+int64(res[i].cached), t+int64(res[i].prompt)
		if t > 0 {
			pts = append(pts, chart.Point{X: float64(k + 1), Y: float64(c) / float64(t)})
		}
	}
	return pts
}

func summarizeText(dc *demoConfig, mode string, w *textWorkload, res []textResult, m map[string]float64, wall, cpu time.Duration, sample int) *textModeReport {
	out := &textModeReport{What: modeWhat(mode), Requests: len(res), WallSeconds: wall.Seconds(), CPUSeconds: cpu.Seconds(),
		FetchedOctets: m["kvsp_instance_fetched_bytes_total"], StoredOctets: m["kvsp_holder_puts_total"] * float64(dc.octets)}
	var ttft, e2e []time.Duration
	var streamRates []float64
	for i, r := range res {
		pr := textRequestReport{ID: i, Prompt: r.prompt, Cached: r.cached, Bound: w.Requests[i].BoundTokens, Output: r.output,
			TTFTMs: float64(r.ttft.Microseconds()) / 1000, LatencyMs: float64(r.e2e.Microseconds()) / 1000}
		if r.err != nil {
			pr.Error = r.err.Error()
		}
		out.PerRequest = append(out.PerRequest, pr)
		if r.err != nil {
			out.Errors++
			continue
		}
		ttft, e2e = append(ttft, r.ttft), append(e2e, r.e2e)
		out.PromptTokens += int64(r.prompt)
		out.CachedTokens += int64(r.cached)
		out.OutputTokens += int64(r.output)
		if d := r.e2e - r.ttft; r.output > 1 && d > 0 {
			streamRates = append(streamRates, float64(r.output-1)/d.Seconds())
		}
	}
	if out.PromptTokens > 0 {
		out.HitRatio = float64(out.CachedTokens) / float64(out.PromptTokens)
	}
	if w.Bound > 0 {
		out.OfBound = out.HitRatio / w.Bound
	}
	slices.Sort(ttft)
	slices.Sort(e2e)
	out.TTFT.P50, out.TTFT.P90 = percentileMs(ttft, 0.5), percentileMs(ttft, 0.9)
	if len(ttft) >= 100 {
		p := percentileMs(ttft, 0.99)
		out.TTFT.P99 = &p
	}
	out.Latency.P50, out.Latency.P90 = percentileMs(e2e, 0.5), percentileMs(e2e, 0.9)
	if wall > 0 {
		out.OutputRate = float64(out.OutputTokens) / wall.Seconds()
		out.PrefillThroughput = m["kvsp_instance_engine_prefilled_tokens_total"] / wall.Seconds()
	}
	if len(streamRates) > 0 {
		slices.Sort(streamRates)
		out.StreamRate = streamRates[len(streamRates)/2]
	}
	if s := m["kvsp_instance_engine_prefill_seconds_total"]; s > 0 {
		out.PrefillRate = m["kvsp_instance_engine_prefilled_tokens_total"] / s
	}
	if sample < len(res) {
		out.Answer = res[sample].text
	}
	return out
}

// writeTextTable prints the modes side by side, and the sample answers.
func writeTextTable(wr io.Writer, dc *demoConfig, rep *textDemoReport) {
	fmt.Fprintf(wr, "\nkvsp demo, text workload: %d chat requests (%d follow-ups, %d documents) through the gateway (the OpenAI API) on %s, %d llama.cpp instances, %d holders; infinite-cache bound %.3f; CPUs %d\n",
		rep.Requests, rep.FollowUps, rep.Documents, rep.Model, rep.Instances, rep.Holders, rep.BoundRatio, runtime.GOMAXPROCS(0))
	fmt.Fprintf(wr, "  %-6s %-22s %-20s %-18s %-12s %-18s %-12s %s\n", "mode", "TTFT p50 / p90", "latency p50 / p90", "hit ratio (bound)", "output t/s", "KV fetched/stored", "CPU-s (wall)", "prefill t/s: engines / wall")
	for _, mode := range dc.modes {
		m := rep.Modes[mode]
		ttft := fmt.Sprintf("%.0f / %.0f ms", m.TTFT.P50, m.TTFT.P90)
		if m.TTFT.P99 != nil {
			ttft = fmt.Sprintf("%.0f / %.0f / %.0f ms", m.TTFT.P50, m.TTFT.P90, *m.TTFT.P99)
		}
		fmt.Fprintf(wr, "  %-6s %-22s %-20s %-18s %-12s %-18s %-12s %.0f / %.0f\n", mode, ttft,
			fmt.Sprintf("%.0f / %.0f ms", m.Latency.P50, m.Latency.P90), fmt.Sprintf("%.3f (%.2f)", m.HitRatio, m.OfBound),
			fmt.Sprintf("%.1f", m.OutputRate), sizeName(int(m.FetchedOctets))+" / "+sizeName(int(m.StoredOctets)),
			fmt.Sprintf("%.0f (%.0f s)", m.CPUSeconds, m.WallSeconds), m.PrefillRate, m.PrefillThroughput)
		if m.Errors > 0 {
			fmt.Fprintf(wr, "         %d requests failed\n", m.Errors)
		}
	}
	fmt.Fprintf(wr, "\nrequest %d asks: %q\n", rep.Sample, rep.SampleAsk)
	for _, mode := range dc.modes {
		fmt.Fprintf(wr, "  %s answered: %q\n", mode, rep.Modes[mode].Answer)
	}
	fmt.Fprintln(wr)
}

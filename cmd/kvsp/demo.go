package main

import (
	"bufio"
	"container/list"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/engine/llamacpp"
	"github.com/kvsp/kvsp/internal/chart"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/gguf"
)

// The Mooncake trace (see trace/NOTICE), the demo's default workload.
//
//go:embed trace/synthetic_trace.jsonl.gz
var embeddedTrace []byte

const demoUsage = `kvsp demo: the whole system in one process, on real prefix-sharing traffic

It creates a development CA and certificates, starts on loopback with
mutual TLS an Index Service, a Placement Controller, holders and
instances, and replays a workload: every cache hit is a real, verified
transfer of real bytes. The default workload (--workload text) is chats
about kvsp's own documentation sent through the gateway (the OpenAI API)
to three llama.cpp instances running SmolLM2-135M-Instruct (--model, or
KVSP_SMOLLM2: make deps installs it). --workload trace replays the
Mooncake trace's token ids through the PC, on llama.cpp with a generated
model or on the simulated engine (--engine sim) for large replays. The
same requests run in three modes, each on a system started for it: kvsp
(holders, sharing), local (each instance's own cache), none (no cache):
every mode measured, none modelled. It ends with a summary table, a JSON
report and a PNG chart.

Usage: kvsp demo [flags]
`

// demoConfig is a run's settings.
type demoConfig struct {
	trace                   string
	repeat                  int // the trace replayed this many times, fresh ids each (repeatTrace)
	speed                   float64
	instances, holders      int
	hostCap, diskCap        config.Size
	requests                int
	maxOutput               int
	prefillRate, decodeRate float64
	transport               string
	jsonPath, pngPath       string
	cpuProfile              string
	minDeadline             time.Duration // the PC's MinDeadline; 0 its default
	keep                    bool
	modes                   []string
	engine                  string       // sim or llamacpp
	geometry                demoGeometry // sim
	blockTokens             int          // tokens per trace block (hash id)
	threads                 int          // llamacpp: llama.cpp threads per instance
	text                    bool         // the text workload, through the gateway on SmolLM2
	workloadFile            string       // text: the workload (default: the embedded one)
	modelFlag               string       // text: SmolLM2's GGUF
	engineBlocks            int          // text: each engine's own KV cache, in blocks
	requireOfBound          float64      // text: fail unless sharing holds this share of the bound (and the rest of what must hold)

	// Set by prepareEngine: the model (llamacpp: the GGUF written for
	// the run, in ggufDir), its descriptor (JSON) and name, the octets
	// of one block, and the vocabulary prompts are drawn from.
	ggufPath, ggufDir string
	desc, modelName   string
	octets            int
	vocab             int
	contextTokens     int // llamacpp: the longest prompt and its output, rounded up
}

// model, descriptor and blockOctets are the run's.
func (dc *demoConfig) model() string      { return dc.modelName }
func (dc *demoConfig) descriptor() string { return dc.desc }
func (dc *demoConfig) blockOctets() int   { return dc.octets }

// demoLlama is the model kvsp demo generates for the llama.cpp engine
// (random weights, kvsp model tiny's generator): 4 layers, 128 wide, 2 KV
// heads of 32 (1 KiB of f16 KV per token in all), a 512-wide feed-
// forward. Its prefill is real computation (every prompt token through
// every layer, attention over the prompt) sized so that the three modes
// of the whole trace fit in minutes on 2 cores.
var demoLlama = gguf.TinyParams{Name: "kvsp-demo-llama", Layers: 4, Embd: 128, Heads: 4, KVHeads: 2, FF: 512, Vocab: 2048, Context: 8192, Seed: 11}

const demoLlamaBlockTokens = 4 // tokens per trace block on llama.cpp: prompts shrink by 128

// prepareEngine sets the run's model: the simulated engine's geometry, or
// a GGUF generated for llama.cpp (the same file for every mode), with the
// descriptor derived from it as the instances will derive it.
func prepareEngine(dc *demoConfig) error {
	if dc.engine == "sim" {
		dc.desc, dc.modelName = dc.geometry.descriptor(dc.blockTokens), "kvsp-demo/"+dc.geometry.name
		dc.octets, dc.vocab = dc.geometry.blockOctets(dc.blockTokens), 32000
		return nil
	}
	if err := llamacpp.VerifyLibrary(llamaLibrary()); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "kvsp-demo-model-")
	if err != nil {
		return err
	}
	dc.ggufDir, dc.ggufPath = dir, filepath.Join(dir, "model.gguf")
	if _, err := writeAtomic(dc.ggufPath, func(w io.Writer) error { return gguf.WriteTinyLlama(w, demoLlama) }); err != nil {
		return err
	}
	info, err := llamacpp.Describe(dc.ggufPath, llamacpp.DescribeOptions{BlockTokens: dc.blockTokens, KVType: "f16"})
	if err != nil {
		return err
	}
	b, err := info.Descriptor.JCS()
	if err != nil {
		return err
	}
	d := info.Descriptor
	dc.desc, dc.modelName, dc.vocab = string(b), d.Model, info.Vocab
	dc.octets = d.Layers * 2 * d.BlockTokens * d.KVHeads * d.HeadDim * 2 // f16
	return nil
}

// llamaLibrary is the llama.cpp library directory, absolute (the
// instances run in the demo's working directory).
func llamaLibrary() string {
	d := llamacpp.DefaultLibraryDir()
	if a, err := filepath.Abs(d); err == nil {
		return a
	}
	return d
}

// demoModes are the runs of one demo: the same requests through each,
// one after the other, each on a system started for it.
var demoModes = []struct{ name, what string }{
	{"kvsp", "KVSP sharing: holders, the IS, placement and prefetch directives"},
	{"local", "each instance's own KV only: no holders, so nothing offloaded or found"},
	{"none", "no cache: the engines reuse nothing, every prompt token is computed"},
}

// The demo model: 2 layers of one 16-wide bf16 KV head, 512-token blocks
// (the trace's): 64 KiB of KV per block, so the default run moves every
// hit for real within the 3 minutes on 2 cores.
const demoDescriptor = `{"model": "kvsp-demo/tiny-2l", "tokenizer_digest": "sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c",
  "model_digest": "sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda",
  "layers": 2, "kv_heads": 1, "head_dim": 16, "kv_dtype": "bf16", "positional": "rope", "block_tokens": 512, "layout": "kvsp-layout-1"}`

const (
	traceBlockTokens = 512  // the Mooncake trace's tokens per hash id
	demoEngineBlocks = 1024 // the simulated engine's KV capacity, in blocks
)

// demoGeometry is a KV geometry the simulated engine can run with: the
// tiny default, or a real model's (--geometry), so that the octets moved
// per block are that model's.
type demoGeometry struct {
	name                     string
	layers, kvHeads, headDim int
	blockTokens              int // default tokens per trace block
}

var demoGeometries = []demoGeometry{
	{"tiny-2l", 2, 1, 16, 512},
	// Llama 3 8B: 32 layers, 8 KV heads of 128 (GQA), bf16; 16-token
	// blocks are 2 MiB, as in the spec's example record.
	{"llama-3-8b", 32, 8, 128, 16},
}

// blockOctets is the KV of one block: layers x (K, V) x tokens x heads x
// head_dim x 2 octets (bf16).
func (g demoGeometry) blockOctets(blockTokens int) int {
	return g.layers * 2 * blockTokens * g.kvHeads * g.headDim * 2
}

// descriptor is the geometry's descriptor at blockTokens; the tiny one at
// 512 is demoDescriptor. The digests name the demo's synthetic model.
func (g demoGeometry) descriptor(blockTokens int) string {
	if g.name == "tiny-2l" && blockTokens == 512 {
		return demoDescriptor
	}
	digest := func(what string) string {
		return fmt.Sprintf("sha-256:%x", sha256.Sum256([]byte("kvsp demo "+g.name+" "+what)))
	}
	return fmt.Sprintf(`{"model": "kvsp-demo/%s", "tokenizer_digest": %q, "model_digest": %q, "layers": %d, "kv_heads": %d, "head_dim": %d, "kv_dtype": "bf16", "positional": "rope", "block_tokens": %d, "layout": "kvsp-layout-1"}`,
		g.name, digest("tokenizer"), digest("model"), g.layers, g.kvHeads, g.headDim, blockTokens)
}

func parseDemoFlags(args []string, stderr io.Writer) (*demoConfig, error) {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, demoUsage); fs.PrintDefaults() }
	dc := &demoConfig{}
	fs.StringVar(&dc.trace, "trace", "", "a Mooncake-format trace (JSON lines); synth, or synth:requests=N,minutes=M,docs=D,zipf=S,doc-blocks=B,tail-blocks=T,seed=X, a generated workload of documents with a Zipf popularity (the defaults: 12,031 requests over 59 minutes, about 190,000 blocks); default: the embedded Mooncake synthetic trace")
	fs.IntVar(&dc.repeat, "repeat", 1, "replay the trace this many times back to back, each copy with fresh hash ids (as many more distinct blocks, no sharing across copies): a longer workload of the trace's shape")
	fs.StringVar(&dc.engine, "engine", "llamacpp", "the instances' engine: llamacpp (llama.cpp on a generated model, on these CPUs) or sim (the simulated engine, for large replays)")
	fs.Float64Var(&dc.speed, "speed", 0, "replay speed-up of the trace's timestamps (default: 8 on sim, 12 on llamacpp)")
	fs.IntVar(&dc.instances, "instances", 3, "inference instances")
	fs.IntVar(&dc.threads, "threads", 1, "llamacpp: llama.cpp threads per instance")
	fs.IntVar(&dc.holders, "holders", 2, "holders")
	hostCap := fs.String("host-capacity", "1GiB", "each holder's host tier")
	diskCap := fs.String("disk-capacity", "4GiB", "each holder's local-storage tier (0: none)")
	fs.IntVar(&dc.requests, "requests", 0, "requests to replay (default: the whole trace, about 2 minutes per mode at the default speed)")
	full := fs.Bool("full", false, "the whole trace with its full output lengths")
	fs.IntVar(&dc.maxOutput, "max-output", 8, "cap on output tokens per request (TTFT is what is measured)")
	fs.Float64Var(&dc.prefillRate, "prefill-rate", 42000, "the simulated engine's prefill, tokens/s (H200-like for a 7-8B model; a sleep, not a computation)")
	fs.Float64Var(&dc.decodeRate, "decode-rate", 3100, "engine decode, tokens/s shared by its batch")
	fs.StringVar(&dc.transport, "transport", "h2", "how blocks move: h2, h3 or quicbulk")
	fs.StringVar(&dc.jsonPath, "json", "kvsp-demo.json", "JSON report")
	fs.StringVar(&dc.pngPath, "png", "kvsp-demo.png", "PNG chart: prefix hit ratio as the trace is replayed in each mode; below, each mode's TTFT distribution")
	fs.StringVar(&dc.cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run (every role and the front end: one process) to this file")
	geometry := fs.String("geometry", "", "sim: the simulated model's KV geometry, tiny-2l (the default: 64 KiB per 512-token block) or llama-3-8b (32 layers, 8 KV heads of 128, bf16: 2 MiB per 16-token block)")
	fs.IntVar(&dc.blockTokens, "block-tokens", 0, "tokens per trace block (hash id), 1..512: prompts shrink by 512/B, the sharing stays (default: the geometry's, 512 or 16, on sim; 4 on llamacpp)")
	modes := fs.String("modes", "kvsp,local,none", "the modes run, in turn, each with the same requests: kvsp, local (each instance's own cache), none (no cache)")
	fs.DurationVar(&dc.minDeadline, "min-deadline", 0, "the least time a prefetch directive gives its instance to load blocks (controller.min_deadline_ms; 0: the PC's default, 10ms); past it the instance recomputes")
	fs.BoolVar(&dc.keep, "keep", false, "keep the working directory (certificates, configuration, logs)")
	workload := fs.String("workload", "text", "text (chats about kvsp's documentation through the gateway, the OpenAI API, on SmolLM2-135M-Instruct) or trace (the Mooncake trace's token ids through the PC, on a generated model or --engine sim)")
	fs.StringVar(&dc.workloadFile, "workload-file", "", "text: a workload file kvsp workload text wrote (default: the embedded one, cmd/kvsp/text/workload.json)")
	fs.IntVar(&dc.engineBlocks, "engine-blocks", textEngineBlocks, "text: each llama.cpp engine's own KV cache, in 16-token blocks (device memory holds a fraction of a fleet's prefixes: the default, 2,560 tokens, is about three prompts, a fifth of the workload's 709 distinct blocks)")
	fs.Float64Var(&dc.requireOfBound, "require", 0, "text: fail (exit 1) unless the kvsp mode's hit ratio is at least this share of the bound and 0.2 above local's, and its TTFT p50 and p90 below local's and none's (make demo: 0.9; make demo-busy: 0.8)")
	fs.StringVar(&dc.modelFlag, "model", "", "text: SmolLM2-135M-Instruct's GGUF (default: KVSP_SMOLLM2, or .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, usageError("demo: %v", err)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	switch *workload {
	case "text":
		for _, f := range []string{"trace", "repeat", "geometry", "block-tokens", "full", "prefill-rate", "decode-rate", "max-output"} {
			if set[f] {
				return nil, usageError("demo: --%s is the trace workload's (--workload trace)", f)
			}
		}
		if dc.engine != "llamacpp" {
			return nil, usageError("demo: the text workload runs on llama.cpp (--engine sim runs --workload trace)")
		}
		dc.text, dc.blockTokens = true, textBlockTokens
		if dc.engineBlocks < 130 || dc.engineBlocks > 1<<20 { // a 2,000-token prompt and its answer: 127 blocks
			return nil, usageError("demo: --engine-blocks: want 130 or more (a prompt's blocks)")
		}
		if dc.speed == 0 {
			dc.speed = 1
		}
	case "trace":
		for _, f := range []string{"workload-file", "model", "require", "engine-blocks"} {
			if set[f] {
				return nil, usageError("demo: --%s is the text workload's", f)
			}
		}
	default:
		return nil, usageError("demo: --workload: want text or trace")
	}
	switch dc.engine {
	case "sim":
		if *geometry == "" {
			*geometry = "tiny-2l"
		}
		i := slices.IndexFunc(demoGeometries, func(g demoGeometry) bool { return g.name == *geometry })
		if i < 0 {
			return nil, usageError("demo: --geometry: want tiny-2l or llama-3-8b")
		}
		dc.geometry = demoGeometries[i]
		if dc.blockTokens == 0 {
			dc.blockTokens = dc.geometry.blockTokens
		}
		if dc.speed == 0 {
			dc.speed = 8
		}
		dc.octets = dc.geometry.blockOctets(min(max(dc.blockTokens, 1), traceBlockTokens))
	case "llamacpp":
		for _, f := range []string{"geometry", "prefill-rate", "decode-rate"} {
			if set[f] {
				return nil, usageError("demo: --%s is the simulated engine's: llama.cpp's geometry is its model's, its rates are measured", f)
			}
		}
		if dc.blockTokens == 0 {
			dc.blockTokens = demoLlamaBlockTokens
		}
		if dc.speed == 0 {
			dc.speed = 12
		}
		dc.octets = demoLlama.Layers * 2 * min(max(dc.blockTokens, 1), traceBlockTokens) * demoLlama.KVHeads * demoLlama.HeadDim() * 2
		if dc.threads < 1 || dc.threads > 64 {
			return nil, usageError("demo: --threads: want 1..64")
		}
	default:
		return nil, usageError("demo: --engine: want llamacpp or sim")
	}
	if dc.blockTokens < 1 || dc.blockTokens > traceBlockTokens {
		return nil, usageError("demo: --block-tokens: want 1..512")
	}
	var err error
	if dc.hostCap, err = config.ParseSize(*hostCap); err != nil || int64(dc.hostCap) < int64(dc.octets) {
		return nil, usageError("demo: --host-capacity: want a size of at least one block (%d octets)", dc.octets)
	}
	if dc.diskCap, err = config.ParseSize(*diskCap); err != nil {
		return nil, usageError("demo: --disk-capacity: %v", err)
	}
	switch {
	case dc.speed <= 0:
		return nil, usageError("demo: --speed must be positive")
	case dc.instances < 1 || dc.instances > 16 || dc.holders < 1 || dc.holders > 8:
		return nil, usageError("demo: --instances 1..16, --holders 1..8")
	case dc.requests < 0 || dc.maxOutput < 1 || dc.prefillRate <= 0 || dc.decodeRate <= 0:
		return nil, usageError("demo: --requests >= 0, --max-output >= 1, rates > 0")
	case dc.minDeadline < 0:
		return nil, usageError("demo: --min-deadline must not be negative")
	case !slices.Contains([]string{"h2", "h3", "quicbulk"}, dc.transport):
		return nil, usageError("demo: --transport: want h2, h3 or quicbulk")
	}
	if *full {
		dc.requests, dc.maxOutput = 0, 1<<20
	}
	for _, m := range strings.Split(*modes, ",") {
		if !slices.ContainsFunc(demoModes, func(d struct{ name, what string }) bool { return d.name == m }) || slices.Contains(dc.modes, m) {
			return nil, usageError("demo: --modes: want a list of kvsp, local and none, each once")
		}
		dc.modes = append(dc.modes, m)
	}
	return dc, nil
}

// traceRequest is one line of a Mooncake trace.
type traceRequest struct {
	Timestamp    float64 `json:"timestamp"` // ms
	InputLength  int     `json:"input_length"`
	OutputLength int     `json:"output_length"`
	HashIDs      []int64 `json:"hash_ids"`
	// tokensPerBlock is what each hash id stands for: the trace's 512,
	// or B once mapped (mapTrace).
	tokensPerBlock int
}

// bt is q's tokens per block.
func (q *traceRequest) bt() int {
	if q.tokensPerBlock == 0 {
		return traceBlockTokens
	}
	return q.tokensPerBlock
}

// mapTrace maps every trace block to b tokens: each prompt shrinks by
// 512/b (its input length scaled, rounded up, within its last block),
// the hash ids, and so the sharing, stay.
func mapTrace(reqs []traceRequest, b int) []traceRequest {
	out := make([]traceRequest, len(reqs))
	for i, q := range reqs {
		n := len(q.HashIDs)
		q.InputLength = min(n*b, max((n-1)*b+1, (q.InputLength*b+traceBlockTokens-1)/traceBlockTokens))
		q.tokensPerBlock = b
		out[i] = q
	}
	return out
}

// repeatTrace is reqs replayed n times back to back: copy c's hash ids
// are shifted past every id of the copies before it (fresh blocks, none
// shared across copies), its timestamps past the last request of the
// copy before, one mean gap between requests later.
func repeatTrace(reqs []traceRequest, n int) []traceRequest {
	if n <= 1 || len(reqs) == 0 {
		return reqs
	}
	var maxID int64
	for _, q := range reqs {
		for _, id := range q.HashIDs {
			maxID = max(maxID, id)
		}
	}
	span := reqs[len(reqs)-1].Timestamp - reqs[0].Timestamp
	span += span / float64(max(1, len(reqs)-1))
	out := make([]traceRequest, 0, n*len(reqs))
	for c := range n {
		for _, q := range reqs {
			q.Timestamp += float64(c) * span
			ids := make([]int64, len(q.HashIDs))
			for i, id := range q.HashIDs {
				ids[i] = id + int64(c)*(maxID+1)
			}
			q.HashIDs = ids
			out = append(out, q)
		}
	}
	return out
}

func loadTrace(r io.Reader) ([]traceRequest, error) {
	var out []traceRequest
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var q traceRequest
		if err := json.Unmarshal([]byte(line), &q); err != nil {
			return nil, fmt.Errorf("trace line %d: %w", n, err)
		}
		if q.InputLength <= 0 || q.InputLength > len(q.HashIDs)*traceBlockTokens || q.InputLength <= (len(q.HashIDs)-1)*traceBlockTokens || q.Timestamp < 0 {
			return nil, fmt.Errorf("trace line %d: input_length %d does not fit %d blocks of %d tokens", n, q.InputLength, len(q.HashIDs), traceBlockTokens)
		}
		out = append(out, q)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("the trace has no requests")
	}
	return out, nil
}

// demoTokens derives a request's prompt: 512 (or its mapped block's)
// pseudo-random token ids per hash id, seeded by the id, so equal ids
// give equal blocks (and Block Keys), truncated to the input length.
func demoTokens(q *traceRequest, vocab int) []uint32 {
	out := make([]uint32, 0, len(q.HashIDs)*q.bt())
	for _, id := range q.HashIDs {
		r := rand.New(rand.NewPCG(uint64(id), 0x6b767370)) // "kvsp"
		for range q.bt() {
			out = append(out, r.Uint32N(uint32(vocab)))
		}
	}
	return out[:q.InputLength]
}

// prefixBound is the infinite-cache bound: the prompt tokens of complete
// blocks whose whole prefix appeared in an earlier request.
func prefixBound(reqs []traceRequest) (cached, total int64) {
	seen := map[int64]bool{}
	for _, q := range reqs {
		n := 0
		for n < len(q.HashIDs) && seen[q.HashIDs[n]] {
			n++
		}
		cached += int64(min(n, q.InputLength/q.bt()) * q.bt())
		total += int64(q.InputLength)
		for _, id := range q.HashIDs {
			seen[id] = true
		}
	}
	return cached, total
}

// localOnly models per-instance LRU caches of the engine's capacity (no
// sharing): the same requests on the same instances, the cached prompt
// tokens of each.
func localOnly(reqs []traceRequest, instanceOf []int, instances int) []int {
	type cache struct {
		lru *list.List // front: most recent; values: hash ids
		at  map[int64]*list.Element
	}
	caches := make([]cache, instances)
	for i := range caches {
		caches[i] = cache{lru: list.New(), at: map[int64]*list.Element{}}
	}
	out := make([]int, len(reqs))
	for i, q := range reqs {
		if instanceOf[i] < 0 { // not served
			continue
		}
		c := &caches[instanceOf[i]]
		n := 0
		for n < q.InputLength/q.bt() && c.at[q.HashIDs[n]] != nil {
			n++
		}
		out[i] = n * q.bt()
		for _, id := range q.HashIDs {
			if e := c.at[id]; e != nil {
				c.lru.MoveToFront(e)
			} else {
				c.at[id] = c.lru.PushFront(id)
			}
		}
		for c.lru.Len() > demoEngineBlocks {
			delete(c.at, c.lru.Remove(c.lru.Back()).(int64))
		}
	}
	return out
}

// sharedLRU models one LRU cache of capBlocks blocks shared by every
// instance, each block available as soon as a request computed it: the
// cached prompt tokens and all prompt tokens.
func sharedLRU(reqs []traceRequest, capBlocks int) (cached, total int64) {
	lru, at := list.New(), map[int64]*list.Element{}
	for _, q := range reqs {
		n := 0
		for n < q.InputLength/q.bt() && at[q.HashIDs[n]] != nil {
			n++
		}
		cached += int64(n * q.bt())
		total += int64(q.InputLength)
		for _, id := range q.HashIDs {
			if e := at[id]; e != nil {
				lru.MoveToFront(e)
			} else {
				at[id] = lru.PushFront(id)
			}
		}
		for lru.Len() > capBlocks {
			delete(at, lru.Remove(lru.Back()).(int64))
		}
	}
	return cached, total
}

// demoReport is the JSON the run writes.
type demoReport struct {
	Date        string `json:"date"`
	Engine      string `json:"engine"` // the instances' engine kind
	Model       string `json:"model"`
	BlockOctets int    `json:"block_octets"`
	BlockTokens int    `json:"block_tokens"` // tokens per trace block (hash id)
	Instances   int    `json:"instances"`
	Holders     int    `json:"holders"`
	Transport   string `json:"transport"`
	HostOctets  int64  `json:"host_octets"`
	DiskOctets  int64  `json:"disk_octets"`
	Fetched     int64  `json:"fetched_tokens"` // prompt tokens loaded from holders
	// CPUSeconds is the CPU time (user and system) the process spent
	// during the replay: every role and the front end; CPUUtilization is
	// that over the wall time and the CPUs Go may use.
	CPUSeconds     float64 `json:"cpu_seconds"`
	CPUUtilization float64 `json:"cpu_utilization"`
	// LRURatio models one shared LRU cache of the holders' capacity, with
	// blocks available the moment they are computed (not run).
	LRURatio float64 `json:"modelled_lru_ratio"`
	// Modes are the measured runs of the same requests: kvsp, local
	// (each instance's own cache) and none (no cache). The members above
	// (replaySummary: hit ratio, TTFT, progress) are the kvsp mode's.
	Modes map[string]*modeReport `json:"modes"`
	replaySummary
	// Drops is what each stage of the pipeline dropped or skipped, by
	// stage and why, from the processes' own counters: where sharing was
	// lost names itself.
	Drops map[string]map[string]float64 `json:"drops"`
	// Resources is how busy each resource the kvsp mode shares was over
	// the replay, measured; Saturated names the one furthest past its
	// limit (saturatedAt of its capacity, or turnedAwayAt of what was
	// offered turned away), "" when none reached it.
	Resources []resourceUse      `json:"resources"`
	Saturated string             `json:"saturated"`
	Counters  map[string]float64 `json:"counters"`
}

// resourceUse is a resource's measured utilisation: the share of its
// capacity used over the replay (for a queue or a quota, the share of
// what was offered to it that it turned away).
type resourceUse struct {
	Name        string  `json:"name"`
	Utilisation float64 `json:"utilisation"`
	What        string  `json:"what"` // how it was measured
}

// saturatedAt is the utilisation from which a resource is named as
// saturated; for the queues and quotas that turn work away, the share
// turned away from which it is.
const (
	saturatedAt    = 0.9
	turnedAwayAt   = 0.1
	demoLinkMbitPS = 100000
)

// resources measures the kvsp mode's resources from the process's CPU
// and its metrics over wall, busiest first, and names the saturated one.
func resources(dc *demoConfig, cpuUtil float64, m map[string]float64, wall time.Duration) ([]resourceUse, string) {
	w := wall.Seconds()
	if w <= 0 {
		return nil, ""
	}
	share := func(a, b float64) float64 {
		if b <= 0 {
			return 0
		}
		return a / b
	}
	offered := metricSum(m, "kvsp_instance_offloads_total", `outcome="stored"`) + metricSum(m, "kvsp_instance_offloads_total", `outcome="skipped"`)
	directives := metricSum(m, "kvsp_pc_directives_total", `outcome="sent"`) + metricSum(m, "kvsp_pc_directives_total", `outcome="quota"`)
	placed := metricSum(m, "kvsp_pc_placements_total", `outcome="placed"`) + metricSum(m, "kvsp_pc_placements_total", `outcome="no_capacity"`)
	rs := []resourceUse{
		{"CPU", cpuUtil, fmt.Sprintf("the process's CPU time over the wall time and %d CPUs (every role and the front end)", runtime.GOMAXPROCS(0))},
		{"engine batches", share(m["kvsp_instance_busy_slot_seconds_total"], m["kvsp_instance_batch_slots"]*w),
			fmt.Sprintf("batch slots held by accepted requests over the slots and the wall time; %.1f requests waited beyond them on average", m["kvsp_instance_waiting_request_seconds_total"]/w)},
		{"links", share(m["kvsp_instance_fetched_bytes_total"]*8, float64(dc.instances*dc.holders)*demoLinkMbitPS*1e6*w),
			fmt.Sprintf("octets fetched over the instances' %d links' configured %d Mbit/s", dc.instances*dc.holders, demoLinkMbitPS)},
		{"placement (instances full)", share(metricSum(m, "kvsp_pc_placements_total", `outcome="no_capacity"`), placed), "placements refused after waiting for room, over those placed or refused"},
		{"offload queues", share(metricSum(m, "kvsp_instance_offloads_total", `outcome="skipped"`), offered), "blocks skipped (the queue full) over the blocks offered to it"},
		{"directive quota", share(metricSum(m, "kvsp_pc_directives_total", `outcome="quota"`), directives), "directives not sent for the pending quota over those sent or not sent for it"},
		{"lease quota", share(m["kvsp_holder_lease_rejections_total"], m["kvsp_holder_lease_rejections_total"]+metricSum(m, "kvsp_instance_prefetch_blocks_total", `outcome="loaded"`)), "leases refused over leases refused and blocks loaded"},
	}
	sat, most := "", 1.0
	for _, r := range rs {
		limit := turnedAwayAt
		if r.Name == "CPU" || r.Name == "engine batches" || r.Name == "links" {
			limit = saturatedAt
		}
		if x := r.Utilisation / limit; x >= most {
			sat, most = r.Name, x
		}
	}
	return rs, sat
}

// pipelineDrops are the counters of what each stage of the pipeline
// dropped or skipped: stage, why, metric and the labels that select it.
var pipelineDrops = []struct {
	stage, why, metric string
	labels             []string
}{
	{"place", "no_capacity (refused after waiting 1 s, retried by the front end)", "kvsp_pc_placements_total", []string{`outcome="no_capacity"`}},
	{"place", "incompatible", "kvsp_pc_placements_total", []string{`outcome="incompatible"`}},
	{"lookup", "failed (placed without the cache)", "kvsp_pc_lookups_total", []string{`outcome="failed"`}},
	{"directive", "not sent: recompute chosen (estimated cheaper, or no link to a source)", "kvsp_pc_directives_total", []string{`outcome="recompute"`}},
	{"directive", "not sent: pending quota", "kvsp_pc_directives_total", []string{`outcome="quota"`}},
	{"directive", "not accepted by the instance", "kvsp_pc_directives_total", []string{`outcome="failed"`}},
	{"directive", "partial (a leading prefix loaded, the rest recomputed)", "kvsp_instance_directives_total", []string{`state="partial"`}},
	{"directive", "failed", "kvsp_instance_directives_total", []string{`state="failed"`}},
	{"directive failed or partial", "deadline", "kvsp_instance_directive_failures_total", []string{`reason="deadline"`}},
	{"directive failed or partial", "lease not found (the holder evicted the block)", "kvsp_instance_directive_failures_total", []string{`reason="lease_not_found"`}},
	{"directive failed or partial", "lease quota", "kvsp_instance_directive_failures_total", []string{`reason="lease_quota"`}},
	{"directive failed or partial", "lease failed", "kvsp_instance_directive_failures_total", []string{`reason="lease_failed"`}},
	{"directive failed or partial", "GET 404 (evicted since the lookup)", "kvsp_instance_directive_failures_total", []string{`reason="not_found"`}},
	{"directive failed or partial", "digest", "kvsp_instance_directive_failures_total", []string{`reason="digest"`}},
	{"directive failed or partial", "holder unavailable or busy", "kvsp_instance_directive_failures_total", []string{`reason="holder_unavailable"`}},
	{"directive failed or partial", "holder unavailable or busy", "kvsp_instance_directive_failures_total", []string{`reason="too_many_requests"`}},
	{"directive failed or partial", "refused", "kvsp_instance_directive_failures_total", []string{`reason="refused"`}},
	{"directive failed or partial", "layers unavailable", "kvsp_instance_directive_failures_total", []string{`reason="layers_unavailable"`}},
	{"directive failed or partial", "engine", "kvsp_instance_directive_failures_total", []string{`reason="engine"`}},
	{"directive failed or partial", "transport", "kvsp_instance_directive_failures_total", []string{`reason="transport"`}},
	{"directive failed or partial", "cancelled", "kvsp_instance_directive_failures_total", []string{`reason="cancelled"`}},
	{"lease", "refused by quota", "kvsp_holder_lease_rejections_total", nil},
	{"GET", "block not loaded", "kvsp_instance_prefetch_blocks_total", []string{`outcome="failed"`}},
	{"GET", "digest mismatch", "kvsp_instance_digest_failures_total", nil},
	{"inject", "loaded, evicted before the prefill", "kvsp_instance_prompt_blocks_lost_total", nil},
	{"offload PUT", "skipped: offload buffer full (deepest blocks first)", "kvsp_instance_offloads_total", []string{`outcome="skipped"`}},
	{"offload PUT", "evicted from the engine before it was copied", "kvsp_instance_offloads_total", []string{`outcome="evicted"`}},
	{"offload PUT", "failed", "kvsp_instance_offloads_total", []string{`outcome="failed"`}},
	{"publish", "IS unreachable (retried)", "kvsp_holder_publish_failures_total", []string{`why="unreachable"`}},
	{"publish", "IS unavailable (retried)", "kvsp_holder_publish_failures_total", []string{`why="unavailable"`}},
	{"publish", "refused (dropped)", "kvsp_holder_publish_failures_total", []string{`why="refused"`}},
}

// drops reads pipelineDrops off the metrics.
func drops(m map[string]float64) map[string]map[string]float64 {
	out := map[string]map[string]float64{}
	for _, d := range pipelineDrops {
		if out[d.stage] == nil {
			out[d.stage] = map[string]float64{}
		}
		out[d.stage][d.why] += metricSum(m, d.metric, d.labels...)
	}
	return out
}

func cmdDemo(args []string, stdout, stderr io.Writer) error {
	dc, err := parseDemoFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	if dc.text {
		return runTextDemo(dc, stdout, stderr)
	}
	reqs, err := openTrace(dc.trace)
	if err != nil {
		return err
	}
	if dc.repeat < 1 {
		return usageError("demo: --repeat: at least 1")
	}
	reqs = repeatTrace(reqs, dc.repeat)
	if dc.requests > 0 && dc.requests < len(reqs) {
		reqs = reqs[:dc.requests]
	}
	if dc.blockTokens != traceBlockTokens {
		reqs = mapTrace(reqs, dc.blockTokens)
	}
	longest := 0
	for _, q := range reqs {
		longest = max(longest, q.InputLength+min(q.OutputLength, dc.maxOutput))
	}
	dc.contextTokens = (longest + 16 + 255) &^ 255
	if err := prepareEngine(dc); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if dc.ggufDir != "" {
		defer os.RemoveAll(dc.ggufDir)
	}
	fmt.Fprintf(stderr, "kvsp demo: %d requests of %s at %gx; %d instances on the %s engine, %d holders (%s host, %s local-storage), blocks over %s; model %s (%d KiB per %d-token block); modes %s\n",
		len(reqs), traceName(dc), dc.speed, dc.instances, dc.engine, dc.holders, sizeName(int(dc.hostCap)), sizeName(int(dc.diskCap)), dc.transport, dc.model(), dc.blockOctets()>>10, dc.blockTokens, strings.Join(dc.modes, ", "))
	if dc.cpuProfile != "" {
		f, err := os.Create(dc.cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	runs := map[string]*modeRun{}
	for _, mode := range dc.modes {
		fmt.Fprintf(stderr, "mode %s: %s\n", mode, modeWhat(mode))
		r, err := runDemoMode(dc, mode, reqs, stderr)
		if err != nil {
			return fmt.Errorf("demo: mode %s: %w", mode, err)
		}
		runs[mode] = r
	}
	main := runs[dc.modes[0]]
	if r := runs["kvsp"]; r != nil {
		main = r
	}
	rep, local := summarizeDemo(dc, reqs, main.results, main.m, main.progress, main.wall)
	rep.CPUSeconds = main.cpu.Seconds()
	rep.CPUUtilization = main.cpu.Seconds() / (main.wall.Seconds() * float64(runtime.GOMAXPROCS(0)))
	if runs["kvsp"] != nil {
		rep.Resources, rep.Saturated = resources(dc, rep.CPUUtilization, main.m, main.wall)
	}
	rep.Modes = map[string]*modeReport{}
	for mode, r := range runs {
		rep.Modes[mode] = summarizeMode(dc, mode, reqs, r)
	}
	writeDemoTable(stdout, dc, &rep)
	if err := writeJSONReport(stdout, dc.jsonPath, &rep); err != nil {
		return err
	}
	if dc.pngPath != "" {
		hit := hitRatioChart(fmt.Sprintf("kvsp demo: prefix hit ratio of prompt tokens, %d requests at %gx", rep.Requests, rep.Speed), reqs, local, nil)
		hit.Series = slices.DeleteFunc(hit.Series, func(x chart.Series) bool { return x.Name == "local caches only" }) // a model: the local mode is run
		for _, mode := range dc.modes {
			hit.Series = append(hit.Series, chart.Series{Name: mode + " (measured)", Points: runs[mode].progress})
		}
		if err := chart.WritePanelsPNGFile(dc.pngPath, hit, ttftChart(dc, runs)); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s\n", dc.pngPath)
	}
	for _, mode := range dc.modes {
		if m := rep.Modes[mode]; m.Errors > len(reqs)/100 {
			return fmt.Errorf("demo: mode %s: %d of %d requests failed (first: %v)", mode, m.Errors, len(reqs), firstErr(runs[mode].results))
		}
	}
	return nil
}

func modeWhat(mode string) string {
	for _, d := range demoModes {
		if d.name == mode {
			return d.what
		}
	}
	return ""
}

// modeRun is what one mode's run measured.
type modeRun struct {
	results  []replayResult
	progress []chart.Point
	wall     time.Duration
	cpu      time.Duration // the process's, during the replay
	m        map[string]float64
}

// demoSystem is one mode's system, running in this process: its working
// directory, addresses, metrics and log.
type demoSystem struct {
	dir, addr, maddr, gateway string
	log                       string
	ctx                       context.Context
	stop                      func() // idempotent: stops serving and waits
}

func (s *demoSystem) scrape() map[string]float64 {
	return scrapeMetrics("http://" + s.maddr + "/metrics")
}

// startDemo starts the system for mode on loopback (its own
// certificates, configuration and ports), ready when the PC has a status
// record from every instance.
func startDemo(dc *demoConfig, mode string, stderr io.Writer) (_ *demoSystem, err error) {
	dir, err := os.MkdirTemp("", "kvsp-demo-"+mode+"-")
	if err != nil {
		return nil, err
	}
	s := &demoSystem{dir: dir, addr: freeAddr(), maddr: freeAddr(), stop: func() {}}
	if dc.keep {
		fmt.Fprintf(stderr, "working directory: %s\n", dir)
	}
	cleanup := func() {
		if !dc.keep {
			os.RemoveAll(dir)
		}
	}
	defer func() {
		if err != nil {
			s.stop()
			cleanup()
		}
	}()
	if dc.text {
		s.gateway = freeAddr()
	}
	if s.addr == "" || s.maddr == "" || (dc.text && s.gateway == "") {
		return nil, errors.New("no free loopback port")
	}
	cfgPath := filepath.Join(dir, "kvsp.yaml")
	if err := os.WriteFile(filepath.Join(dir, "descriptor.json"), []byte(dc.descriptor()), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(cfgPath, []byte(demoConfigYAML(dc, s.addr, s.maddr, s.gateway, mode)), 0o644); err != nil {
		return nil, err
	}
	if err := cmdCerts([]string{"--config", cfgPath}, io.Discard); err != nil {
		return nil, fmt.Errorf("certs: %w", err)
	}
	logf, err := os.Create(filepath.Join(dir, "serve.log"))
	if err != nil {
		return nil, err
	}
	s.log = logf.Name()
	ctx, cancel := context.WithCancel(context.Background())
	s.ctx = ctx
	ready, done := make(chan string, 1), make(chan error, 1)
	go func() { done <- serve(ctx, []string{"--config", cfgPath}, logf, nil, ready) }()
	select {
	case <-ready:
	case err := <-done:
		cancel()
		logf.Close()
		return nil, fmt.Errorf("the system did not start: %w (log: %s)", err, s.log)
	}
	var once sync.Once
	s.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				fmt.Fprintf(stderr, "kvsp demo: shutdown: %v\n", err)
			}
			logf.Close()
			cleanup()
		})
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		m := s.scrape()
		if metricSum(m, "kvsp_http_requests_total", `code="200"`, `route="PUT /pc/instances/{instance}/status"`) >= float64(dc.instances) {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("the instances did not report to the PC within 30 s (log: %s)", s.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return s, nil
}

// runDemoMode starts the system for mode, replays reqs through its PC,
// and stops it.
func runDemoMode(dc *demoConfig, mode string, reqs []traceRequest, stderr io.Writer) (*modeRun, error) {
	s, err := startDemo(dc, mode, stderr)
	if err != nil {
		return nil, err
	}
	defer s.stop()
	front, scope, compat, err := demoFront(s.dir, dc.descriptor())
	if err != nil {
		return nil, err
	}
	defer front.Close()
	rp := &replayer{c: front, ctl: front.Controller("https://" + s.addr + "/pc/"), scope: scope, compat: compat, speed: dc.speed, maxOutput: dc.maxOutput, vocab: dc.vocab,
		status: func() string {
			return mode + ", " + sizeName(int(metricSum(s.scrape(), "kvsp_instance_fetched_bytes_total"))&^(1<<10-1)) + " fetched"
		}}
	r := &modeRun{}
	cpu0 := processCPU()
	r.results, r.progress, r.wall = rp.run(s.ctx, reqs, stderr)
	r.cpu = processCPU() - cpu0
	r.m = s.scrape()
	s.stop()
	return r, nil
}

// modeReport is one mode's measured figures.
type modeReport struct {
	What     string  `json:"what"`
	Requests int     `json:"requests"`
	Errors   int     `json:"errors"`
	HitRatio float64 `json:"hit_ratio"` // cached / all prompt tokens, as the instances reported
	// TTFT is wall clock from the request's arrival (its time in the
	// trace, sped up) to its first token, in ms: waits for a place in flight
	// and for capacity count.
	TTFT struct {
		P50 float64 `json:"p50"`
		P90 float64 `json:"p90"`
		P99 float64 `json:"p99"`
	} `json:"ttft_ms"`
	CachedTokens   int64   `json:"cached_tokens"`
	ComputedTokens int64   `json:"computed_tokens"`
	FetchedOctets  float64 `json:"fetched_octets"` // KV the instances received from holders
	StoredOctets   float64 `json:"stored_octets"`  // KV the holders stored (PUT)
	WallSeconds    float64 `json:"wall_seconds"`
	CPUSeconds     float64 `json:"cpu_seconds"` // the process's (every role and the front end)
	// PrefillRate is the prompt tokens the engines computed over the
	// time their prefill steps took, by their own timing (summed over the
	// instances: each engine's rate while prefilling, averaged by time);
	// PrefillThroughput is the same tokens over the wall time, all
	// instances together.
	PrefillRate       float64 `json:"prefill_tokens_per_s"`
	PrefillThroughput float64 `json:"prefill_tokens_per_wall_s"`
}

func summarizeMode(dc *demoConfig, mode string, reqs []traceRequest, r *modeRun) *modeReport {
	out := &modeReport{What: modeWhat(mode), Requests: len(reqs), WallSeconds: r.wall.Seconds(), CPUSeconds: r.cpu.Seconds(),
		FetchedOctets: r.m["kvsp_instance_fetched_bytes_total"], StoredOctets: r.m["kvsp_holder_puts_total"] * float64(dc.blockOctets())}
	var ttft []time.Duration
	for _, x := range r.results {
		if x.err != nil {
			out.Errors++
			continue
		}
		ttft = append(ttft, x.ttft)
		out.CachedTokens += int64(x.cached)
		out.ComputedTokens += int64(x.computed)
	}
	if t := out.CachedTokens + out.ComputedTokens; t > 0 {
		out.HitRatio = float64(out.CachedTokens) / float64(t)
	}
	if s := r.m["kvsp_instance_engine_prefill_seconds_total"]; s > 0 {
		out.PrefillRate = r.m["kvsp_instance_engine_prefilled_tokens_total"] / s
	}
	if r.wall > 0 {
		out.PrefillThroughput = r.m["kvsp_instance_engine_prefilled_tokens_total"] / r.wall.Seconds()
	}
	slices.Sort(ttft)
	out.TTFT.P50, out.TTFT.P90, out.TTFT.P99 = percentileMs(ttft, 0.5), percentileMs(ttft, 0.9), percentileMs(ttft, 0.99)
	return out
}

// ttftChart is the second panel: each mode's TTFT distribution (the
// fraction of requests whose first token came within x ms).
func ttftChart(dc *demoConfig, runs map[string]*modeRun) *chart.Chart {
	c := &chart.Chart{Title: "TTFT in each mode: measured, arrival to the first token", XLabel: "TTFT (ms)", YLabel: "share",
		LogX: true, XTick: func(x float64) string { return fmt.Sprint(int(x)) }}
	for _, mode := range dc.modes {
		var ms []float64
		for _, x := range runs[mode].results {
			if x.err == nil {
				ms = append(ms, max(1, float64(x.ttft.Microseconds())/1000))
			}
		}
		slices.Sort(ms)
		sr := chart.Series{Name: mode}
		step := max(1, len(ms)/200)
		for i := 0; i < len(ms); i += step {
			sr.Points = append(sr.Points, chart.Point{X: ms[i], Y: float64(i+1) / float64(len(ms))})
		}
		if n := len(ms); n > 0 {
			sr.Points = append(sr.Points, chart.Point{X: ms[n-1], Y: 1})
		}
		c.Series = append(c.Series, sr)
	}
	return c
}

// processCPU is the process's user and system CPU time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func traceName(dc *demoConfig) string {
	if dc.trace == "" {
		return "the Mooncake synthetic trace"
	}
	return dc.trace
}

// freeAddr returns a loopback address with a port free at the time.
func freeAddr() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return ""
	}
	defer ln.Close()
	return ln.Addr().String()
}

// demoConfigYAML is the one process's configuration for mode: every role
// on one listener; in the local and none modes no holders (the instances
// name none: the IS stays, with nothing to find), and in none the
// engines run without their prefix cache. The text workload adds the
// gateway (on gateway) in front of the PC.
func demoConfigYAML(dc *demoConfig, addr, maddr, gateway, mode string) string {
	b := "https://" + addr
	var s strings.Builder
	fmt.Fprintf(&s, "listen: %s\nmetrics_listen: %s\nhttp3: %v\nquicbulk: %v\ntransport: %s\n", addr, maddr, dc.transport == "h3", dc.transport == "quicbulk", dc.transport)
	s.WriteString("tls: {cert: server.pem, key: server.key, client_ca: ca.pem, client_cert: self.pem, client_key: self.key}\npolicy: policy.yaml\nscopes: [{key_file: scope-a.key}]\n")
	fmt.Fprintf(&s, "index: {base: %s/is/, max_ttl_ms: 3600000, max_lookup_keys: 4096, backend: memory}\n", b)
	fmt.Fprintf(&s, "controller: {base: %s/pc/, index: %s/is/, state: memory, descriptors: [descriptor.json], min_deadline_ms: %d}\n", b, b, dc.minDeadline.Milliseconds())
	if gateway != "" {
		fmt.Fprintf(&s, "gateway:\n  listen: %s\n  controller: %s/pc/\n  library: %s\n  models:\n    - {id: %s, model: %s, block_tokens: %d, context_tokens: %d, default_max_tokens: %d, max_tokens: %d}\n",
			gateway, b, llamaLibrary(), textModelID, dc.ggufPath, dc.blockTokens, dc.contextTokens, textAnswer, textAnswer*8)
	}
	holders := dc.holders
	if mode != "kvsp" {
		holders = 0
	} else {
		s.WriteString("holders:\n")
	}
	for h := 1; h <= holders; h++ {
		fmt.Fprintf(&s, "  - base: %s/h%d/\n    index: %s/is/\n    record_ttl_ms: 3600000\n    descriptors: [descriptor.json]\n", b, h, b)
		fmt.Fprintf(&s, "    tiers: [{name: host, capacity: %d, read_mbit_per_s: 400000}", dc.hostCap)
		if dc.diskCap > 0 {
			fmt.Fprintf(&s, ", {name: local-storage, capacity: %d, read_mbit_per_s: 50000, path: h%d-store}", dc.diskCap, h)
		}
		s.WriteString("]\n    lease_quota: {octets: 1GiB, max_ttl_ms: 60000, max_leases: 4096}\n")
	}
	s.WriteString("instances:\n")
	for i := 1; i <= dc.instances; i++ {
		fmt.Fprintf(&s, "  - base: %s/ii%d/\n    controller: %s/pc/\n    index: %s/is/\n", b, i, b, b)
		if holders > 0 {
			fmt.Fprintf(&s, "    holder: %s/h%d/\n", b, (i-1)%holders+1)
		}
		switch {
		case dc.text: // SmolLM2's blocks are 360 KiB: the offload buffer holds a long prompt's
			fmt.Fprintf(&s, "    offload_buffer: 128MiB\n    engine: {kind: llamacpp, model: %s, library: %s, descriptor: descriptor.json, block_tokens: %d, threads: %d, batch_size: 4, kv_capacity: %d, context_tokens: %d, prefix_cache: %v, flash_attention: false}\n    links: [",
				dc.ggufPath, llamaLibrary(), dc.blockTokens, dc.threads, dc.engineBlocks, dc.contextTokens, mode != "none")
		case dc.engine == "llamacpp":
			fmt.Fprintf(&s, "    engine: {kind: llamacpp, model: %s, library: %s, descriptor: descriptor.json, block_tokens: %d, threads: %d, batch_size: 4, kv_capacity: %d, context_tokens: %d, prefix_cache: %v}\n    links: [",
				dc.ggufPath, llamaLibrary(), dc.blockTokens, dc.threads, demoEngineBlocks, dc.contextTokens, mode != "none")
		default:
			fmt.Fprintf(&s, "    engine: {kind: sim, descriptor: descriptor.json, prefill_tokens_per_s: %g, decode_tokens_per_s: %g, prefix_cache: %v}\n    links: [", dc.prefillRate, dc.decodeRate, mode != "none")
		}
		for h := 1; h <= holders; h++ {
			if h > 1 {
				s.WriteString(", ")
			}
			fmt.Fprintf(&s, "{holder: %s/h%d/, mbit_per_s: 100000, rtt_us: 20}", b, h)
		}
		s.WriteString("]\n")
	}
	return s.String()
}

// demoFront is the front end: the tool client's certificate, the scope
// of the generated key, the demo model's compat_id.
func demoFront(dir, descriptor string) (*client.Client, kvsp.ScopeID, kvsp.CompatID, error) {
	pair, err := tls.LoadX509KeyPair(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key"))
	if err != nil {
		return nil, kvsp.ScopeID{}, kvsp.CompatID{}, err
	}
	ca, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		return nil, kvsp.ScopeID{}, kvsp.CompatID{}, err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	c, err := client.New(client.Config{TLS: &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, Certificates: []tls.Certificate{pair}}, Timeout: 30 * time.Second})
	if err != nil {
		return nil, kvsp.ScopeID{}, kvsp.CompatID{}, err
	}
	kb, err := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	if err != nil {
		return nil, kvsp.ScopeID{}, kvsp.CompatID{}, err
	}
	sk, err := kvsp.ScopeKeyFromFile(kb)
	if err != nil {
		return nil, kvsp.ScopeID{}, kvsp.CompatID{}, err
	}
	d, err := kvsp.ParseDescriptor([]byte(descriptor))
	if err != nil {
		return nil, kvsp.ScopeID{}, kvsp.CompatID{}, err
	}
	compat, err := d.CompatID()
	return c, sk.ID(), compat, err
}

// scrapeMetrics reads a Prometheus text exposition into series
// name{labels} -> value, and name -> the sum over its series.
func scrapeMetrics(url string) map[string]float64 {
	out := map[string]float64{}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		return out
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		key := line[:i]
		out[key] += v
		if j := strings.IndexByte(key, '{'); j > 0 { // and the total over labels
			out[key[:j]] += v
		}
	}
	return out
}

// percentile of sorted durations, in ms.
// metricSum sums the series of name whose labels include every one of
// labels (`source="cached"`).
func metricSum(m map[string]float64, name string, labels ...string) float64 {
	if len(labels) == 0 {
		return m[name]
	}
	var v float64
	for k, x := range m {
		if !strings.HasPrefix(k, name+"{") {
			continue
		}
		ok := true
		for _, l := range labels {
			ok = ok && strings.Contains(k, l)
		}
		if ok {
			v += x
		}
	}
	return v
}

func percentileMs(ds []time.Duration, p float64) float64 {
	if len(ds) == 0 {
		return 0
	}
	return float64(ds[min(len(ds)-1, int(p*float64(len(ds))))].Microseconds()) / 1000
}

func summarizeDemo(dc *demoConfig, reqs []traceRequest, results []replayResult, m map[string]float64, progress []chart.Point, wall time.Duration) (demoReport, []int) {
	sum, local := summarize(reqs, results, progress, wall, dc.speed, 0)
	rep := demoReport{Date: time.Now().UTC().Format(time.RFC3339), Engine: dc.engine, Model: dc.model(), BlockOctets: dc.blockOctets(), BlockTokens: dc.blockTokens,
		Instances: dc.instances, Holders: dc.holders, Transport: dc.transport, HostOctets: int64(dc.hostCap), DiskOctets: int64(dc.diskCap),
		replaySummary: sum, Counters: map[string]float64{}, Drops: drops(m)}
	rep.Fetched = int64(metricSum(m, "kvsp_instance_prefetch_blocks_total", `outcome="loaded"`)) * int64(dc.blockTokens)
	capBlocks := int(int64(dc.holders) * int64(dc.hostCap+dc.diskCap) / int64(dc.blockOctets()))
	if c, t := sharedLRU(reqs, capBlocks); t > 0 {
		rep.LRURatio = float64(c) / float64(t)
	}
	for _, k := range []string{"kvsp_holder_bytes_served_total", "kvsp_holder_gets_total", "kvsp_holder_puts_total", "kvsp_holder_evictions_total",
		"kvsp_holder_demotions_total", "kvsp_holder_lease_rejections_total", "kvsp_holder_digest_failures_total", "kvsp_instance_digest_failures_total",
		"kvsp_instance_fetched_bytes_total", "kvsp_pc_migrations_total", "kvsp_pc_directives_total", "kvsp_instance_rdma_blocks_total"} {
		rep.Counters[k] = m[k]
	}
	for k, v := range m { // every labelled kvsp series and every histogram's sum and count, for the record
		if strings.HasPrefix(k, "kvsp_") && (strings.Contains(k, "{") || strings.HasSuffix(k, "_sum") || strings.HasSuffix(k, "_count")) && !strings.Contains(k, "_bucket") {
			rep.Counters[k] = v
		}
	}
	return rep, local
}

// dropsLine lists the stages' non-zero drops: "directive: not sent:
// pending quota 513; ...", or "nothing".
func dropsLine(d map[string]map[string]float64) string {
	var parts []string
	for _, p := range pipelineDrops {
		if v := d[p.stage][p.why]; v > 0 && !slices.Contains(parts, fmt.Sprintf("%s: %s %.0f", p.stage, p.why, v)) {
			parts = append(parts, fmt.Sprintf("%s: %s %.0f", p.stage, p.why, v))
		}
	}
	if len(parts) == 0 {
		return "nothing"
	}
	return strings.Join(parts, "; ")
}

// servedByTier sums kvsp_holder_bytes_served_total by its tier and proto
// labels: "host over HTTP/2.0 3.1 GiB, ...".
func servedByTier(m map[string]float64) string {
	sums := map[string]float64{}
	for k, v := range m {
		if !strings.HasPrefix(k, "kvsp_holder_bytes_served_total{") {
			continue
		}
		label := func(name string) string {
			_, rest, ok := strings.Cut(k, name+`="`)
			if !ok {
				return "?"
			}
			val, _, _ := strings.Cut(rest, `"`)
			return val
		}
		sums[label("tier")+" over "+label("proto")] += v
	}
	var parts []string
	for k, v := range sums {
		if v > 0 {
			parts = append(parts, fmt.Sprintf("%s %s", k, sizeName(int(v)&^(1<<10-1))))
		}
	}
	slices.Sort(parts)
	if len(parts) == 0 {
		return "nothing"
	}
	return strings.Join(parts, ", ")
}

func writeDemoTable(w io.Writer, dc *demoConfig, r *demoReport) {
	fmt.Fprintf(w, "\nkvsp demo: %d requests at %gx (%d CPUs); %d instances on the %s engine, %d holders; model %s, %d KiB per %d-token block\n\n",
		r.Requests, r.Speed, runtime.GOMAXPROCS(0), r.Instances, r.Engine, r.Holders, r.Model, r.BlockOctets>>10, r.BlockTokens)
	fmt.Fprintf(w, "  %-6s %-28s %-10s %-26s %-8s %-8s %s\n", "mode", "TTFT p50 / p90 / p99", "hit ratio", "KV fetched / stored", "CPU-s", "wall", "prefill tokens/s: engine / wall")
	for _, mode := range dc.modes {
		m := r.Modes[mode]
		fmt.Fprintf(w, "  %-6s %-28s %-10s %-26s %-8s %-8s %.0f / %.0f\n", mode, fmt.Sprintf("%.0f / %.0f / %.0f ms", m.TTFT.P50, m.TTFT.P90, m.TTFT.P99),
			fmt.Sprintf("%.3f", m.HitRatio), sizeName(int(m.FetchedOctets)&^(1<<10-1))+" / "+sizeName(int(m.StoredOctets)&^(1<<10-1)), fmt.Sprintf("%.0f", m.CPUSeconds),
			fmt.Sprintf("%.0f s", m.WallSeconds), m.PrefillRate, m.PrefillThroughput)
	}
	if k, n := r.Modes["kvsp"], r.Modes["none"]; k != nil && n != nil {
		verdict := "yes"
		if k.TTFT.P50 > n.TTFT.P50 || k.TTFT.P90 > n.TTFT.P90 {
			verdict = "NO"
		}
		fmt.Fprintf(w, "  kvsp's TTFT p50 and p90 no worse than no cache's: %s\n", verdict)
	}
	if r.Modes["kvsp"] == nil {
		fmt.Fprintln(w)
		return
	}
	fmt.Fprintf(w, "\n  the kvsp mode:\n")
	writeReplayRows(w, &r.replaySummary)
	row := func(k, v string) { fmt.Fprintf(w, "  %-34s %s\n", k, v) }
	row("one shared LRU, MODELLED", fmt.Sprintf("%.3f (%s of host and local-storage in all, no transfer delay)", r.LRURatio, sizeName(int(int64(r.Holders)*(r.HostOctets+r.DiskOctets)))))
	row("tokens fetched from holders", fmt.Sprintf("%d (%s over %s, verified)", r.Fetched, sizeName(int(r.Counters["kvsp_instance_fetched_bytes_total"])&^(1<<10-1)), r.Transport))
	row("holders: served / stored", fmt.Sprintf("%s in %.0f GETs / %.0f blocks", sizeName(int(r.Counters["kvsp_holder_bytes_served_total"])&^(1<<10-1)), r.Counters["kvsp_holder_gets_total"], r.Counters["kvsp_holder_puts_total"]))
	row("served by tier and protocol", servedByTier(r.Counters))
	row("evictions / demotions", fmt.Sprintf("%.0f / %.0f", r.Counters["kvsp_holder_evictions_total"], r.Counters["kvsp_holder_demotions_total"]))
	row("lease rejections", fmt.Sprintf("%.0f", r.Counters["kvsp_holder_lease_rejections_total"]))
	row("digest failures (holders, instances)", fmt.Sprintf("%.0f, %.0f", r.Counters["kvsp_holder_digest_failures_total"], r.Counters["kvsp_instance_digest_failures_total"]))
	row("migrations", fmt.Sprintf("%.0f", r.Counters["kvsp_pc_migrations_total"]))
	row("dropped or skipped, by stage", dropsLine(r.Drops))
	row("CPU (every role and the front end)", fmt.Sprintf("%.0f CPU-s in %.0f s: %.0f%% of %d CPUs", r.CPUSeconds, r.WallSeconds, 100*r.CPUUtilization, runtime.GOMAXPROCS(0)))
	if len(r.Resources) > 0 {
		fmt.Fprintf(w, "\n  resources, measured over the replay (utilisation; for queues and quotas, the share turned away):\n")
		for _, x := range r.Resources {
			fmt.Fprintf(w, "    %-28s %5.1f%%  %s\n", x.Name, 100*x.Utilisation, x.What)
		}
		sat := "none (nothing at 90% busy, no queue or quota turning away 10%)"
		if r.Saturated != "" {
			sat = r.Saturated
		}
		fmt.Fprintf(w, "  saturated: %s\n", sat)
	}
	fmt.Fprintf(w, "\n  Measured: every figure but the row marked MODELLED, in each mode on a system started for it, the\n  same requests in each. ")
	if dc.engine == "llamacpp" {
		fmt.Fprintf(w, "The instances run llama.cpp (%s) on %s, a generated model of random\n  weights (%d layers, %d wide, %d KV heads of %d), %d thread(s) each on these %d CPUs: prefill and decode\n  are that model's real computation, the KV moved is what llama.cpp produced; prefill tokens/s is the\n  engines' own timing of their prefill steps, and over the wall time. Every trace block is %d tokens.\n\n",
			llamacpp.Release, dc.model(), demoLlama.Layers, demoLlama.Embd, demoLlama.KVHeads, demoLlama.HeadDim(), dc.threads, runtime.NumCPU(), dc.blockTokens)
		return
	}
	fmt.Fprintf(w, "The instances run the simulated engine: its prefill is a sleep of the tokens\n  it computes over %g tokens/s (and its decode %g tokens/s shared by its batch), so TTFT is that\n  engine's, not a real model's; the transfers, verification, placement and queueing are real.\n\n", dc.prefillRate, dc.decodeRate)
}

package llamacpp

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hybridgroup/yzma/pkg/llama"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine"
)

// Config configures an engine. Zero values take the defaults, which suit
// two cores.
type Config struct {
	// Model is the GGUF file; Name the model's name when its metadata has
	// no general.name.
	Model, Name string
	// Library is the directory of the llama.cpp libraries
	// (DefaultLibraryDir when empty).
	Library string
	// ContextTokens bounds one session: prompt and output tokens
	// (default 4096).
	ContextTokens int
	// BatchSize is the number of sessions that decode together, one
	// sequence each, in one llama_decode per step (default 4).
	BatchSize int
	// PrefillChunk is the most prompt tokens one step prefills, between
	// decode steps (default 256).
	PrefillChunk int
	// Threads is llama.cpp's thread count (default: the CPUs).
	Threads int
	// KVCapacity is the number of blocks kept in host memory (default
	// 256), least recently used out, pinned ones never.
	KVCapacity int
	// FlashAttention selects llama.cpp's flash attention, which also
	// decides its V layout: rows when on, transposed when off.
	FlashAttention bool
	// BlockTokens is the descriptor's block_tokens (default 16).
	BlockTokens int
	// NoPrefixCache: no resident block is injected at the start of a
	// session, every prompt token is evaluated (an engine run without
	// prefix caching, kvsp demo's no-cache mode). Blocks are still kept
	// and offered, as the engine computes them.
	NoPrefixCache bool
}

func (c *Config) fill() {
	if c.Library == "" {
		c.Library = DefaultLibraryDir()
	}
	if c.ContextTokens == 0 {
		c.ContextTokens = 4096
	}
	if c.BatchSize == 0 {
		c.BatchSize = 4
	}
	if c.PrefillChunk == 0 {
		c.PrefillChunk = 256
	}
	if c.Threads == 0 {
		c.Threads = runtime.NumCPU()
	}
	if c.KVCapacity == 0 {
		c.KVCapacity = 256
	}
	if c.BlockTokens == 0 {
		c.BlockTokens = 16
	}
}

func (c *Config) validate() error {
	switch {
	case c.Model == "":
		return errors.New("llamacpp: model: a GGUF file is required")
	case c.ContextTokens < 0 || c.ContextTokens > 1<<20:
		return errors.New("llamacpp: context_tokens: 1..1048576")
	case c.BatchSize < 0 || c.BatchSize > 64:
		return errors.New("llamacpp: batch_size: 1..64")
	case c.PrefillChunk < 0 || c.PrefillChunk > 8192:
		return errors.New("llamacpp: prefill_chunk: 1..8192")
	case c.Threads < 0 || c.Threads > 512:
		return errors.New("llamacpp: threads: 1..512")
	case c.KVCapacity < 0:
		return errors.New("llamacpp: kv_capacity: must be positive")
	case c.BlockTokens < 0 || c.BlockTokens > 4096:
		return errors.New("llamacpp: block_tokens: 1..4096")
	}
	return nil
}

// contextParams are the llama.cpp context's: batch_size sequences and a
// scratch one sharing ContextTokens cells each, in one stream.
func (c *Config) contextParams() llama.ContextParams {
	cp := llama.ContextDefaultParams()
	cp.NCtx = uint32(c.ContextTokens * c.BatchSize)
	cp.NBatch = uint32(max(c.PrefillChunk+c.BatchSize, 64))
	cp.NUbatch = cp.NBatch
	cp.NSeqMax = uint32(c.BatchSize + 1)
	cp.NThreads, cp.NThreadsBatch = int32(c.Threads), int32(c.Threads)
	cp.KVUnified = 1 // one stream: sequences share cells (the scratch read-back needs it)
	cp.TypeK, cp.TypeV = llama.GGMLType(ggmlF16), llama.GGMLType(ggmlF16)
	cp.FlashAttentionType = llama.FlashAttentionTypeDisabled
	if c.FlashAttention {
		cp.FlashAttentionType = llama.FlashAttentionTypeEnabled
	}
	cp.NoPerf = 0
	return cp
}

// Engine is llama.cpp behind engine.Engine.
type Engine struct {
	cfg    Config
	desc   kvsp.Descriptor
	g      container.Geometry
	sec    int // octets of one K or V section
	vocab  int
	eog    []bool // eog[t]: token t ends a generation (llama_vocab_is_eog)
	nCtx   int
	model  llama.Model
	lctx   llama.Context
	mem    llama.Memory
	lay    layout
	blocks *engine.Blocks[[]byte]

	submit chan *seq
	calls  chan func(*loopState) // run on the loop (benchmarks)
	stop   chan struct{}
	done   chan struct{}

	mu      sync.Mutex
	running uint64
	queued  uint64
	// reserved is the context's cells the running sequences hold (each
	// its prompt and max_tokens): Stats' KVUtilization.
	reserved int
	prefill  rate
	decode   rate
	// prefilled and prefillTime are the prompt tokens evaluated and the
	// time of the steps that evaluated them (Stats).
	prefilled   uint64
	prefillTime time.Duration
	closed      bool

	evaluated atomic.Int64 // tokens the loop gave llama_decode
	decodes   atomic.Int64 // llama_decode calls
	perf      atomic.Int64 // tokens evaluated, by llama.cpp's own count
	perfBase  int64        // the probe's

	// onLogits, set by tests before the first Generate, sees the logits
	// each output token is sampled from.
	onLogits func(step int, logits []float32)
	// beforeChunk, set by tests before the first Generate, runs on the
	// loop before each prefill chunk with the session's position.
	beforeChunk func(pos int)
}

// scratch is the sequence id the loop copies a range of cells to before
// it reads them back (it shares the cells, nothing is copied).
func (e *Engine) scratch() llama.SeqId { return llama.SeqId(e.cfg.BatchSize) }

// New loads the library and the model and starts the engine's loop.
func New(cfg Config) (*Engine, error) {
	cfg.fill()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	info, err := Describe(cfg.Model, DescribeOptions{Name: cfg.Name, BlockTokens: cfg.BlockTokens, KVType: "f16"})
	if err != nil {
		return nil, err
	}
	if err := LoadLibrary(cfg.Library); err != nil {
		return nil, err
	}
	et, _ := container.ParseElemType(string(info.Descriptor.KVDType))
	d := info.Descriptor
	e := &Engine{cfg: cfg, desc: d, vocab: info.Vocab,
		g:      container.Geometry{Layers: uint32(d.Layers), BlockTokens: uint32(d.BlockTokens), KVHeads: uint32(d.KVHeads), HeadDim: uint32(d.HeadDim), Elem: et},
		submit: make(chan *seq), calls: make(chan func(*loopState)), stop: make(chan struct{}), done: make(chan struct{})}
	e.sec = int(e.g.RawSectionLen())
	if cfg.ContextTokens > info.ContextLength {
		return nil, fmt.Errorf("llamacpp: context_tokens %d exceeds the model's context length %d", cfg.ContextTokens, info.ContextLength)
	}
	mp := llama.ModelDefaultParams()
	mp.NGpuLayers = 0
	e.model, err = llama.ModelLoadFromFile(cfg.Model, mp)
	if err != nil || e.model == 0 {
		return nil, fmt.Errorf("llamacpp: llama.cpp could not load %s (%v)", cfg.Model, err)
	}
	if n := int(llama.VocabNTokens(llama.ModelGetVocab(e.model))); n != info.Vocab {
		llama.ModelFree(e.model)
		return nil, fmt.Errorf("llamacpp: llama.cpp reads a vocabulary of %d tokens, the metadata says %d", n, info.Vocab)
	}
	e.eog = make([]bool, info.Vocab) // a model without a tokenizer ("no_vocab") has none
	for t, v := 0, llama.ModelGetVocab(e.model); t < info.Vocab; t++ {
		e.eog[t] = llama.VocabIsEOG(v, llama.Token(t))
	}
	cp := cfg.contextParams()
	e.lctx, err = llama.InitFromModel(e.model, cp)
	if err != nil || e.lctx == 0 {
		llama.ModelFree(e.model)
		return nil, fmt.Errorf("llamacpp: llama.cpp could not make a context of %d tokens (%v)", cp.NCtx, err)
	}
	e.nCtx = int(llama.NCtx(e.lctx))
	e.mem, err = llama.GetMemory(e.lctx)
	if err == nil {
		err = e.probe()
	}
	if err != nil {
		e.free()
		return nil, err
	}
	e.blocks = engine.NewBlocks(int(e.g.Layers), cfg.KVCapacity, func(kvsp.BlockKey) ([]byte, error) {
		return make([]byte, 2*e.sec*int(e.g.Layers)), nil
	}, nil)
	go e.loop()
	return e, nil
}

// probe evaluates one token in the scratch sequence and learns the
// context's state layout from it, which must be the one the descriptor
// implies: the layers, and K and V rows of kv_heads × head_dim elements
// of kv_dtype.
func (e *Engine) probe() error {
	// A prefill chunk, then one token alone: the first measurements of
	// the rates the status record reports (before any request, the PC's
	// cost model needs them), and llama.cpp's own counts of evaluated
	// tokens (prompt and single-token evaluations, each shown as at least
	// 1) are past their floor from here on.
	n0 := min(64, e.cfg.PrefillChunk, e.cfg.ContextTokens-1)
	b := llama.BatchInit(int32(n0), 0, 1)
	defer llama.BatchFree(b)
	defer llama.MemorySeqRm(e.mem, e.scratch(), -1, -1)
	for i, n := range []int{n0, 1} {
		b.Clear()
		for j := 0; j < n; j++ {
			b.Add(llama.Token(j%e.vocab), llama.Pos(i*n0+j), []llama.SeqId{e.scratch()}, false)
		}
		t0 := time.Now()
		if rc, err := llama.Decode(e.lctx, b); err != nil || rc != 0 {
			return fmt.Errorf("llamacpp: the probe decode failed (%d, %v)", rc, err)
		}
		llama.Synchronize(e.lctx)
		if i == 0 {
			e.prefill.add(n, time.Since(t0))
		} else {
			e.decode.add(n, time.Since(t0))
		}
	}
	pd := llama.PerfContext(e.lctx)
	e.perfBase = int64(pd.NPEval) + int64(pd.NEval)
	buf := make([]byte, llama.StateSeqGetSize(e.lctx, e.scratch()))
	if n := llama.StateSeqGetData(e.lctx, buf, e.scratch()); int(n) != len(buf) {
		return fmt.Errorf("llamacpp: the probe's state: %d of %d octets", n, len(buf))
	}
	_, l, err := parseState(buf, nil)
	if err != nil {
		return err
	}
	row := e.sec / int(e.g.BlockTokens)
	switch {
	case l.layers != int(e.g.Layers):
		return fmt.Errorf("%w: %d layers in the context, %d in the descriptor", errState, l.layers, e.g.Layers)
	case l.kType != ggmlF16 || l.vType != ggmlF16:
		return fmt.Errorf("%w: K of ggml type %d and V of %d, the descriptor says %s", errState, l.kType, l.vType, e.desc.KVDType)
	case l.kRow != row || l.vRow != row:
		return fmt.Errorf("%w: K rows of %d octets and V rows of %d, the descriptor's are %d", errState, l.kRow, l.vRow, row)
	case l.vTrans == e.cfg.FlashAttention:
		return fmt.Errorf("%w: V transposed %v with flash attention %v", errState, l.vTrans, e.cfg.FlashAttention)
	case l.vTrans && l.vElem != 2:
		return fmt.Errorf("%w: transposed V of %d-octet elements", errState, l.vElem)
	}
	e.lay = l
	return nil
}

func (e *Engine) free() {
	if e.lctx != 0 {
		llama.Free(e.lctx)
	}
	if e.model != 0 {
		llama.ModelFree(e.model)
	}
}

// Close stops the loop (sessions running end with an error) and frees
// the context and the model.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	close(e.stop)
	<-e.done
	e.free()
	return nil
}

// Descriptor implements engine.Engine.
func (e *Engine) Descriptor() kvsp.Descriptor { return e.desc }

// Geometry implements engine.Engine.
func (e *Engine) Geometry() container.Geometry { return e.g }

// KV implements engine.Engine.
func (e *Engine) KV() engine.KV { return (*kv)(e) }

// Deterministic implements engine.Engine: llama.cpp is not batch
// invariant (the same prefix computed in one batch or in several differs
// in the last bits), so a greedy session's tokens are not a function of
// its checkpoint alone.
func (e *Engine) Deterministic() bool { return false }

// Vocab is the model's vocabulary size.
func (e *Engine) Vocab() int { return e.vocab }

// Limits implements engine.Bounded: the vocabulary, and the context each
// session has (Check refuses what passes them).
func (e *Engine) Limits() engine.Limits {
	ctx := uint64(e.cfg.ContextTokens)
	return engine.Limits{VocabSize: uint64(e.vocab), ContextTokens: ctx, MaxOutputTokens: min(ctx-1, kvsp.MaxGenerateTokens)}
}

// Evaluated is the number of tokens llama_decode has evaluated, by
// llama.cpp's own count (llama_perf_context: prompt and single-token
// evaluations), the probe's not counted.
func (e *Engine) Evaluated() int64 { return e.perf.Load() }

// Decodes is the number of llama_decode calls since the start.
func (e *Engine) Decodes() int64 { return e.decodes.Load() }

// Stats implements engine.Engine: the rates are moving averages of the
// engine's own steps. KVUtilization is the share of the context's KV
// cells the running sequences hold (as vLLM counts its blocks in use): a
// sequence's cells are freed when it ends, however it ends; the host
// copies of complete blocks (the prefix cache, evicted as needed) are not
// counted.
func (e *Engine) Stats() engine.Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return engine.Stats{Running: e.running, Queued: e.queued, BatchSize: uint64(e.cfg.BatchSize),
		KVUtilization: float64(e.reserved) / float64(e.nCtx), KVBlocks: e.blocks.Capacity(),
		PrefillTokensPerS: e.prefill.perS, DecodeTokensPerS: e.decode.perS, Prefilled: e.prefilled, PrefillTime: e.prefillTime}
}

// rate is an exponentially weighted moving average of tokens per second.
type rate struct{ perS float64 }

func (r *rate) add(tokens int, d time.Duration) {
	if tokens == 0 || d <= 0 {
		return
	}
	x := float64(tokens) / d.Seconds()
	if r.perS == 0 {
		r.perS = x
		return
	}
	r.perS += 0.2 * (x - r.perS)
}

// Check implements engine.Engine: what llama_decode would abort the
// process on is refused here, naming the member.
func (e *Engine) Check(req *engine.Request) error {
	for i, t := range req.Tokens {
		if int(t) >= e.vocab {
			return kvsp.NewProblem(kvsp.ErrInvalid, fmt.Sprintf("tokens[%d]: %d is not in the model's vocabulary of %d", i, t, e.vocab)).With("member", fmt.Sprintf("tokens[%d]", i))
		}
	}
	for i, t := range req.Tail {
		if int(t) >= e.vocab {
			return kvsp.NewProblem(kvsp.ErrInvalid, fmt.Sprintf("prompt_tail[%d]: %d is not in the model's vocabulary of %d", i, t, e.vocab))
		}
	}
	for i, t := range req.Generated {
		if int(t) >= e.vocab {
			return kvsp.NewProblem(kvsp.ErrInvalid, fmt.Sprintf("generated[%d]: %d is not in the model's vocabulary of %d", i, t, e.vocab))
		}
	}
	n := promptLen(req, int(e.g.BlockTokens))
	if n == 0 {
		return kvsp.NewProblem(kvsp.ErrInvalid, "tokens: the prompt is empty")
	}
	if n > e.cfg.ContextTokens {
		return kvsp.NewProblem(kvsp.ErrInvalid, fmt.Sprintf("tokens: %d tokens exceed the engine's context of %d", n, e.cfg.ContextTokens))
	}
	if n+req.MaxTokens > e.cfg.ContextTokens {
		return kvsp.NewProblem(kvsp.ErrInvalid, fmt.Sprintf("max_tokens: a prompt of %d tokens leaves room for %d in the engine's context of %d", n, e.cfg.ContextTokens-n, e.cfg.ContextTokens))
	}
	return nil
}

func promptLen(req *engine.Request, bt int) int {
	if req.Tokens != nil {
		return len(req.Tokens)
	}
	return len(req.Keys)*bt + len(req.Tail)
}

// event is what the loop tells a session's Generate.
type event struct {
	tok     *engine.Token
	prefill *engine.PrefillStats
	block   *kvsp.BlockKey
	err     error
	done    bool
	finish  kvsp.FinishReason // with done
}

// seq is one session in the loop.
type seq struct {
	req   engine.Request
	id    llama.SeqId
	cells int
	// toks are the session's tokens from position 0: the prompt (zeros
	// where a resumed prompt's blocks are loaded and its tokens unknown),
	// the generated ones, and each token sampled.
	toks    []uint32
	known   int // toks[:known] may be zeros
	keys    []kvsp.BlockKey
	pos     int   // the next position to evaluate
	cached  int   // blocks injected
	joined  []int // blocks injected after the start (join)
	start   int   // tokens not evaluated: the injected ones
	step    int   // the next output index
	prompt  bool
	eog     bool // the model ended its answer: no more output
	pending []pendingBlock
	out     chan event
	cancel  atomic.Bool
	ended   bool
}

// pendingBlock is a block of generated tokens whose last token is not
// evaluated yet.
type pendingBlock struct {
	key kvsp.BlockKey
	end int // the position after its last token
}

// Generate implements engine.Engine.
func (e *Engine) Generate(ctx context.Context, req engine.Request, emit func(engine.Token) error) (kvsp.FinishReason, error) {
	if err := e.Check(&req); err != nil {
		return "", err
	}
	bt := int(e.g.BlockTokens)
	if req.Tokens != nil && len(req.Keys) != len(req.Tokens)/bt {
		return "", fmt.Errorf("llamacpp: %d block keys for %d complete blocks", len(req.Keys), len(req.Tokens)/bt)
	}
	s := &seq{req: req, keys: append(append([]kvsp.BlockKey{}, req.Keys...), req.GeneratedKeys...), step: len(req.Generated)}
	if req.Tokens != nil {
		s.toks = append(s.toks, req.Tokens...)
	} else {
		s.toks = append(make([]uint32, len(req.Keys)*bt), req.Tail...)
		s.known = len(req.Keys) * bt
	}
	s.toks = append(s.toks, req.Generated...)
	s.cells = promptLen(&req, bt) + max(req.MaxTokens, len(req.Generated))
	s.out = make(chan event, max(req.MaxTokens-len(req.Generated), 0)+len(s.keys)+4)
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return "", fmt.Errorf("%w: the engine is closed", kvsp.ErrUnavailable)
	}
	e.queued++
	e.mu.Unlock()
	select {
	case e.submit <- s:
	case <-ctx.Done():
		e.mu.Lock()
		e.queued--
		e.mu.Unlock()
		return "", ctx.Err()
	case <-e.done:
		return "", fmt.Errorf("%w: the engine is closed", kvsp.ErrUnavailable)
	}
	defer s.cancel.Store(true)
	for {
		select {
		case ev := <-s.out:
			switch {
			case ev.err != nil:
				return "", ev.err
			case ev.done:
				return ev.finish, nil
			case ev.prefill != nil:
				if req.OnPrefill != nil {
					req.OnPrefill(*ev.prefill)
				}
			case ev.block != nil:
				if req.OnBlock != nil {
					req.OnBlock(*ev.block)
				}
			case ev.tok != nil:
				if err := emit(*ev.tok); err != nil {
					return "", err
				}
			}
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
}

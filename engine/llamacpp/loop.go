package llamacpp

import (
	"errors"
	"fmt"
	"time"

	"github.com/hybridgroup/yzma/pkg/llama"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine"
)

// loop owns the llama.cpp context: one goroutine admits sessions into
// free sequences (injecting their resident blocks), and then, step by
// step, puts every running session's next token and a chunk of one
// session's prefill into one batch, decodes it, samples, and reads back
// the blocks that completed. A session's events go out on its own
// buffered channel, so a slow client never stalls the batch.
func (e *Engine) loop() {
	defer close(e.done)
	l := &loopState{e: e, free: make([]llama.SeqId, 0, e.cfg.BatchSize)}
	for i := e.cfg.BatchSize - 1; i >= 0; i-- {
		l.free = append(l.free, llama.SeqId(i))
	}
	l.batch = llama.BatchInit(int32(llama.NBatch(e.lctx)), 0, 1)
	defer llama.BatchFree(l.batch)
	defer func() {
		for _, s := range append(l.running, l.waiting...) {
			if !s.ended {
				s.out <- event{err: fmt.Errorf("%w: the engine is closed", kvsp.ErrUnavailable)}
			}
		}
	}()
	for {
		l.reap()
		l.admit()
		// Idle, wait for work; running, take what came and step.
		var idle <-chan time.Time
		if len(l.running) > 0 {
			idle = closedTime
		}
		select {
		case s := <-e.submit:
			l.enqueue(s)
		case f := <-e.calls:
			f(l)
		case <-e.stop:
			return
		case <-idle:
			l.step()
		}
	}
}

// closedTime is always ready: the loop's case for "step now".
var closedTime = func() <-chan time.Time { c := make(chan time.Time); close(c); return c }()

type loopState struct {
	e       *Engine
	free    []llama.SeqId
	cells   int
	running []*seq
	waiting []*seq
	batch   llama.Batch
	top     topP
	state   []byte
}

func (l *loopState) enqueue(s *seq) { l.waiting = append(l.waiting, s) }

// reap ends sessions whose Generate returned (cancelled, or its emit
// failed) and those that are done.
func (l *loopState) reap() {
	keep := l.running[:0]
	for _, s := range l.running {
		if s.ended {
			continue // released when it ended
		}
		if s.cancel.Load() {
			l.release(s)
			continue
		}
		keep = append(keep, s)
	}
	clear(l.running[len(keep):])
	l.running = keep
	w := l.waiting[:0]
	for _, s := range l.waiting {
		if s.cancel.Load() {
			l.e.mu.Lock()
			l.e.queued--
			l.e.mu.Unlock()
			continue
		}
		w = append(w, s)
	}
	clear(l.waiting[len(w):])
	l.waiting = w
}

func (l *loopState) release(s *seq) {
	llama.MemorySeqRm(l.e.mem, s.id, -1, -1)
	l.free = append(l.free, s.id)
	l.cells -= s.cells
	l.e.mu.Lock()
	l.e.running--
	l.e.reserved = l.cells
	l.e.mu.Unlock()
}

// admit starts waiting sessions in order while a sequence is free and
// their context fits in the cells not reserved.
func (l *loopState) admit() {
	for len(l.waiting) > 0 && len(l.free) > 0 && l.cells+l.waiting[0].cells <= l.e.nCtx {
		s := l.waiting[0]
		l.waiting = l.waiting[1:]
		s.id = l.free[len(l.free)-1]
		l.free = l.free[:len(l.free)-1]
		l.cells += s.cells
		l.e.mu.Lock()
		l.e.queued--
		l.e.running++
		l.e.reserved = l.cells
		l.e.mu.Unlock()
		l.running = append(l.running, s)
		if err := l.start(s); err != nil {
			l.end(s, event{err: err})
		}
	}
}

// onLoop runs f on the loop, between steps, and waits for it.
func (e *Engine) onLoop(f func(*loopState)) error {
	done := make(chan struct{})
	select {
	case e.calls <- func(l *loopState) { f(l); close(done) }:
		<-done
		return nil
	case <-e.done:
		return fmt.Errorf("%w: the engine is closed", kvsp.ErrUnavailable)
	}
}

// start injects the session's leading resident blocks into its sequence.
// A resumed prompt whose tokens are not known must be resident whole.
func (l *loopState) start(s *seq) error {
	e, bt := l.e, int(l.e.g.BlockTokens)
	n := 0
	for !e.cfg.NoPrefixCache && n < len(s.keys) && (n+1)*bt <= len(s.toks) && e.blocks.Pin(s.keys[n]) {
		n++
	}
	defer func() {
		for _, k := range s.keys[:n] {
			e.blocks.Unpin(k)
		}
	}()
	if n*bt < s.known {
		return fmt.Errorf("%w: block %d of a resumed prompt (its tokens are not known)", engine.ErrNotResident, n)
	}
	s.prompt = true
	if n == 0 {
		return nil
	}
	defer func() { s.start = s.pos }()
	if err := l.inject(s.id, 0, s.keys[:n]); err != nil {
		return err
	}
	s.cached, s.pos = n, n*bt
	if s.pos == len(s.toks) { // the last token's logits are needed: evaluate it again
		s.pos--
		llama.MemorySeqRm(e.mem, s.id, llama.Pos(s.pos), -1)
	}
	return nil
}

// inject writes the resident blocks keys (pinned by the caller) into
// sequence id as its cells at positions p0.., converted to llama.cpp's
// state in one buffer, and has llama.cpp take it. Setting a sequence's
// state replaces all its cells, so blocks after the first (p0 > 0: a
// late block joining a prefill under way) go into the scratch sequence,
// whose cells the session's sequence then shares (MemorySeqCp, as
// readBackKeys does the other way).
func (l *loopState) inject(id llama.SeqId, p0 int, keys []kvsp.BlockKey) error {
	e, bt, sec := l.e, int(l.e.g.BlockTokens), l.e.sec
	into := id
	if p0 > 0 {
		into = e.scratch()
		defer llama.MemorySeqRm(e.mem, into, -1, -1)
	}
	w := newStateWriter(&e.lay, p0, len(keys)*bt, bt, l.state)
	l.state = w.b
	for b, key := range keys {
		for layer := 0; layer < int(e.g.Layers); layer++ {
			err := e.blocks.Read(key, uint32(layer), func(p []byte) error {
				o := 2 * sec * layer
				w.put(b, layer, p[o:o+sec], p[o+sec:o+2*sec])
				return nil
			})
			if err != nil {
				return err
			}
		}
	}
	if got := llama.StateSeqSetData(e.lctx, w.b, into); int(got) != len(w.b) {
		llama.MemorySeqRm(e.mem, into, -1, -1)
		return fmt.Errorf("llamacpp: llama.cpp took %d of %d octets of the injected state", got, len(w.b))
	}
	if into != id {
		return llama.MemorySeqCp(e.mem, into, id, llama.Pos(p0), llama.Pos(p0+len(keys)*bt))
	}
	return nil
}

// join injects, before a session's next prefill chunk, the blocks from
// its position on that became resident since it started (a prefetch that
// landed after the request started, issue 47), so the prefill skips them:
// a late block still serves the tokens not computed yet. The block that
// holds the prompt's last token is left to compute (its logits are
// needed). Each block's KV depends only on the tokens up to its end,
// which its key names: one after a computed block is as good as one in
// the leading run.
func (l *loopState) join(s *seq) error {
	e, bt := l.e, int(l.e.g.BlockTokens)
	if e.cfg.NoPrefixCache || s.pos%bt != 0 {
		return nil
	}
	b0 := s.pos / bt
	n := 0
	for b0+n < len(s.keys) && (b0+n+1)*bt < len(s.toks) && e.blocks.Pin(s.keys[b0+n]) {
		n++
	}
	if n == 0 {
		return nil
	}
	defer func() {
		for _, k := range s.keys[b0 : b0+n] {
			e.blocks.Unpin(k)
		}
	}()
	if err := l.inject(s.id, s.pos, s.keys[b0:b0+n]); err != nil {
		return err
	}
	for i := range n {
		s.joined = append(s.joined, b0+i)
	}
	s.pos += n * bt
	return nil
}

// step builds one batch, decodes it and handles what came out.
func (l *loopState) step() {
	e := l.e
	b := &l.batch
	b.Clear()
	type part struct {
		s      *seq
		n      int   // tokens of s in the batch
		logits int32 // batch index of its logits, -1 for none
	}
	var parts []part
	decodeTokens, prefillTokens := 0, 0
	ids := []llama.SeqId{0}
	// Every decoding session's one token first.
	for _, s := range l.running {
		if s.ended || s.prompt || s.pos >= len(s.toks) {
			continue
		}
		ids[0] = s.id
		wantLogits := s.step < s.req.MaxTokens && !s.eog
		b.Add(llama.Token(s.toks[s.pos]), llama.Pos(s.pos), ids, wantLogits)
		p := part{s: s, n: 1, logits: -1}
		if wantLogits {
			p.logits = b.NTokens - 1
		}
		parts = append(parts, p)
		decodeTokens++
	}
	// Then a chunk of one session's prefill, the first in line.
	budget, bt := e.cfg.PrefillChunk, int(e.g.BlockTokens)
	for _, s := range l.running {
		if s.ended || !s.prompt || budget == 0 {
			continue
		}
		if e.beforeChunk != nil {
			e.beforeChunk(s.pos)
		}
		if err := l.join(s); err != nil {
			l.end(s, event{err: err})
			continue
		}
		n := min(budget, len(s.toks)-s.pos)
		if r := (s.pos + n) % bt; s.pos+n < len(s.toks) && n > r {
			n -= r // the chunk ends on a block's end, where a late block can join
		}
		ids[0] = s.id
		for i := 0; i < n; i++ {
			last := s.pos+i == len(s.toks)-1
			b.Add(llama.Token(s.toks[s.pos+i]), llama.Pos(s.pos+i), ids, last)
		}
		p := part{s: s, n: n, logits: -1}
		if s.pos+n == len(s.toks) {
			p.logits = b.NTokens - 1
		}
		parts = append(parts, p)
		budget -= n
		prefillTokens += n
		break
	}
	if len(parts) == 0 {
		for _, s := range l.running { // nothing left to evaluate
			l.finish(s)
		}
		return
	}
	t0 := time.Now()
	rc, err := llama.Decode(e.lctx, *b)
	d := time.Since(t0)
	if err == nil && rc != 0 {
		err = fmt.Errorf("llamacpp: llama_decode returned %d", rc)
	}
	if err != nil {
		for _, p := range parts {
			l.end(p.s, event{err: err})
		}
		return
	}
	llama.Synchronize(e.lctx)
	pd := llama.PerfContext(e.lctx)
	e.perf.Store(int64(pd.NPEval) + int64(pd.NEval) - e.perfBase)
	e.evaluated.Add(int64(b.NTokens))
	e.decodes.Add(1)
	e.mu.Lock()
	if prefillTokens > 0 {
		e.prefill.add(prefillTokens, d)
		e.prefilled += uint64(prefillTokens)
		e.prefillTime += d // a step with decode tokens too counts whole
	} else {
		e.decode.add(decodeTokens, d)
	}
	e.mu.Unlock()
	for _, p := range parts {
		s := p.s
		s.pos += p.n
		if s.prompt && s.pos == len(s.toks) {
			l.prefilled(s)
		}
		l.flushBlocks(s)
		if p.logits >= 0 && !s.ended {
			logits, err := llama.GetLogitsIth(e.lctx, p.logits, e.vocab)
			if err != nil {
				l.end(s, event{err: err})
				continue
			}
			if e.onLogits != nil {
				e.onLogits(s.step, logits)
			}
			id := sample(logits, s.req.Sampler, s.step, &l.top)
			if e.eog[id] { // the answer ends here: the token is not output, nor evaluated
				s.eog = true
				l.finish(s)
				continue
			}
			tok := engine.Token{Index: s.step, ID: id}
			s.step++
			s.toks = append(s.toks, id)
			if c := s.req.Chain; c != nil && c.Push(id) {
				key, _ := c.Last()
				s.pending = append(s.pending, pendingBlock{key: key, end: len(s.toks)})
			}
			s.out <- event{tok: &tok}
		}
		l.finish(s)
	}
}

// prefilled reads back the blocks the prompt's prefill computed (and
// those of a resumed session's generated tokens), keeps them, and tells
// the session.
func (l *loopState) prefilled(s *seq) {
	bt := int(l.e.g.BlockTokens)
	s.prompt = false
	complete := min(len(s.toks)/bt, len(s.keys))
	// The computed blocks: runs between those joined.
	joined := s.joined
	for b := s.cached; b < complete; {
		if len(joined) > 0 && joined[0] == b {
			joined, b = joined[1:], b+1
			continue
		}
		end := complete
		if len(joined) > 0 {
			end = joined[0]
		}
		if err := l.readBack(s, b, end); err != nil {
			l.end(s, event{err: err})
			return
		}
		b = end
	}
	cached := s.start + len(s.joined)*bt
	st := engine.PrefillStats{CachedTokens: cached, ComputedTokens: len(s.toks) - cached, Joined: s.joined}
	s.out <- event{prefill: &st}
}

// flushBlocks reads back the generated blocks whose tokens are all
// evaluated now.
func (l *loopState) flushBlocks(s *seq) {
	for len(s.pending) > 0 && s.pending[0].end <= s.pos && !s.ended {
		pb := s.pending[0]
		s.pending = s.pending[1:]
		bt := int(l.e.g.BlockTokens)
		if err := l.readBackKeys(s, pb.end-bt, []kvsp.BlockKey{pb.key}); err != nil {
			l.end(s, event{err: err})
			return
		}
		key := pb.key
		s.out <- event{block: &key}
	}
}

// finish ends a session that has all its output and whose last block is
// read back.
func (l *loopState) finish(s *seq) {
	if s.ended || s.prompt || (s.step < s.req.MaxTokens && !s.eog) || len(s.pending) > 0 {
		return
	}
	finish := kvsp.FinishLength
	if s.eog {
		finish = kvsp.FinishStop
	}
	l.end(s, event{done: true, finish: finish})
}

// end releases a session's sequence, then tells its Generate: the status
// record no longer counts it by the time Generate returns.
func (l *loopState) end(s *seq, ev event) {
	if !s.ended {
		l.release(s)
		s.ended = true
	}
	s.out <- ev
}

func (l *loopState) readBack(s *seq, b0, b1 int) error {
	bt := int(l.e.g.BlockTokens)
	return l.readBackKeys(s, b0*bt, s.keys[b0:b1])
}

// readBackKeys reads the cells of blocks starting at position p0 out of
// the session's sequence (through the scratch sequence, which shares the
// cells), converts them to kvsp-layout-1 sections and keeps them under
// keys. A full KV memory (every block pinned) is not the session's
// failure: the blocks are not kept.
func (l *loopState) readBackKeys(s *seq, p0 int, keys []kvsp.BlockKey) error {
	e, bt := l.e, int(l.e.g.BlockTokens)
	p1 := p0 + len(keys)*bt
	sc := e.scratch()
	if err := llama.MemorySeqCp(e.mem, s.id, sc, llama.Pos(p0), llama.Pos(p1)); err != nil {
		return err
	}
	defer llama.MemorySeqRm(e.mem, sc, -1, -1)
	n := int(llama.StateSeqGetSize(e.lctx, sc))
	if cap(l.state) < n {
		l.state = make([]byte, n)
	}
	buf := l.state[:n]
	if got := int(llama.StateSeqGetData(e.lctx, buf, sc)); got != n {
		return fmt.Errorf("llamacpp: read back %d of %d octets of state", got, n)
	}
	st, _, err := parseState(buf, &e.lay)
	if err != nil {
		return err
	}
	sec := e.sec
	for i, key := range keys {
		idx, err := st.cellsByPos(p0+i*bt, bt)
		if err != nil {
			return err
		}
		for layer := 0; layer < int(e.g.Layers); layer++ {
			err := e.blocks.Write(key, uint32(layer), func(p []byte) error {
				o := 2 * sec * layer
				e.lay.kSection(p[o:o+sec], st, layer, idx)
				e.lay.vSection(p[o+sec:o+2*sec], st, layer, idx)
				return nil
			})
			if errors.Is(err, engine.ErrKVFull) {
				break
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

package llamacpp

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/kvsp/kvsp/engine"
)

// Measured on this machine (2 cores, the default tiny model, 8 prompts of
// 4 blocks and a 21-token suffix, 32 greedy tokens each; the producer
// prefilling in chunks of 16, the consumer and the recomputation in one
// batch): the first output token's logits after injection equal a full
// recomputation's bit for bit without flash attention, and differ by at
// most 0.00084 with it (its kernels depend on the batch's shape); greedy
// outputs agreed on 256 of 256 tokens in both. The bounds are about five
// times the difference measured, and a flip in twenty tokens.
const (
	// logitTolerance bounds |injected - recomputed| over the first output
	// token's logits.
	logitTolerance = 0.005
	// minGreedyAgreement is the share of greedy output tokens that must
	// equal a full recomputation's, position by position.
	minGreedyAgreement = 0.95
)

// TestInjectedPrefixMatchesRecompute (issue 20, test 1, in one process):
// a prefix computed by one engine (A, serving the prefix alone), moved as
// blocks and injected into another (B), which prefills only the suffix,
// gives first-token logits within logitTolerance of a cold engine's full
// computation of prefix and suffix, and greedy outputs that agree on at
// least minGreedyAgreement of their tokens. Recompute is not bit-identical
// in llama.cpp (batch shapes change the last bits), so the bounds come
// from measurement; every flip is logged.
func TestInjectedPrefixMatchesRecompute(t *testing.T) {
	for _, fa := range []bool{false, true} {
		t.Run(fmt.Sprintf("flash_attention=%v", fa), func(t *testing.T) { injectedPrefix(t, fa) })
	}
}

func injectedPrefix(t *testing.T, fa bool) {
	// A prefills in chunks of 16, B and C in one: the batch shapes differ.
	cfg := Config{BatchSize: 1, FlashAttention: fa}
	a, b, c := newEngine(t, Config{BatchSize: 1, PrefillChunk: 16, FlashAttention: fa}), newEngine(t, cfg), newEngine(t, cfg)
	bt := int(a.Geometry().BlockTokens)
	const prompts, out = 8, 32
	var worst float64
	agree, total := 0, 0
	for k := 0; k < prompts; k++ {
		prefix := tokensOf(100+k, 4*bt, a.Vocab())
		full := append(slices.Clone(prefix), tokensOf(200+k, 21, a.Vocab())...)
		pre := request(t, a, prefix, 1)
		collect(t, a, pre) // A computes the prefix alone and keeps its blocks
		for _, key := range pre.Keys {
			moveBlock(t, a, b, key)
		}
		var lb, lc []float32
		b.onLogits = func(step int, l []float32) {
			if step == 0 {
				lb = slices.Clone(l)
			}
		}
		c.onLogits = func(step int, l []float32) {
			if step == 0 {
				lc = slices.Clone(l)
			}
		}
		before := b.Evaluated()
		ob := collect(t, b, request(t, b, full, out))
		if n := b.Evaluated() - before; n != int64(21+out-1) {
			t.Fatalf("prompt %d: B evaluated %d tokens, want the suffix's 21 and %d decoded (llama.cpp's count)", k, n, out-1)
		}
		creq := request(t, c, full, out)
		for _, key := range creq.Keys { // C recomputes everything
			c.KV().Drop(key)
		}
		oc := collect(t, c, creq)
		d := 0.0
		for i := range lb {
			d = max(d, math.Abs(float64(lb[i]-lc[i])))
		}
		worst = max(worst, d)
		for i := range ob {
			total++
			if ob[i] == oc[i] {
				agree++
			} else {
				t.Logf("prompt %d: output %d flips: %d injected, %d recomputed", k, i, ob[i], oc[i])
			}
		}
		for _, key := range creq.Keys {
			a.KV().Drop(key)
			b.KV().Drop(key)
			c.KV().Drop(key)
		}
	}
	share := float64(agree) / float64(total)
	t.Logf("first-token logits: max |injected - recomputed| = %.5f over %d prompts; greedy agreement %d/%d = %.3f", worst, prompts, agree, total, share)
	if worst > logitTolerance {
		t.Errorf("logits differ by %.5f, more than the tolerance %.3f", worst, logitTolerance)
	}
	if share < minGreedyAgreement {
		t.Errorf("greedy outputs agree on %.3f of tokens, less than %.2f", share, minGreedyAgreement)
	}
}

// TestLateBlocksJoinThePrefill (issue 47: a prefetch that lands after the
// engine started on the prompt still serves the blocks not yet computed).
// B prefills one block per step. Blocks 0 and 1 are resident when the
// request starts; blocks 4, 5 and 6 land (as a late prefetch's would)
// once B's prefill is at block 3.
// Before each chunk B injects what became resident from its position on:
// into the scratch sequence, whose cells its own sequence then shares. B
// evaluates only blocks 2, 3, 7 and the tail, reports 4, 5 and 6 joined,
// reads back (keeps) the blocks it computed, and its first-token logits
// match A's full computation within logitTolerance.
func TestLateBlocksJoinThePrefill(t *testing.T) {
	a := newEngine(t, Config{BatchSize: 1})
	b := newEngine(t, Config{BatchSize: 1, PrefillChunk: int(a.Geometry().BlockTokens)})
	bt := int(a.Geometry().BlockTokens)
	const out = 8
	full := append(tokensOf(300, 8*bt, a.Vocab()), tokensOf(301, 5, a.Vocab())...)
	var la, lb []float32
	a.onLogits = func(step int, l []float32) {
		if step == 0 {
			la = slices.Clone(l)
		}
	}
	b.onLogits = func(step int, l []float32) {
		if step == 0 {
			lb = slices.Clone(l)
		}
	}
	areq := request(t, a, full, out)
	oa := collect(t, a, areq) // A computes everything and keeps the blocks
	for _, key := range areq.Keys[:2] {
		moveBlock(t, a, b, key)
	}
	landed := false
	b.beforeChunk = func(pos int) {
		if pos == 3*bt && !landed {
			landed = true
			for _, key := range areq.Keys[4:7] {
				moveBlock(t, a, b, key)
			}
		}
	}
	breq := request(t, b, full, out)
	var st engine.PrefillStats
	breq.OnPrefill = func(s engine.PrefillStats) { st = s }
	before := b.Evaluated()
	ob := collect(t, b, breq)
	if !landed {
		t.Fatal("the prefill never stood at block 3: the test proves nothing")
	}
	if st.CachedTokens != 5*bt || st.ComputedTokens != 3*bt+5 || !slices.Equal(st.Joined, []int{4, 5, 6}) {
		t.Fatalf("prefill %+v: want blocks 0, 1 cached at the start, 4, 5, 6 joined, blocks 2, 3, 7 and the 5-token tail computed", st)
	}
	if n := b.Evaluated() - before; n != int64(3*bt+5+out-1) {
		t.Fatalf("B evaluated %d tokens, want %d (three blocks, the tail, %d decoded)", n, 3*bt+5+out-1, out-1)
	}
	for i, key := range breq.Keys {
		if !b.KV().Has(key) {
			t.Errorf("block %d is not resident in B after the prefill", i)
		}
	}
	d := 0.0
	for i := range la {
		d = max(d, math.Abs(float64(la[i]-lb[i])))
	}
	agree := 0
	for i := range oa {
		if oa[i] == ob[i] {
			agree++
		}
	}
	t.Logf("late join: max |joined - recomputed| logit = %.5f; greedy agreement %d/%d", d, agree, out)
	if d > logitTolerance || float64(agree) < minGreedyAgreement*out {
		t.Fatalf("logits differ by %.5f (tolerance %.3f), %d of %d greedy tokens agree", d, logitTolerance, agree, out)
	}
}

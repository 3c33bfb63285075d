package llamacpp

import (
	"container/heap"
	"encoding/binary"
	"math"
	"math/rand/v2"

	"github.com/kvsp/kvsp/engine"
)

// sample chooses output token step from logits. Greedy takes the largest
// logit (the lowest id among equals). Top-p draws from the smallest set
// of the most likely tokens whose probability reaches p, with a uniform
// variate that is a function of (seed, step) alone: a session resumed at
// sampler.step continues the same random stream, whatever instance runs
// it.
func sample(logits []float32, s engine.Sampler, step int, scratch *topP) uint32 {
	best := 0
	for i, x := range logits {
		if x > logits[best] {
			best = i
		}
	}
	if s.Method != engine.TopP {
		return uint32(best)
	}
	return scratch.draw(logits, logits[best], s.P, variate(s.Seed, step))
}

// variate is the uniform [0, 1) number of top-p step step.
func variate(seed uint64, step int) float64 {
	var k [32]byte
	copy(k[:], "kvsp-llamacpp-top-p\x00")
	binary.LittleEndian.PutUint64(k[16:], seed)
	binary.LittleEndian.PutUint64(k[24:], uint64(step))
	return rand.New(rand.NewChaCha8(k)).Float64()
}

// topP is the scratch of a top-p draw: a max-heap of token ids by
// probability, popped until the mass reaches p (most of a vocabulary is
// never sorted).
type topP struct {
	ids []int32
	w   []float64
}

func (h *topP) Len() int { return len(h.ids) }
func (h *topP) Less(i, j int) bool {
	return h.w[h.ids[i]] > h.w[h.ids[j]] || h.w[h.ids[i]] == h.w[h.ids[j]] && h.ids[i] < h.ids[j]
}
func (h *topP) Swap(i, j int) { h.ids[i], h.ids[j] = h.ids[j], h.ids[i] }
func (h *topP) Push(x any)    { h.ids = append(h.ids, x.(int32)) }
func (h *topP) Pop() any {
	x := h.ids[len(h.ids)-1]
	h.ids = h.ids[:len(h.ids)-1]
	return x
}

func (h *topP) draw(logits []float32, maxLogit float32, p, u float64) uint32 {
	if cap(h.w) < len(logits) {
		h.w, h.ids = make([]float64, len(logits)), make([]int32, 0, len(logits))
	}
	h.w, h.ids = h.w[:len(logits)], h.ids[:0]
	var z float64
	for i, x := range logits {
		e := math.Exp(float64(x - maxLogit))
		h.w[i] = e
		z += e
		h.ids = append(h.ids, int32(i))
	}
	heap.Init(h)
	var chosen []int32
	var mass float64
	for h.Len() > 0 && mass < p*z {
		id := heap.Pop(h).(int32)
		chosen = append(chosen, id)
		mass += h.w[id]
	}
	x := u * mass
	for _, id := range chosen {
		if x -= h.w[id]; x < 0 {
			return uint32(id)
		}
	}
	return uint32(chosen[len(chosen)-1])
}

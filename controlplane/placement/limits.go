package placement

import (
	"fmt"

	"github.com/kvsp/kvsp"
)

// limitCheck holds a request against the limits instances report
// (kvsp.InstanceStatus's vocab_size, context_tokens, max_output_tokens):
// a request no instance of its model can run is refused with 400 naming
// the member before any instance is chosen, so it takes no room and makes
// no session (RELIABILITY B14: tokens past the vocabulary, prompts past
// the context and max_tokens of 2^53-1 each held room until the instance
// refused them).
type limitCheck struct {
	q      *kvsp.PlaceRequest
	maxTok uint32 // the largest token id of the prompt
	seen   bool
}

// check returns a 400 problem naming the member that st's limits refuse,
// or nil. An instance that reports no limit is not held to one.
func (l *limitCheck) check(st *kvsp.InstanceStatus) error {
	q := l.q
	if v := st.VocabSize; v > 0 {
		if !l.seen { // one pass over the prompt, whatever the number of instances
			for _, t := range q.Tokens {
				l.maxTok = max(l.maxTok, t)
			}
			l.seen = true
		}
		if uint64(l.maxTok) >= v {
			for i, t := range q.Tokens {
				if uint64(t) >= v {
					return beyond(fmt.Sprintf("tokens[%d]", i), fmt.Sprintf("%d is not in the model's vocabulary of %d", t, v))
				}
			}
		}
	}
	n := uint64(len(q.Tokens))
	if c := st.ContextTokens; c > 0 {
		if n > c {
			return beyond("tokens", fmt.Sprintf("%d tokens exceed the instances' context of %d", n, c))
		}
		if q.MaxTokens > c-n {
			return beyond("max_tokens", fmt.Sprintf("a prompt of %d tokens leaves room for %d in the instances' context of %d", n, c-n, c))
		}
	}
	if m := st.MaxOutputTokens; m > 0 && q.MaxTokens > m {
		return beyond("max_tokens", fmt.Sprintf("at most %d output tokens", m))
	}
	return nil
}

func beyond(member, detail string) error {
	return kvsp.NewProblem(kvsp.ErrInvalid, "place: "+member+": "+detail).With("member", member)
}

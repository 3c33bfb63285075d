package gateway

import (
	"strings"
	"unicode/utf8"
)

// textStream turns an answer's token pieces into the text a client sees:
// octets of a character split across tokens are held until the character
// is whole, and text that may be the start of a stop sequence is held
// until it is known not to be one; a stop sequence ends the answer, and
// neither it nor what follows is sent (as OpenAI's API does).
type textStream struct {
	stops   []string
	pending []byte // octets not yet a whole character
	held    string // whole characters not yet sent: a stop sequence may start in them
	stopped bool
}

// add takes a token's piece and returns the text that may be sent now,
// and whether a stop sequence ended the answer.
func (t *textStream) add(piece []byte) (string, bool) {
	if t.stopped {
		return "", true
	}
	t.pending = append(t.pending, piece...)
	n := completeUTF8(t.pending)
	t.held += string(t.pending[:n])
	t.pending = append(t.pending[:0], t.pending[n:]...)
	for _, s := range t.stops {
		if i := strings.Index(t.held, s); i >= 0 {
			out := t.held[:i]
			t.held, t.stopped = "", true
			return out, true
		}
	}
	keep := 0 // the longest tail of held that begins a stop sequence
	for _, s := range t.stops {
		for k := min(len(s)-1, len(t.held)); k > keep; k-- {
			if strings.HasSuffix(t.held, s[:k]) {
				keep = k
				break
			}
		}
	}
	out := t.held[:len(t.held)-keep]
	t.held = t.held[len(t.held)-keep:]
	return out, false
}

// flush returns what is held at the end of the answer: held text, and an
// incomplete character as U+FFFD.
func (t *textStream) flush() string {
	if t.stopped {
		return ""
	}
	out := t.held + strings.ToValidUTF8(string(t.pending), "\uFFFD")
	t.held, t.pending = "", nil
	return out
}

// completeUTF8 returns the length of the longest prefix of b that does
// not end inside a character: an incomplete sequence at the end waits for
// its next octets; invalid octets elsewhere pass (and are replaced when
// sent).
func completeUTF8(b []byte) int {
	for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax; i-- {
		if !utf8.RuneStart(b[i]) {
			continue
		}
		if !utf8.FullRune(b[i:]) {
			return i
		}
		break
	}
	return len(b)
}

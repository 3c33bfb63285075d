package kvsp

import (
	"bytes"
	"encoding/binary"

	"github.com/go-json-experiment/json"
)

// Token arrays ([]uint32: a prompt, a checkpoint's tail and output) are
// most of the octets of place, generate and checkpoint bodies: a 15,000
// token prompt is about 90 KB of JSON. Decoded element by element through
// reflection, they were a sixth of all the CPU of kvsp demo --speed 24
// (every role and the front end in one process). unmarshalTokens reads
// them in one pass over the value the decoder has checked, 1.7 times as
// fast (BenchmarkTokenJSON), accepting what the reflective path accepts
// (TestTokenJSONMatchesReflect: an array of integers 0..2^32-1, or null)
// except a null element, which that path took for token 0. (Encoding the
// same way was slower than the reflective encoder: WriteValue checks the
// value again; it is not used.)

var tokenJSON = json.WithUnmarshalers(json.UnmarshalFunc(unmarshalTokens))

// unmarshalTokens decodes a syntactically valid JSON value (the decoder
// checked it) into *p.
func unmarshalTokens(b []byte, p *[]uint32) error {
	b = trimSpace(b)
	if string(b) == "null" {
		*p = nil
		return nil
	}
	if len(b) < 2 || b[0] != '[' {
		return invalidf("want an array of token ids")
	}
	out := (*p)[:0]
	if n := bytes.Count(b, []byte{','}) + 1; cap(out) < n {
		out = make([]uint32, 0, n)
	}
	body := trimSpace(b[1 : len(b)-1])
	for i := 0; len(body) > 0; i++ {
		var v uint64
		j := 0
		for j < len(body) && body[j] >= '0' && body[j] <= '9' {
			v = v*10 + uint64(body[j]-'0')
			if v > 1<<32-1 {
				return invalidf("token %d: not an integer 0..2^32-1", i)
			}
			j++
		}
		rest := trimSpace(body[j:])
		if j == 0 || (len(rest) > 0 && rest[0] != ',') {
			return invalidf("token %d: not an integer 0..2^32-1", i)
		}
		out = append(out, uint32(v))
		if len(rest) > 0 {
			rest = trimSpace(rest[1:])
		}
		body = rest
	}
	*p = out
	return nil
}

// trimSpace trims JSON whitespace.
func trimSpace(b []byte) []byte {
	isSpace := func(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
	for len(b) > 0 && isSpace(b[0]) {
		b = b[1:]
	}
	for len(b) > 0 && isSpace(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	return b
}

// A prompt travels in place and generate bodies either as "tokens", an
// array of decimal ids, or as "tokens_le32": the ids as 4 octets each,
// little-endian, base64 (RFC 4648 section 4, padded, as JSON carries
// octets). The second is what kvsp's client sends. A 15,000 token prompt
// is about 80 KB either way, but the decimal array is written and read
// digit by digit, and was a fifth of all the CPU of kvsp demo --speed 24
// (the front end encodes each prompt for place and for generate, the PC
// and the instance decode it); as tokens_le32 it encodes 3.5 times and
// decodes 2.7 times as fast (BenchmarkTokensLE32, both in one run).

// TokensLE32 encodes tokens for a tokens_le32 member.
func TokensLE32(tokens []uint32) []byte {
	b := make([]byte, 4*len(tokens))
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[4*i:], t)
	}
	return b
}

// foldTokensLE32 moves a decoded tokens_le32 member into tokens: a body
// carries its prompt in one of the two.
func foldTokensLE32(where string, tokens *[]uint32, le *[]byte) error {
	if *le == nil {
		return nil
	}
	switch {
	case *tokens != nil:
		return invalidf("%s: tokens and tokens_le32: one or the other", where)
	case len(*le)%4 != 0:
		return invalidf("%s: tokens_le32: %d octets, not a multiple of 4", where, len(*le))
	}
	out := make([]uint32, len(*le)/4)
	for i := range out {
		out[i] = binary.LittleEndian.Uint32((*le)[4*i:])
	}
	*tokens, *le = out, nil
	return nil
}

package kvsp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
)

// blockLabel is the domain-separation prefix of every Block Key input.
const blockLabel = "KVSP-BLOCK-1\x00"

const (
	offPrev   = len(blockLabel) + len(CompatID{}) // K[i-1] in the HMAC message
	offTokens = offPrev + len(BlockKey{})         // the block's tokens
)

// MaxBlockTokens bounds block_tokens (the container's Token Count is 32 bits;
// a block of more than 2^20 tokens is no KV cache anyone ships).
const MaxBlockTokens = 1 << 20

// Chain computes Block Keys incrementally (section "Scopes and Block Keys",
// R-KEY-3..8):
//
//	K[i] = HMAC-SHA-256(scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id ||
//	                    K[i-1] || uint32be(t[iB]) || ... || uint32be(t[iB+B-1]))
//
// with K[-1] = 32 zero octets. It keeps K[i-1] and the tokens of the block
// being filled, so extending a session by new tokens never recomputes the
// prefix, and it reuses one HMAC state: no allocation per block.
//
// A Chain is not safe for concurrent use; [Chain.Clone] forks it.
type Chain struct {
	mac    hash.Hash
	msg    []byte // label || compat_id || K[i-1] || tokens of the open block
	b      int    // block size B in tokens
	n      int    // tokens in the open block
	blocks int    // complete blocks so far
}

// NewChain starts a chain at K[-1] for one scope, Compatibility ID and block
// size B (the descriptor's block_tokens).
func NewChain(key ScopeKey, compat CompatID, blockTokens int) (*Chain, error) {
	return ResumeChain(key, compat, blockTokens, BlockKey{}, 0)
}

// ResumeChain starts a chain after `blocks` complete blocks whose last key
// is prev, for example from a Session Checkpoint's prompt_blocks, without
// the tokens of those blocks. With blocks == 0, prev must be zero (K[-1]).
func ResumeChain(key ScopeKey, compat CompatID, blockTokens int, prev BlockKey, blocks int) (*Chain, error) {
	if !key.Valid() {
		return nil, fmt.Errorf("%w: block keys: scope key missing or shorter than %d octets", ErrInvalid, MinScopeKeyLen)
	}
	if blockTokens < 1 || blockTokens > MaxBlockTokens {
		return nil, fmt.Errorf("%w: block keys: block_tokens %d out of range 1..%d", ErrInvalid, blockTokens, MaxBlockTokens)
	}
	if blocks < 0 || (blocks == 0) != prev.IsZero() {
		return nil, fmt.Errorf("%w: block keys: resume point is inconsistent", ErrInvalid)
	}
	c := &Chain{
		mac:    hmac.New(sha256.New, key.key),
		msg:    make([]byte, offTokens+4*blockTokens),
		b:      blockTokens,
		blocks: blocks,
	}
	copy(c.msg, blockLabel)
	copy(c.msg[len(blockLabel):], compat[:])
	copy(c.msg[offPrev:], prev[:])
	return c, nil
}

// BlockTokens returns B.
func (c *Chain) BlockTokens() int { return c.b }

// Blocks returns the number of complete blocks, i.e. keys produced so far
// (including those before a resume point).
func (c *Chain) Blocks() int { return c.blocks }

// Tokens returns the number of tokens consumed, counting complete blocks.
func (c *Chain) Tokens() int { return c.blocks*c.b + c.n }

// Last returns K[Blocks()-1], and false before the first complete block.
func (c *Chain) Last() (BlockKey, bool) {
	var k BlockKey
	copy(k[:], c.msg[offPrev:offTokens])
	return k, c.blocks > 0
}

// Pending appends to dst the tokens of the incomplete block, which have no
// key yet ("Only complete blocks have keys").
func (c *Chain) Pending(dst []uint32) []uint32 {
	for i := 0; i < c.n; i++ {
		dst = append(dst, binary.BigEndian.Uint32(c.msg[offTokens+4*i:]))
	}
	return dst
}

// Push adds one token. When it completes a block, Push returns that block's
// key and true.
func (c *Chain) Push(tok uint32) (BlockKey, bool) {
	binary.BigEndian.PutUint32(c.msg[offTokens+4*c.n:], tok)
	c.n++
	if c.n < c.b {
		return BlockKey{}, false
	}
	return c.seal(), true
}

// Append adds tokens and appends the keys of the blocks they complete to
// dst, in prefix order.
func (c *Chain) Append(dst []BlockKey, toks ...uint32) []BlockKey {
	for len(toks) > 0 {
		room := c.b - c.n
		if room > len(toks) {
			room = len(toks)
		}
		w := c.msg[offTokens+4*c.n:]
		for i, t := range toks[:room] {
			binary.BigEndian.PutUint32(w[4*i:], t)
		}
		c.n += room
		toks = toks[room:]
		if c.n == c.b {
			dst = append(dst, c.seal())
		}
	}
	return dst
}

// seal computes the key of the full open block. The new key is written over
// K[i-1] in the message, ready for the next block.
func (c *Chain) seal() BlockKey {
	c.mac.Reset()
	c.mac.Write(c.msg)
	c.mac.Sum(c.msg[offPrev:offPrev]) // overwrites K[i-1] with K[i]
	c.n = 0
	c.blocks++
	var k BlockKey
	copy(k[:], c.msg[offPrev:offTokens])
	return k
}

// Clone returns an independent copy of c, for forking a chain (for example a
// prompt shared by several sessions).
func (c *Chain) Clone() (*Chain, error) {
	d := *c
	d.msg = append([]byte(nil), c.msg...)
	m, ok := c.mac.(hash.Cloner)
	if !ok {
		return nil, errors.New("kvsp: HMAC state cannot be cloned")
	}
	h, err := m.Clone()
	if err != nil {
		return nil, fmt.Errorf("kvsp: cloning HMAC state: %w", err)
	}
	d.mac = h
	return &d, nil
}

// BlockKeys returns the keys of every complete block of tokens.
func BlockKeys(key ScopeKey, compat CompatID, blockTokens int, tokens []uint32) ([]BlockKey, error) {
	return AppendBlockKeys(make([]BlockKey, 0, len(tokens)/max(blockTokens, 1)), key, compat, blockTokens, tokens)
}

// AppendBlockKeys appends the keys of every complete block of tokens to dst.
// The tokens after the last complete block have no key (R-KEY-8).
func AppendBlockKeys(dst []BlockKey, key ScopeKey, compat CompatID, blockTokens int, tokens []uint32) ([]BlockKey, error) {
	c, err := NewChain(key, compat, blockTokens)
	if err != nil {
		return dst, err
	}
	return c.Append(dst, tokens[:len(tokens)-len(tokens)%blockTokens]...), nil
}

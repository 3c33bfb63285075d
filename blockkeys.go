package kvsp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"math/bits"
	"unsafe"
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
	msg    []byte   // label || compat_id || K[i-1] || tokens of a block
	pend   []uint32 // tokens of the open block, pend[:n]
	b      int      // block size B in tokens
	n      int      // tokens in the open block
	blocks int      // complete blocks so far
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
		mac:    hmac.New(sha256.New, key.octets()),
		msg:    make([]byte, offTokens+4*blockTokens),
		pend:   make([]uint32, blockTokens),
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
	return append(dst, c.pend[:c.n]...)
}

// Push adds one token and reports whether it completed a block; the
// block's key is then [Chain.Last]. Push is small enough to inline, so a
// decode loop pays one store per token and the HMAC once per block.
func (c *Chain) Push(tok uint32) bool {
	c.pend[c.n] = tok
	c.n++
	if c.n < c.b {
		return false
	}
	c.flush()
	return true
}

// Append adds tokens and appends the keys of the blocks they complete to
// dst, in prefix order.
func (c *Chain) Append(dst []BlockKey, toks ...uint32) []BlockKey {
	if c.n > 0 { // fill the open block first
		k := copy(c.pend[c.n:], toks)
		c.n += k
		toks = toks[k:]
		if c.n < c.b {
			return dst
		}
		dst = append(dst, c.sealPending())
	}
	for len(toks) >= c.b { // whole blocks straight from the caller's slice
		dst = append(dst, c.seal(toks[:c.b]))
		toks = toks[c.b:]
	}
	c.n = copy(c.pend, toks)
	return dst
}

// sealPending seals the open block.
func (c *Chain) sealPending() BlockKey { return c.seal(c.pend) }

// flush seals the open block, out of line so that Push inlines.
//
//go:noinline
func (c *Chain) flush() { c.seal(c.pend) }

// seal computes the key of the full block toks (len B). The new key is
// written over K[i-1] in the message, ready for the next block.
func (c *Chain) seal(toks []uint32) BlockKey {
	encodeTokens(c.msg[offTokens:], toks)
	c.mac.Reset()
	c.mac.Write(c.msg)
	c.mac.Sum(c.msg[offPrev:offPrev]) // overwrites K[i-1] with K[i]
	c.n = 0
	c.blocks++
	return BlockKey(c.msg[offPrev:offTokens])
}

// encodeTokens writes toks as uint32 big-endian into w. On little-endian
// machines it stores byte-reversed words through a []uint32 view of w (one
// BSWAP and one store per token, no bounds checks in the loop): with
// binary.BigEndian.PutUint32 per token the swapping cost a third of the HMAC
// at B=256.
func encodeTokens(w []byte, toks []uint32) {
	if len(toks) == 0 {
		return
	}
	w = w[:4*len(toks)]
	if !littleEndian {
		for i, t := range toks {
			binary.BigEndian.PutUint32(w[4*i:], t)
		}
		return
	}
	dst := unsafe.Slice((*uint32)(unsafe.Pointer(&w[0])), len(toks))
	for i, t := range toks {
		dst[i] = bits.ReverseBytes32(t)
	}
}

// littleEndian reports the byte order of this machine.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// Clone returns an independent copy of c, for forking a chain (for example a
// prompt shared by several sessions).
func (c *Chain) Clone() (*Chain, error) {
	d := *c
	d.msg = append([]byte(nil), c.msg...)
	d.pend = append([]uint32(nil), c.pend...)
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

package kvsp_test

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/kvsp/kvsp"
)

func appendixCompat(t testing.TB) kvsp.CompatID {
	c, err := kvsp.ParseCompatID(vecCompatID.value)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// referenceKey is the spec's formula written out plainly, with knobs for the
// mistakes that CONFORMANCE.md 2.3 says the vectors discriminate against.
func referenceKey(key []byte, compat, prev []byte, toks []uint32, sep []byte, le bool) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("KVSP-BLOCK-1"))
	m.Write(sep)
	m.Write(compat)
	m.Write(prev)
	for _, t := range toks {
		var b [4]byte
		if le {
			binary.LittleEndian.PutUint32(b[:], t)
		} else {
			binary.BigEndian.PutUint32(b[:], t)
		}
		m.Write(b[:])
	}
	return m.Sum(nil)
}

// TestBlockKeyNegativeVectors: each common mistake gives a different K[0]
// (R-KEY-3, R-KEY-5), and the plain formula gives the appendix value.
func TestBlockKeyNegativeVectors(t *testing.T) {
	key := mustHex(t, vecScopeKey.value)
	compat := mustHex(t, vecCompatID.value)
	zero := make([]byte, 32)
	toks := vecTokens[:4]
	if got := referenceKey(key, compat, zero, toks, []byte{0}, false); !bytes.Equal(got, mustHex(t, vecK0.value)) {
		t.Fatalf("reference formula K[0] = %x", got)
	}
	for name, got := range map[string][]byte{
		"no 0x00 separator":    referenceKey(key, compat, zero, toks, nil, false),
		"little-endian tokens": referenceKey(key, compat, zero, toks, []byte{0}, true),
		"hex compat_id":        referenceKey(key, []byte(vecCompatID.value), zero, toks, []byte{0}, false),
		"no K[-1]":             referenceKey(key, compat, nil, toks, []byte{0}, false),
	} {
		if bytes.Equal(got, mustHex(t, vecK0.value)) {
			t.Errorf("%s gives the appendix K[0]", name)
		}
	}
}

// TestChainIncrementalEqualsBatch: token by token, in uneven slices, and in
// one batch give the same keys; the tail has no key (R-KEY-6, R-KEY-8).
func TestChainIncrementalEqualsBatch(t *testing.T) {
	key := appendixScopeKey(t)
	compat := appendixCompat(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, b := range []int{1, 4, 16, 256} {
		toks := make([]uint32, 10*b+b/2+1)
		for i := range toks {
			toks[i] = rng.Uint32()
		}
		batch, err := kvsp.BlockKeys(key, compat, b, toks)
		if err != nil {
			t.Fatal(err)
		}
		if len(batch) != len(toks)/b {
			t.Fatalf("B=%d: %d keys for %d tokens", b, len(batch), len(toks))
		}
		ch, _ := kvsp.NewChain(key, compat, b)
		var inc []kvsp.BlockKey
		for _, tok := range toks {
			if ch.Push(tok) {
				k, _ := ch.Last()
				inc = append(inc, k)
			}
		}
		ch2, _ := kvsp.NewChain(key, compat, b)
		var sliced []kvsp.BlockKey
		for rest := toks; len(rest) > 0; {
			n := min(len(rest), 1+rng.IntN(3*b))
			sliced = ch2.Append(sliced, rest[:n]...)
			rest = rest[n:]
		}
		for i := range batch {
			if inc[i] != batch[i] || sliced[i] != batch[i] {
				t.Fatalf("B=%d key %d differs: push %s append %s batch %s", b, i, inc[i], sliced[i], batch[i])
			}
		}
		if len(inc) != len(batch) || len(sliced) != len(batch) {
			t.Fatalf("B=%d: key counts %d/%d/%d", b, len(inc), len(sliced), len(batch))
		}
		tail := ch.Pending(nil)
		if want := toks[len(batch)*b:]; len(tail) != len(want) || (len(want) > 0 && tail[0] != want[0]) {
			t.Fatalf("B=%d: pending %v, want %v", b, tail, want)
		}
		if last, ok := ch.Last(); !ok || last != batch[len(batch)-1] {
			t.Fatalf("B=%d: Last() = %s, %v", b, last, ok)
		}
		if ch.Tokens() != len(toks) || ch.Blocks() != len(batch) {
			t.Fatalf("B=%d: Tokens %d Blocks %d", b, ch.Tokens(), ch.Blocks())
		}
	}
}

// TestChainSevenTokens: 7 tokens with B=4 give exactly one key (R-KEY-8).
func TestChainSevenTokens(t *testing.T) {
	keys, err := kvsp.BlockKeys(appendixScopeKey(t), appendixCompat(t), 4, vecTokens[:7])
	if err != nil || len(keys) != 1 || keys[0].String() != vecK0.value {
		t.Fatalf("keys = %v, %v", keys, err)
	}
}

// TestChainResumeAndClone: a chain resumed from K[0] continues to K[1]; a
// clone is independent of its parent.
func TestChainResumeAndClone(t *testing.T) {
	key, compat := appendixScopeKey(t), appendixCompat(t)
	k0, _ := kvsp.ParseBlockKey(vecK0.value)
	ch, err := kvsp.ResumeChain(key, compat, 4, k0, 1)
	if err != nil {
		t.Fatal(err)
	}
	got := ch.Append(nil, vecTokens[4:]...)
	if len(got) != 1 || got[0].String() != vecK1.value || ch.Blocks() != 2 {
		t.Fatalf("resumed chain: %v (blocks %d)", got, ch.Blocks())
	}
	if _, err := kvsp.ResumeChain(key, compat, 4, k0, 0); err == nil {
		t.Error("resume with a key but no blocks accepted")
	}

	base, _ := kvsp.NewChain(key, compat, 4)
	base.Append(nil, vecTokens[:6]...)
	fork, err := base.Clone()
	if err != nil {
		t.Fatal(err)
	}
	a := base.Append(nil, vecTokens[6:]...)
	b := fork.Append(nil, 1, 2)
	if len(a) != 1 || a[0].String() != vecK1.value || len(b) != 1 || b[0] == a[0] {
		t.Fatalf("clone not independent: %v %v", a, b)
	}
}

// TestScopesUnrelated: the same tokens under two scope keys give unrelated
// keys (R-KEY-12), and block_tokens out of range or a missing key fail.
func TestScopesUnrelated(t *testing.T) {
	k2, _ := kvsp.NewScopeKey(bytes.Repeat([]byte{7}, 32))
	a, _ := kvsp.BlockKeys(appendixScopeKey(t), appendixCompat(t), 4, vecTokens)
	b, _ := kvsp.BlockKeys(k2, appendixCompat(t), 4, vecTokens)
	if a[0] == b[0] || a[1] == b[1] {
		t.Fatal("keys of two scopes coincide")
	}
	if _, err := kvsp.NewChain(kvsp.ScopeKey{}, appendixCompat(t), 4); err == nil {
		t.Error("zero ScopeKey accepted")
	}
	if _, err := kvsp.NewChain(k2, appendixCompat(t), 0); err == nil {
		t.Error("block_tokens 0 accepted")
	}
}

// TestChainNoAllocs: extending a chain allocates nothing per block.
func TestChainNoAllocs(t *testing.T) {
	ch, _ := kvsp.NewChain(appendixScopeKey(t), appendixCompat(t), 16)
	toks := make([]uint32, 16)
	dst := make([]kvsp.BlockKey, 0, 1)
	ch.Append(dst, toks...) // warm the HMAC state
	if n := testing.AllocsPerRun(200, func() { ch.Append(dst[:0], toks...) }); n != 0 {
		t.Errorf("Append: %v allocations per block, want 0", n)
	}
	if n := testing.AllocsPerRun(200, func() {
		for _, tok := range toks {
			ch.Push(tok)
		}
	}); n != 0 {
		t.Errorf("Push: %v allocations per block, want 0", n)
	}
}

const benchTokens = 128 << 10

// BenchmarkBlockKeys measures the chain over 128k tokens against a bare
// HMAC-SHA-256 loop over the same message bytes in the same run (the bound:
// PERFORMANCE.md measured 48M tokens/s at B=16, 237M at B=256). Report
// tokens/s; compare chain/bare with benchstat. The target is a
// ratio of at least 0.9 and 0 allocations per block.
func BenchmarkBlockKeys(b *testing.B) {
	key := appendixScopeKey(b)
	compat := appendixCompat(b)
	toks := make([]uint32, benchTokens)
	for i := range toks {
		toks[i] = uint32(i * 2654435761)
	}
	for _, bt := range []int{16, 256} {
		msgLen := 13 + 1 + 32 + 32 + 4*bt
		report := func(b *testing.B) {
			b.SetBytes(int64(benchTokens / bt * msgLen))
			b.ReportMetric(float64(benchTokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
		}
		b.Run(name("bare", bt), func(b *testing.B) {
			raw := appendixScopeKeyBytes(b)
			m := hmac.New(sha256.New, raw)
			msg := make([]byte, msgLen)
			var out [32]byte
			b.ReportAllocs()
			for b.Loop() {
				for i := 0; i < benchTokens/bt; i++ {
					m.Reset()
					m.Write(msg)
					m.Sum(out[:0])
					msg[50] ^= out[0]
				}
			}
			report(b)
		})
		b.Run(name("batch", bt), func(b *testing.B) {
			dst := make([]kvsp.BlockKey, 0, benchTokens/bt)
			b.ReportAllocs()
			for b.Loop() {
				dst, _ = kvsp.AppendBlockKeys(dst[:0], key, compat, bt, toks)
			}
			report(b)
		})
		// Incremental, one token at a time: a decode loop.
		b.Run(name("push", bt), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				ch, _ := kvsp.NewChain(key, compat, bt)
				for _, tok := range toks {
					ch.Push(tok)
				}
			}
			report(b)
		})
		// Incremental, 61 tokens at a time (not aligned to blocks): chunked
		// prefill or speculative decoding steps.
		b.Run(name("append61", bt), func(b *testing.B) {
			dst := make([]kvsp.BlockKey, 0, benchTokens/bt)
			b.ReportAllocs()
			for b.Loop() {
				ch, _ := kvsp.NewChain(key, compat, bt)
				dst = dst[:0]
				for rest := toks; len(rest) > 0; {
					n := min(61, len(rest))
					dst = ch.Append(dst, rest[:n]...)
					rest = rest[n:]
				}
			}
			report(b)
		})
	}
}

func name(kind string, bt int) string {
	return kind + "/B=" + map[int]string{16: "16", 256: "256"}[bt]
}

func appendixScopeKeyBytes(b testing.TB) []byte { return mustHex(b, vecScopeKey.value) }

// BenchmarkCompatID computes the appendix descriptor's ID (validation, JCS
// and SHA-256).
func BenchmarkCompatID(b *testing.B) {
	d := appendixDescriptor(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := d.CompatID(); err != nil {
			b.Fatal(err)
		}
	}
}

package kvsp_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/figures"
)

// The helpers of TestS6_BlockKeyVectorsAndDomainSeparation (RELIABILITY.md
// row S6), which sits with the appendix vectors in vectors_test.go.

// s6CollisionSamples is the size of the no-collision property check; the
// row asks for 10^6.
const s6CollisionSamples = 1_000_000

// s6Keys returns the keys of tokens under key and compat, B = 4.
func s6Keys(t *testing.T, key kvsp.ScopeKey, compat kvsp.CompatID, toks []uint32) []kvsp.BlockKey {
	t.Helper()
	ks, err := kvsp.BlockKeys(key, compat, 4, toks)
	if err != nil {
		t.Fatal(err)
	}
	return ks
}

// s6DomainSeparation: changing one token of block j changes K[j..] and
// leaves K[..j-1] alone (the chain covers the prefix, R-KEY-7); changing
// one descriptor member, adding adapters or reordering them changes the
// compat_id and so every K[i] (R-CMP-5, R-CMP-6, R-CMP-10); another scope
// key changes every K[i], and no key of one scope equals any key of the
// other (R-KEY-11, R-KEY-12).
func s6DomainSeparation(t *testing.T, d kvsp.Descriptor) {
	key := appendixScopeKey(t)
	compat := appendixCompat(t)
	rng := rand.New(rand.NewPCG(6, 6))
	toks := make([]uint32, 16) // 4 blocks
	for i := range toks {
		toks[i] = rng.Uint32()
	}
	base := s6Keys(t, key, compat, toks)
	if len(base) != 4 {
		t.Fatalf("%d keys for 16 tokens, B=4", len(base))
	}

	// One token.
	for p := range toks {
		mut := slices.Clone(toks)
		mut[p] ^= 1
		got := s6Keys(t, key, compat, mut)
		for i := range base {
			if changed := got[i] != base[i]; changed != (i >= p/4) {
				t.Errorf("token %d flipped: K[%d] changed=%v, want %v", p, i, changed, i >= p/4)
			}
		}
	}

	// One descriptor member, adapters, adapter order: each a different
	// compat_id, and every key differs from the base.
	a := "sha-256:" + strings.Repeat("aa", 32)
	b := "sha-256:" + strings.Repeat("bb", 32)
	variants := map[string]string{
		"model":            replaceMember("model", `"example-model-x"`),
		"model_digest":     replaceMember("model_digest", `"sha-256:`+strings.Repeat("01", 32)+`"`),
		"tokenizer_digest": replaceMember("tokenizer_digest", `"sha-256:`+strings.Repeat("02", 32)+`"`),
		"layers":           replaceMember("layers", `33`),
		"kv_heads":         replaceMember("kv_heads", `16`),
		"head_dim":         replaceMember("head_dim", `64`),
		"kv_dtype":         replaceMember("kv_dtype", `"fp16"`),
		"positional":       replaceMember("positional", `"rope;theta=500000"`),
		"block_tokens":     replaceMember("block_tokens", `8`),
		"adapters [a]":     addMember(`"adapters":["` + a + `"]`),
		"adapters [a,b]":   addMember(`"adapters":["` + a + `","` + b + `"]`),
		"adapters [b,a]":   addMember(`"adapters":["` + b + `","` + a + `"]`),
	}
	seen := map[kvsp.CompatID]string{compat: "appendix"}
	for name, text := range variants {
		dv, err := kvsp.ParseDescriptor([]byte(text))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		c, err := dv.CompatID()
		if err != nil {
			t.Fatal(err)
		}
		if prev, dup := seen[c]; dup {
			t.Errorf("%s and %s share a compat_id", name, prev)
		}
		seen[c] = name
		for i, k := range s6Keys(t, key, c, toks) {
			if k == base[i] {
				t.Errorf("%s: K[%d] unchanged", name, i)
			}
		}
	}
	// Absent and present adapters through the Go value, not only text.
	withA := d
	withA.Adapters = []kvsp.Digest{mustDigest(t, a)}
	if c1, _ := d.CompatID(); c1 != compat {
		t.Fatalf("appendix descriptor compat_id %s", c1)
	}
	if c2, err := withA.CompatID(); err != nil || c2 == compat {
		t.Errorf("adapters present vs absent: same compat_id (%v)", err)
	}

	// Another scope key, one bit apart.
	kb := mustHex(t, vecScopeKey.value)
	kb[31] ^= 1
	other, err := kvsp.NewScopeKey(kb)
	if err != nil {
		t.Fatal(err)
	}
	if other.ID() == key.ID() {
		t.Error("scope_id unchanged by the scope key")
	}
	ok := s6Keys(t, other, compat, toks)
	for i := range base {
		for j := range ok {
			if ok[j] == base[i] {
				t.Errorf("scope key flip: K'[%d] == K[%d]", j, i)
			}
		}
	}
}

func mustDigest(t *testing.T, s string) kvsp.Digest {
	t.Helper()
	d, err := kvsp.ParseDigest(s)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// s6EmptyAdapters: "adapters": [] (and null) is rejected rather than
// treated as absent, in text and as a Go value, so one cache cannot have
// two compat_ids (R-CMP-6).
func s6EmptyAdapters(t *testing.T) {
	for _, m := range []string{`"adapters":[]`, `"adapters":null`, `"adapters":{}`, `"adapters":""`} {
		if _, err := kvsp.ParseDescriptor([]byte(addMember(m))); !errors.Is(err, kvsp.ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", m, err)
		}
	}
	d := appendixDescriptor(t)
	d.Adapters = []kvsp.Digest{}
	if _, err := d.CompatID(); !errors.Is(err, kvsp.ErrInvalid) {
		t.Errorf("Descriptor{Adapters: []} CompatID: err = %v, want ErrInvalid", err)
	}
	if _, err := d.JCS(); err == nil {
		t.Error("Descriptor{Adapters: []} has a JCS form")
	}
}

// s6JCSReorder: 200 random member orders, with random whitespace, of the
// appendix descriptor (and of one with adapters) canonicalize to the same
// octets and compat_id (R-CMP-13, R-CMP-14).
func s6JCSReorder(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 14))
	ws := []string{"", " ", "\n", "\t", "  \r\n"}
	for _, src := range []string{vecJCS.value, addMember(`"adapters":["sha-256:` + strings.Repeat("aa", 32) + `","sha-256:` + strings.Repeat("bb", 32) + `"]`)} {
		var members map[string]json.RawMessage
		if err := json.Unmarshal([]byte(src), &members); err != nil {
			t.Fatal(err)
		}
		names := make([]string, 0, len(members))
		for n := range members {
			names = append(names, n)
		}
		slices.Sort(names)
		d0, err := kvsp.ParseDescriptor([]byte(src))
		if err != nil {
			t.Fatal(err)
		}
		want, _ := d0.JCS()
		wantID, _ := d0.CompatID()
		if src == vecJCS.value && (string(want) != vecJCS.value || wantID.String() != vecCompatID.value) {
			t.Fatalf("appendix JCS/compat_id differ from the vectors")
		}
		for range 200 {
			var sb strings.Builder
			sb.WriteString(ws[rng.IntN(len(ws))] + "{")
			for i, j := range rng.Perm(len(names)) {
				if i > 0 {
					sb.WriteString(",")
				}
				sb.WriteString(ws[rng.IntN(len(ws))] + strconv.Quote(names[j]) + ws[rng.IntN(len(ws))] + ":" + ws[rng.IntN(len(ws))])
				sb.Write(members[names[j]])
			}
			sb.WriteString(ws[rng.IntN(len(ws))] + "}")
			d, err := kvsp.ParseDescriptor([]byte(sb.String()))
			if err != nil {
				t.Fatalf("reordered descriptor rejected: %v\n%s", err, sb.String())
			}
			got, err := d.JCS()
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("JCS of a reordering:\n got %s\nwant %s\n(from %s)", got, want, sb.String())
			}
			if id, _ := d.CompatID(); id != wantID {
				t.Fatalf("compat_id of a reordering = %s, want %s", id, wantID)
			}
		}
	}
}

// s6NoCollision: N distinct inputs give N distinct keys. Four (scope
// key, compat_id) contexts each run one chain over the same token stream,
// so equal tokens in another scope or model are part of the sample; the
// first token of block j is j, so every (context, K[j-1], tokens) input is
// distinct.
func s6NoCollision(t *testing.T) {
	n := s6CollisionSamples
	if s := os.Getenv("KVSP_S6_SAMPLES"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 8 {
			t.Fatalf("KVSP_S6_SAMPLES=%q", s)
		}
		n = v
	}
	k1 := appendixScopeKey(t)
	k2, _ := kvsp.NewScopeKey(bytes.Repeat([]byte{0x5a}, 32))
	c1 := appendixCompat(t)
	da, _ := kvsp.ParseDescriptor([]byte(addMember(`"adapters":["sha-256:` + strings.Repeat("aa", 32) + `"]`)))
	c2, _ := da.CompatID()
	ctxs := []struct {
		key    kvsp.ScopeKey
		compat kvsp.CompatID
	}{{k1, c1}, {k2, c1}, {k1, c2}, {k2, c2}}
	// One chain per context, each filling its own quarter, in parallel.
	keys := make([]kvsp.BlockKey, n)
	per := (n + len(ctxs) - 1) / len(ctxs)
	var wg sync.WaitGroup
	for ci, c := range ctxs {
		seg := keys[min(ci*per, n):min((ci+1)*per, n)]
		ch, err := kvsp.NewChain(c.key, c.compat, 4)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			for j := range uint32(len(seg)) {
				ch.Append(seg[j:j], j, j*2654435761, ^j, j>>3)
			}
		})
	}
	wg.Wait()
	// An open-addressing set keyed by the first 8 octets (uniform for
	// HMAC output); equal prefixes are compared in full.
	size := 1
	for size < 2*n {
		size <<= 1
	}
	table := make([]uint32, size) // index+1 into keys; 0: empty
	for i := range keys {
		h := binary.LittleEndian.Uint64(keys[i][:8])
		for s := h & uint64(size-1); ; s = (s + 1) & uint64(size-1) {
			if table[s] == 0 {
				table[s] = uint32(i + 1)
				break
			}
			if o := table[s] - 1; keys[o] == keys[i] {
				t.Fatalf("collision among %d distinct inputs: inputs %d and %d give %s", n, o, i, keys[i])
			}
		}
	}
	t.Logf("%d distinct inputs, %d distinct keys", n, len(keys))
	figures.Report(t, figures.Row{Row: "S6", Inputs: int64(n),
		Held:   fmt.Sprintf("the spec's Block Key vectors; %d distinct inputs over 4 scope and model contexts, %d distinct keys", n, len(keys)),
		Detail: map[string]float64{"samples": float64(n)}})
}

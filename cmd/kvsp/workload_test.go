package main

import (
	"bytes"
	"io/fs"
	"slices"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestTextWorkload (issue 50): the committed text/workload.json is what
// kvsp workload text --seed 1 makes of the corpus with SmolLM2's
// tokenizer, byte for byte, and it holds the workload's fixed parameters:
// 60 requests or more, prompts of 500 to 2,000 tokens, the system prompt
// at most a quarter of the mean prompt, 10 documents or more, a quarter
// or more follow-ups; its bound is recomputed from the file.
func TestTextWorkload(t *testing.T) {
	requireLlama(t)
	gguf := kvsptest.SmolLM2(t)
	var out, errOut bytes.Buffer
	if code := run([]string{"workload", "text", "--seed", "1", "--model", gguf}, &out, &errOut); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	committed, err := textFS.ReadFile("text/workload.json")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), committed) {
		t.Fatal("cmd/kvsp/text/workload.json is not what kvsp workload text --seed 1 makes: run bin/kvsp workload text --out cmd/kvsp/text/workload.json")
	}
	t.Log(strings.TrimSpace(errOut.String()))
	w, err := loadTextWorkload("")
	if err != nil {
		t.Fatal(err)
	}
	tok, _, closeVocab, err := vocabTokens(gguf)
	if err != nil {
		t.Fatal(err)
	}
	defer closeVocab()
	if err := w.check(tok); err != nil {
		t.Fatal(err)
	}
	bound, blocks := w.BoundTokens, w.Blocks
	if err := w.bound(tok); err != nil {
		t.Fatal(err)
	}
	if w.BoundTokens != bound || w.Blocks != blocks || w.Bound < 0.5 {
		t.Fatalf("bound %d tokens of %d blocks recomputed, the file says %d of %d (ratio %g)", w.BoundTokens, w.Blocks, bound, blocks, w.Bound)
	}
	// Follow-ups extend the chat they follow, and arrive after it.
	for _, q := range w.Requests {
		if q.After == nil {
			continue
		}
		p := w.Requests[*q.After]
		if *q.After >= q.ID || p.Conversation != q.Conversation || len(q.Messages) != len(p.Messages)+2 || q.BoundTokens < p.PromptTokens/16*16-16 {
			t.Fatalf("request %d does not extend request %d (bound %d of %d)", q.ID, p.ID, q.BoundTokens, p.PromptTokens)
		}
	}
}

// TestTextWorkloadBound: the infinite-cache bound counts the complete
// leading blocks an earlier prompt had, nothing after the first block it
// did not.
func TestTextWorkloadBound(t *testing.T) {
	bytesTok := func(msgs []textMessage) ([]uint32, error) {
		var toks []uint32
		for _, m := range msgs {
			for _, c := range []byte(m.Content) {
				toks = append(toks, uint32(c))
			}
		}
		return toks, nil
	}
	a := strings.Repeat("a", 40)
	w := &textWorkload{BlockTokens: 16, Requests: []textRequest{
		{Messages: []textMessage{{"user", a + "xyz"}}, PromptTokens: 43},
		{Messages: []textMessage{{"user", a + "qrstuvwxyz"}}, PromptTokens: 50},                                // 2 blocks of a
		{Messages: []textMessage{{"user", "b" + a}}, PromptTokens: 41},                                         // another first block: none
		{Messages: []textMessage{{"user", a[:16] + "c" + a[17:] + strings.Repeat("q", 30)}}, PromptTokens: 70}, // block 2 differs: 1
	}}
	if err := w.bound(bytesTok); err != nil {
		t.Fatal(err)
	}
	var got []int
	for _, q := range w.Requests {
		got = append(got, q.BoundTokens)
	}
	if want := []int{0, 32, 0, 16}; !slices.Equal(got, want) || w.BoundTokens != 48 || w.PromptTokens != 204 {
		t.Fatalf("bound per request %v (want %v), %d of %d", got, want, w.BoundTokens, w.PromptTokens)
	}
	w.Requests[1].PromptTokens = 49
	if err := w.bound(bytesTok); err == nil {
		t.Fatal("a prompt count the tokenizer does not give was taken")
	}
}

// TestTextCorpusChecked: a corpus file that is not the one SHA256SUMS
// lists, or one it does not list, is refused.
func TestTextCorpusChecked(t *testing.T) {
	m := fstest.MapFS{}
	err := fs.WalkDir(textFS, "text", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := textFS.ReadFile(p)
		m[p] = &fstest.MapFile{Data: b}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	docs, _, err := loadTextCorpus(m)
	if err != nil || len(docs) < 10 {
		t.Fatalf("%d documents, %v", len(docs), err)
	}
	f := m["text/corpus/01-an-openai-compatible-api-on-a-real-model.md"]
	orig := f.Data
	f.Data = append(bytes.Clone(orig), '!')
	if _, _, err := loadTextCorpus(m); err == nil || !strings.Contains(err.Error(), "not the file") {
		t.Fatalf("a changed document: %v", err)
	}
	f.Data = orig
	m["text/corpus/99-extra.md"] = &fstest.MapFile{Data: []byte("# Extra\n\nMore.\n")}
	if _, _, err := loadTextCorpus(m); err == nil {
		t.Fatal("a document SHA256SUMS does not list was taken")
	}
}

// TestTextWorkloadCheck: each fixed parameter the workload misses is named.
func TestTextWorkloadCheck(t *testing.T) {
	sysTok := func(n int) chatTokens {
		return func([]textMessage) ([]uint32, error) { return make([]uint32, n), nil }
	}
	fresh := func() *textWorkload {
		w, err := loadTextWorkload("")
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	if err := fresh().check(sysTok(145)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		edit func(w *textWorkload)
		tok  chatTokens
		want string
	}{
		{func(w *textWorkload) { w.Requests = w.Requests[:59] }, sysTok(145), "want 60 or more"},
		{func(w *textWorkload) { w.Requests[7].PromptTokens = 499 }, sysTok(145), "a prompt of 499"},
		{func(w *textWorkload) {}, sysTok(400), "quarter of the mean"},
		{func(w *textWorkload) {
			for i := range w.Requests {
				w.Requests[i].After = nil
			}
		}, sysTok(145), "follow-ups"},
		{func(w *textWorkload) {
			for i := range w.Requests {
				w.Requests[i].Documents = w.Requests[0].Documents
			}
		}, sysTok(145), "documents asked about"},
	} {
		w := fresh()
		c.edit(w)
		if err := w.check(c.tok); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("want %q: %v", c.want, err)
		}
	}
}

package main

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/engine/llamacpp"
)

// The text workload: documents of kvsp's own documentation (text/corpus,
// fixed copies with their sha256 in text/SHA256SUMS) asked about by
// simulated users, as a retrieval-augmented chat would be: one shared
// system prompt, one or two retrieved documents per conversation (a few
// hot, many cold), and follow-ups whose earlier assistant turns are fixed
// text of the file. Every mode of the demo sends these same requests.
//
//go:embed text/NOTICE text/SHA256SUMS text/corpus text/workload.json
var textFS embed.FS

// The workload's fixed parameters (the issue's): prompts of 500 to 2,000
// tokens, the system prompt at most a quarter of the mean prompt, 10
// documents or more, a quarter of the requests or more follow-ups.
const (
	textMinPrompt   = 500
	textMaxPrompt   = 2000
	textRequests    = 60
	textAnswer      = 24  // max_tokens of each request
	textStartMeanS  = 3.5 // seconds between conversations, on average
	textThinkS      = 8.0 // a follow-up comes 8 to 20 s after the answer it follows
	textThinkSpanS  = 12.0
	textBlockTokens = 16 // SmolLM2's descriptor (examples/openai)
	// textEngineBlocks is each engine's own KV cache in the demo: 2,560
	// tokens, about three prompts, a fifth of the workload's distinct
	// blocks (device memory holds a fraction of a fleet's prefixes).
	textEngineBlocks = 160
)

// textSystem is the shared system prompt of every request.
const textSystem = `You are the documentation assistant of kvsp, an implementation of the KV Cache Storage Protocol: ` +
	`the Index Service, the holders of KV blocks, the Placement Controller, the instance agent beside an inference engine, ` +
	`and the gateway that serves the OpenAI API over them. Platform engineers ask you how to run, tune and trust it. ` +
	`Answer from the documents given with the question, in plain sentences, and say so when they do not answer it. ` +
	`Quote commands, configuration keys and figures exactly as the documents give them, with the date or the machine ` +
	`a figure was measured on when the document says it. Keep each answer short: two or three sentences, no lists.`

var textQuestions = []string{
	"What does the section %q say, in two sentences?",
	"Which figures does %q report, and how were they measured?",
	"Explain %q to a platform engineer who is new to kvsp.",
	"What should an operator check first, according to %q?",
	"What problem does the part %q solve, and how?",
}

var textFollowUps = []string{
	"Can you say more about %s?",
	"Why does %s matter here?",
	"What are the limits of %s?",
	"How would I check %s on my own machine?",
}

// textWorkload is workload.json: readable as it is, each request with its
// whole chat.
type textWorkload struct {
	Generator    string        `json:"generator"`
	Corpus       string        `json:"corpus_sha256"` // of text/SHA256SUMS
	Tokenizer    string        `json:"tokenizer"`     // the model whose tokenizer counted (its descriptor's model)
	BlockTokens  int           `json:"block_tokens"`
	System       string        `json:"system"`
	Documents    []string      `json:"documents"`
	Requests     []textRequest `json:"requests"`
	PromptTokens int64         `json:"prompt_tokens"`
	BoundTokens  int64         `json:"bound_cached_tokens"` // an infinite cache's hits
	Bound        float64       `json:"bound_ratio"`
	Blocks       int           `json:"distinct_blocks"`
}

// textRequest is one chat completion request. A first turn arrives at_s
// seconds after the start; a follow-up think_s seconds after the answer
// to the request it follows (after), whose chat it extends.
type textRequest struct {
	ID           int           `json:"id"`
	Conversation int           `json:"conversation"`
	Turn         int           `json:"turn"`
	AtS          float64       `json:"at_s,omitempty"`
	After        *int          `json:"after,omitempty"`
	ThinkS       float64       `json:"think_s,omitempty"`
	Documents    []string      `json:"documents"`
	MaxTokens    int           `json:"max_tokens"`
	Messages     []textMessage `json:"messages"`
	PromptTokens int           `json:"prompt_tokens"`
	BoundTokens  int           `json:"bound_cached_tokens"`
}

type textMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// textDoc is a corpus document: its file name, title and paragraphs.
type textDoc struct {
	name, title, text string
	sentences         []string
	terms             []string
}

// loadTextCorpus reads the corpus (text/ of fsys: the embedded one),
// refusing it unless every file has the sha256 SHA256SUMS gives (and no
// other file is there).
func loadTextCorpus(fsys fs.FS) ([]textDoc, string, error) {
	sums, err := fs.ReadFile(fsys, "text/SHA256SUMS")
	if err != nil {
		return nil, "", err
	}
	want := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(sums)), "\n") {
		sum, name, ok := strings.Cut(line, "  ")
		if !ok {
			return nil, "", fmt.Errorf("workload: text/SHA256SUMS: %q", line)
		}
		want[name] = sum
	}
	entries, err := fs.ReadDir(fsys, "text/corpus")
	if err != nil {
		return nil, "", err
	}
	if len(entries) != len(want) {
		return nil, "", fmt.Errorf("workload: text/corpus has %d files, SHA256SUMS lists %d", len(entries), len(want))
	}
	sentence := regexp.MustCompile(`[^.!?]*[A-Za-z][^.!?]*[.!?]`)
	term := regexp.MustCompile("`([^`]{3,40})`")
	var docs []textDoc
	for _, e := range entries {
		name := "corpus/" + e.Name()
		b, err := fs.ReadFile(fsys, path.Join("text", name))
		if err != nil {
			return nil, "", err
		}
		sum := sha256.Sum256(b)
		if hex.EncodeToString(sum[:]) != want[name] {
			return nil, "", fmt.Errorf("workload: text/%s is not the file SHA256SUMS lists", name)
		}
		title, body, _ := strings.Cut(string(b), "\n\n")
		d := textDoc{name: e.Name(), title: strings.TrimPrefix(title, "# "), text: strings.TrimSpace(body)}
		for _, s := range sentence.FindAllString(d.text, -1) {
			if s = strings.TrimSpace(s); len(s) > 60 && len(s) < 300 {
				d.sentences = append(d.sentences, s)
			}
		}
		for _, m := range term.FindAllStringSubmatch(d.text, -1) {
			if !slices.Contains(d.terms, m[1]) {
				d.terms = append(d.terms, m[1])
			}
		}
		if len(d.sentences) == 0 || len(d.terms) == 0 {
			return nil, "", fmt.Errorf("workload: text/%s has no sentence or term to ask about", name)
		}
		docs = append(docs, d)
	}
	sum := sha256.Sum256(sums)
	return docs, hex.EncodeToString(sum[:]), nil
}

// chatTokens counts a chat's tokens as the gateway makes them.
type chatTokens func(msgs []textMessage) ([]uint32, error)

// genTextWorkload builds the workload of seed with tok (the model's
// tokenizer, the gateway's chat layout).
func genTextWorkload(seed uint64, tok chatTokens, model string) (*textWorkload, error) {
	docs, corpus, err := loadTextCorpus(textFS)
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(seed, 0x6b767370))
	// Popularity: a Zipf law (s = 1) over the documents in a seeded order.
	rank := rng.Perm(len(docs))
	weights := make([]float64, len(docs))
	var total float64
	for i, r := range rank {
		weights[i] = 1 / float64(r+1)
		total += weights[i]
	}
	pick := func(not int) int {
		for {
			x := rng.Float64() * total
			for i, w := range weights {
				if x -= w; x < 0 {
					if i != not {
						return i
					}
					break
				}
			}
		}
	}
	w := &textWorkload{Generator: fmt.Sprintf("kvsp workload text --seed %d", seed), Corpus: corpus, Tokenizer: model,
		BlockTokens: textBlockTokens, System: textSystem}
	for _, d := range docs {
		w.Documents = append(w.Documents, d.name)
	}
	at := 0.0
	for conv := 0; len(w.Requests) < textRequests; conv++ {
		// The first turn: one retrieved document, or two when one is short
		// of the minimum prompt.
		first := pick(-1)
		chosen := []int{first}
		ask := func(ds []int) []textMessage {
			var s strings.Builder
			s.WriteString("Documents:\n")
			for _, d := range ds {
				fmt.Fprintf(&s, "\n## %s\n\n%s\n", docs[d].title, docs[d].text)
			}
			q := textQuestions[rng.IntN(len(textQuestions))]
			fmt.Fprintf(&s, "\nQuestion: "+q, docs[ds[0]].title)
			return []textMessage{{"system", textSystem}, {"user", s.String()}}
		}
		msgs := ask(chosen)
		toks, err := tok(msgs)
		if err != nil {
			return nil, err
		}
		if len(toks) < textMinPrompt || rng.IntN(4) == 0 {
			chosen = append(chosen, pick(first))
			msgs = ask(chosen)
			if toks, err = tok(msgs); err != nil {
				return nil, err
			}
		}
		if len(toks) < textMinPrompt || len(toks) > textMaxPrompt {
			continue // drawn again
		}
		at += rng.ExpFloat64() * textStartMeanS
		names := make([]string, len(chosen))
		for i, d := range chosen {
			names[i] = docs[d].name
		}
		q := textRequest{ID: len(w.Requests), Conversation: conv, AtS: math.Round(at*1000) / 1000, Documents: names, MaxTokens: textAnswer, Messages: msgs, PromptTokens: len(toks)}
		w.Requests = append(w.Requests, q)
		// Follow-ups, each with probability 0.55 while the chat fits: the
		// previous answer is a sentence of the document, fixed here.
		for turn := 1; turn <= 3 && len(w.Requests) < textRequests && rng.Float64() < 0.55; turn++ {
			d := docs[chosen[rng.IntN(len(chosen))]]
			answer := "According to the document: " + d.sentences[rng.IntN(len(d.sentences))]
			follow := fmt.Sprintf(textFollowUps[rng.IntN(len(textFollowUps))], "`"+d.terms[rng.IntN(len(d.terms))]+"`")
			next := append(slices.Clone(msgs), textMessage{"assistant", answer}, textMessage{"user", follow})
			if toks, err = tok(next); err != nil {
				return nil, err
			}
			if len(toks) > textMaxPrompt {
				break
			}
			prev := len(w.Requests) - 1
			msgs = next
			w.Requests = append(w.Requests, textRequest{ID: len(w.Requests), Conversation: conv, Turn: turn, After: &prev,
				ThinkS: math.Round((textThinkS+rng.Float64()*textThinkSpanS)*1000) / 1000, Documents: names, MaxTokens: textAnswer, Messages: msgs, PromptTokens: len(toks)})
		}
	}
	if err := w.bound(tok); err != nil {
		return nil, err
	}
	return w, nil
}

// bound fills each request's and the workload's infinite-cache hits: the
// complete leading blocks of a prompt whose Block Keys an earlier
// request's prompt had (the one scope of every request).
func (w *textWorkload) bound(tok chatTokens) error {
	key, err := kvsp.NewScopeKey(bytes.Repeat([]byte{7}, 32))
	if err != nil {
		return err
	}
	seen := map[kvsp.BlockKey]bool{}
	w.PromptTokens, w.BoundTokens = 0, 0
	for i := range w.Requests {
		q := &w.Requests[i]
		toks, err := tok(q.Messages)
		if err != nil {
			return err
		}
		if len(toks) != q.PromptTokens {
			return fmt.Errorf("workload: request %d has %d prompt tokens by this tokenizer, the file says %d", q.ID, len(toks), q.PromptTokens)
		}
		keys, err := kvsp.BlockKeys(key, kvsp.CompatID{}, w.BlockTokens, toks)
		if err != nil {
			return err
		}
		n := 0
		for n < len(keys) && seen[keys[n]] {
			n++
		}
		q.BoundTokens = n * w.BlockTokens
		for _, k := range keys {
			seen[k] = true
		}
		w.PromptTokens += int64(q.PromptTokens)
		w.BoundTokens += int64(q.BoundTokens)
	}
	w.Blocks = len(seen)
	w.Bound = math.Round(float64(w.BoundTokens)/float64(w.PromptTokens)*1e4) / 1e4
	return nil
}

// followUps is the number of requests that follow an answer.
func (w *textWorkload) followUps() int {
	n := 0
	for _, q := range w.Requests {
		if q.After != nil {
			n++
		}
	}
	return n
}

// check holds the workload to its fixed parameters, the system prompt
// counted by tok.
func (w *textWorkload) check(tok chatTokens) error {
	docs := map[string]bool{}
	for _, q := range w.Requests {
		if q.PromptTokens < textMinPrompt || q.PromptTokens > textMaxPrompt {
			return fmt.Errorf("workload: request %d has a prompt of %d tokens (want %d to %d)", q.ID, q.PromptTokens, textMinPrompt, textMaxPrompt)
		}
		for _, d := range q.Documents {
			docs[d] = true
		}
	}
	sys, err := tok([]textMessage{{"system", w.System}})
	if err != nil {
		return err
	}
	follow, mean := w.followUps(), float64(w.PromptTokens)/float64(max(1, len(w.Requests)))
	switch {
	case len(w.Requests) < 60:
		return fmt.Errorf("workload: %d requests (want 60 or more)", len(w.Requests))
	case follow*4 < len(w.Requests):
		return fmt.Errorf("workload: %d follow-ups of %d requests (want a quarter or more)", follow, len(w.Requests))
	case len(docs) < 10:
		return fmt.Errorf("workload: %d documents asked about (want 10 or more)", len(docs))
	case float64(len(sys))*4 > mean:
		return fmt.Errorf("workload: the system prompt is %d tokens, more than a quarter of the mean prompt (%.0f)", len(sys), mean)
	}
	return nil
}

// smolLM2Path is the GGUF of SmolLM2-135M-Instruct: flag, KVSP_SMOLLM2,
// or make deps' .cache/models.
func smolLM2Path(flagValue string) (string, error) {
	p := flagValue
	if p == "" {
		p = os.Getenv("KVSP_SMOLLM2")
	}
	if p == "" {
		p = filepath.Join(".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
	}
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("SmolLM2 is not at %s (make deps installs it; --model FILE.gguf or KVSP_SMOLLM2 names another place)", p)
	}
	return p, nil
}

// vocabTokens is the gateway's chat layout of the model at gguf.
func vocabTokens(gguf string) (chatTokens, string, func(), error) {
	v, err := llamacpp.OpenVocabulary(gguf, llamaLibrary(), llamacpp.DescribeOptions{BlockTokens: textBlockTokens})
	if err != nil {
		return nil, "", nil, err
	}
	return func(msgs []textMessage) ([]uint32, error) {
		m := make([]llamacpp.Message, len(msgs))
		for i, x := range msgs {
			m[i] = llamacpp.Message{Role: x.Role, Content: x.Content}
		}
		return v.Chat(m)
	}, v.Descriptor().Model, v.Close, nil
}

// loadTextWorkload reads a workload file, or the embedded one when path
// is empty.
func loadTextWorkload(p string) (*textWorkload, error) {
	var b []byte
	var err error
	if p == "" {
		b, err = textFS.ReadFile("text/workload.json")
	} else {
		b, err = os.ReadFile(p)
	}
	if err != nil {
		return nil, err
	}
	var w textWorkload
	if err := json.Unmarshal(b, &w); err != nil {
		return nil, fmt.Errorf("workload %s: %w", p, err)
	}
	return &w, nil
}

// cmdWorkload: kvsp workload text [--seed N] [--out FILE] [--model GGUF].
func cmdWorkload(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "text" {
		return usageError("workload takes text [--seed N] [--out FILE] [--model FILE.gguf]")
	}
	fl := flag.NewFlagSet("workload text", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	seed := fl.Uint64("seed", 1, "the generator's seed")
	out := fl.String("out", "", "the workload file (default: standard output)")
	model := fl.String("model", "", "SmolLM2-135M-Instruct's GGUF, whose tokenizer counts (default: KVSP_SMOLLM2, or .cache/models)")
	if err := fl.Parse(args[1:]); err != nil || fl.NArg() != 0 {
		return usageError("workload text takes [--seed N] [--out FILE] [--model FILE.gguf]")
	}
	gguf, err := smolLM2Path(*model)
	if err != nil {
		return err
	}
	tok, name, closeVocab, err := vocabTokens(gguf)
	if err != nil {
		return err
	}
	defer closeVocab()
	w, err := genTextWorkload(*seed, tok, name)
	if err != nil {
		return err
	}
	if err := w.check(tok); err != nil {
		return err
	}
	b, err := json.MarshalIndent(w, "", " ")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	if *out == "" {
		_, err = stdout.Write(b)
	} else {
		err = os.WriteFile(*out, b, 0o644)
	}
	fmt.Fprintf(stderr, "%d requests (%d follow-ups), %d prompt tokens, %d distinct %d-token blocks, infinite-cache bound %.4f\n",
		len(w.Requests), w.followUps(), w.PromptTokens, w.Blocks, w.BlockTokens, w.Bound)
	return err
}

package llamacpp

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/hybridgroup/yzma/pkg/llama"

	"github.com/kvsp/kvsp"
)

// MaxText bounds the octets of one text Tokenize takes (llama_tokenize
// counts in int32; a gateway bounds its bodies far below).
const MaxText = 16 << 20

// ErrText is the error of a text that cannot be tokenized as given.
var ErrText = errors.New("llamacpp: text")

// Vocabulary is a model's tokenizer and chat template, loaded without its
// weights (llama.cpp's vocab_only): what a front end needs to turn text
// into the model's tokens and tokens back into text, in milliseconds and
// a few MB. Its methods may be called concurrently.
type Vocabulary struct {
	model    llama.Model
	vocab    llama.Vocab
	n        int
	eog      []bool
	template string
	desc     kvsp.Descriptor
}

// OpenVocabulary loads the tokenizer of the GGUF model at path (the
// library from dir, as LoadLibrary checks it), and derives the model's
// descriptor as the engine does, so that a front end and the engines
// agree on the model.
func OpenVocabulary(path, dir string, o DescribeOptions) (*Vocabulary, error) {
	info, err := Describe(path, o)
	if err != nil {
		return nil, err
	}
	if err := LoadLibrary(dir); err != nil {
		return nil, err
	}
	mp := llama.ModelDefaultParams()
	mp.NGpuLayers = 0
	mp.VocabOnly = 1
	m, err := llama.ModelLoadFromFile(path, mp)
	if err != nil || m == 0 {
		return nil, fmt.Errorf("llamacpp: llama.cpp could not load the vocabulary of %s (%v)", path, err)
	}
	v := &Vocabulary{model: m, vocab: llama.ModelGetVocab(m), desc: info.Descriptor}
	if v.n = int(llama.VocabNTokens(v.vocab)); v.n != info.Vocab {
		llama.ModelFree(m)
		return nil, fmt.Errorf("llamacpp: llama.cpp reads a vocabulary of %d tokens, the metadata says %d", v.n, info.Vocab)
	}
	v.eog = make([]bool, v.n)
	for t := range v.n {
		v.eog[t] = llama.VocabIsEOG(v.vocab, llama.Token(t))
	}
	v.template = llama.ModelChatTemplate(m, "")
	return v, nil
}

// Close frees the vocabulary.
func (v *Vocabulary) Close() { llama.ModelFree(v.model) }

// Descriptor is the model's descriptor, as the engine derives it.
func (v *Vocabulary) Descriptor() kvsp.Descriptor { return v.desc }

// Size is the number of tokens in the vocabulary.
func (v *Vocabulary) Size() int { return v.n }

// IsEOG reports a token that ends a generation.
func (v *Vocabulary) IsEOG(t uint32) bool { return int(t) < v.n && v.eog[t] }

// HasTemplate reports whether the model carries a chat template.
func (v *Vocabulary) HasTemplate() bool { return v.template != "" }

// Tokenize returns the tokens of text. With special false (text from a
// user), text that spells a special token ("<|im_start|>") is tokenized
// as the characters it is, never as that token; special true is for the
// template's own markup. first adds the tokens the vocabulary puts at the
// start of a sequence (BOS, where the model wants one).
func (v *Vocabulary) Tokenize(text string, special, first bool) ([]uint32, error) {
	switch {
	case len(text) > MaxText:
		return nil, fmt.Errorf("%w: %d octets, more than %d", ErrText, len(text), MaxText)
	case strings.IndexByte(text, 0) >= 0:
		return nil, fmt.Errorf("%w: a NUL character", ErrText) // the binding passes C strings
	case !utf8.ValidString(text):
		return nil, fmt.Errorf("%w: not valid UTF-8", ErrText)
	case text == "" && !first:
		return []uint32{}, nil
	}
	toks := llama.Tokenize(v.vocab, text, first, special)
	out := make([]uint32, len(toks))
	for i, t := range toks {
		if t < 0 || int(t) >= v.n {
			return nil, fmt.Errorf("llamacpp: the tokenizer returned token %d, outside the vocabulary", t)
		}
		out[i] = uint32(t)
	}
	return out, nil
}

// Piece returns the octets token t stands for in output text (empty for a
// control token); a multi-octet character may be split across pieces.
func (v *Vocabulary) Piece(t uint32) []byte {
	if int(t) >= v.n {
		return nil
	}
	buf := make([]byte, 64)
	n := llama.TokenToPiece(v.vocab, llama.Token(t), buf, 0, false)
	if n < 0 { // the piece is longer: -n octets
		buf = make([]byte, -n)
		n = llama.TokenToPiece(v.vocab, llama.Token(t), buf, 0, false)
	}
	if n <= 0 {
		return nil
	}
	return buf[:n]
}

// Message is one message of a chat: Role is system, user or assistant.
type Message struct {
	Role, Content string
}

// Chat returns the tokens of a chat as the model's chat template lays it
// out, as llama.cpp applies it (llama_chat_apply_template, which
// recognises the template and formats with its own code), with the
// assistant's turn opened at the end. The template's markup is tokenized
// with special tokens parsed; the contents, which come from users,
// without: a user typing "<|im_start|>system" writes text, not a turn.
func (v *Vocabulary) Chat(msgs []Message) ([]uint32, error) {
	if v.template == "" {
		return nil, errors.New("llamacpp: the model has no chat template")
	}
	if len(msgs) == 0 {
		return nil, fmt.Errorf("%w: a chat of no messages", ErrText)
	}
	// Each content is replaced by a marker the template copies as it is;
	// the layout is then cut at the markers.
	chat := make([]llama.ChatMessage, len(msgs))
	markers := make([]string, len(msgs))
	for i, m := range msgs {
		switch {
		case m.Role != "system" && m.Role != "user" && m.Role != "assistant":
			return nil, fmt.Errorf("%w: role %q: want system, user or assistant", ErrText, m.Role)
		case strings.ContainsRune(m.Content, 0x1f):
			return nil, fmt.Errorf("%w: a message holds the control character U+001F", ErrText)
		}
		markers[i] = "\x1fkvsp:" + strconv.Itoa(i) + "\x1f"
		chat[i] = llama.NewChatMessage(m.Role, markers[i])
	}
	buf := make([]byte, 4096+64*len(msgs))
	n := llama.ChatApplyTemplate(v.template, chat, true, buf)
	if n > int32(len(buf)) {
		buf = make([]byte, n)
		n = llama.ChatApplyTemplate(v.template, chat, true, buf)
	}
	if n < 0 || n > int32(len(buf)) {
		return nil, errors.New("llamacpp: llama.cpp does not apply this model's chat template")
	}
	layout := string(buf[:n])
	var out []uint32
	for i, mk := range markers {
		j := strings.Index(layout, mk)
		if j < 0 {
			return nil, errors.New("llamacpp: the chat template does not lay out every message as it is")
		}
		markup, err := v.Tokenize(layout[:j], true, i == 0)
		if err != nil {
			return nil, err
		}
		content, err := v.Tokenize(msgs[i].Content, false, false)
		if err != nil {
			return nil, err
		}
		out = append(append(out, markup...), content...)
		layout = layout[j+len(mk):]
	}
	rest, err := v.Tokenize(layout, true, false)
	if err != nil {
		return nil, err
	}
	return append(out, rest...), nil
}

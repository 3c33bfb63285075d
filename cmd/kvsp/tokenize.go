package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/kvsp/kvsp/engine/llamacpp"
)

// cmdModelTokenize prints the token ids of a text, or of a chat laid out
// by the model's template, as the gateway makes them (llama.cpp's
// tokenizer, loaded without the weights): for tools that call place and
// generate with the tokens a gateway request would have.
func cmdModelTokenize(args []string, stdin io.Reader, stdout io.Writer) error {
	fl := flag.NewFlagSet("model tokenize", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	chat := fl.Bool("chat", false, "standard input is a JSON array of {role, content} messages, laid out by the model's chat template")
	lib := fl.String("library", llamacpp.DefaultLibraryDir(), "llama.cpp's directory")
	var file string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		file, args = args[0], args[1:]
	}
	if err := fl.Parse(args); err != nil || file == "" || fl.NArg() != 0 {
		return usageError("model tokenize takes FILE.gguf [--chat] [--library DIR], the text (or messages) on standard input")
	}
	in, err := io.ReadAll(io.LimitReader(stdin, llamacpp.MaxText+1))
	if err != nil {
		return err
	}
	v, err := llamacpp.OpenVocabulary(file, *lib, llamacpp.DescribeOptions{BlockTokens: 16})
	if err != nil {
		return err
	}
	defer v.Close()
	var toks []uint32
	if *chat {
		var msgs []llamacpp.Message
		var raw []struct{ Role, Content string }
		if err := json.Unmarshal(in, &raw); err != nil {
			return fmt.Errorf("messages: %w", err)
		}
		for _, m := range raw {
			msgs = append(msgs, llamacpp.Message{Role: m.Role, Content: m.Content})
		}
		toks, err = v.Chat(msgs)
	} else {
		toks, err = v.Tokenize(string(in), false, true)
	}
	if err != nil {
		return err
	}
	if toks == nil {
		toks = []uint32{}
	}
	b, _ := json.Marshal(toks)
	_, err = fmt.Fprintf(stdout, "%s\n", b)
	return err
}

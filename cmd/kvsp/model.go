package main

import (
	"bufio"
	"crypto/sha256"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvsp/kvsp/engine/llamacpp"
	"github.com/kvsp/kvsp/internal/gguf"
)

// cmdModel dispatches the model subcommands, which work on GGUF model files.
func cmdModel(args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return usageError("model takes tiny, descriptor or tokenize")
	}
	switch args[0] {
	case "tiny":
		return cmdModelTiny(args[1:], stdout)
	case "descriptor":
		return cmdModelDescriptor(args[1:], stdout)
	case "tokenize":
		return cmdModelTokenize(args[1:], os.Stdin, stdout)
	default:
		return usageError("model takes tiny, descriptor or tokenize, not %q", args[0])
	}
}

// cmdModelDescriptor prints the Compatibility Descriptor of a GGUF model
// as engine/llamacpp derives it (no library is loaded), for holders' and
// controllers' descriptors lists and an instance's engine.descriptor, in
// its canonical JSON (JCS) form.
func cmdModelDescriptor(args []string, stdout io.Writer) error {
	fl := flag.NewFlagSet("model descriptor", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	bt := fl.Int("block-tokens", 16, "block_tokens")
	name := fl.String("name", "", "the model's name, for a GGUF without general.name")
	kvType := fl.String("kv-type", "f16", "the cache type the engine runs with")
	var file string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		file, args = args[0], args[1:]
	}
	if err := fl.Parse(args); err != nil || file == "" || fl.NArg() != 0 {
		return usageError("model descriptor takes FILE.gguf [--block-tokens N] [--name S] [--kv-type f16|bf16|f32]")
	}
	info, err := llamacpp.Describe(file, llamacpp.DescribeOptions{Name: *name, BlockTokens: *bt, KVType: *kvType})
	if err != nil {
		return err
	}
	b, err := info.Descriptor.JCS()
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "%s\n", b)
	return err
}

// cmdModelTiny writes the deterministic random-weight llama GGUF of
// gguf.WriteTinyLlama and prints its path, size and SHA-256.
func cmdModelTiny(args []string, stdout io.Writer) error {
	d := gguf.DefaultTiny()
	fl := flag.NewFlagSet("model tiny", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	out := fl.String("out", "", "the GGUF file to write (replaced atomically)")
	p := d
	fl.StringVar(&p.Name, "name", d.Name, "general.name")
	fl.IntVar(&p.Layers, "layers", d.Layers, "blocks")
	fl.IntVar(&p.Embd, "embd", d.Embd, "embedding width")
	fl.IntVar(&p.Heads, "heads", d.Heads, "attention heads")
	fl.IntVar(&p.KVHeads, "kv-heads", d.KVHeads, "KV heads")
	fl.IntVar(&p.FF, "ff", d.FF, "feed-forward width")
	fl.IntVar(&p.Vocab, "vocab", d.Vocab, "vocabulary size")
	fl.IntVar(&p.Context, "context", d.Context, "training context length")
	fl.Uint64Var(&p.Seed, "seed", d.Seed, "weights seed")
	if err := fl.Parse(args); err != nil || *out == "" || fl.NArg() != 0 {
		return usageError("model tiny takes --out FILE [--layers N --embd N --heads N --kv-heads N --ff N --vocab N --context N --seed N --name S]")
	}
	if err := p.Validate(); err != nil {
		return err
	}
	h := sha256.New()
	n, err := writeAtomic(*out, func(w io.Writer) error { return gguf.WriteTinyLlama(io.MultiWriter(w, h), p) })
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "%s: %d octets, sha256 %x\n", *out, n, h.Sum(nil))
	return err
}

// writeAtomic writes path through a temporary file in its directory,
// synced and renamed into place, so that path is either its old content or
// the whole new one. It returns the octets written.
func writeAtomic(path string, write func(io.Writer) error) (n int64, err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return 0, err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	cw := &countingWriter{w: tmp}
	bw := bufio.NewWriterSize(cw, 1<<20)
	if err := write(bw); err != nil {
		return 0, err
	}
	if err := bw.Flush(); err != nil {
		return 0, err
	}
	if err := tmp.Chmod(0o644); err != nil {
		return 0, err
	}
	if err := tmp.Sync(); err != nil {
		return 0, err
	}
	if err := tmp.Close(); err != nil {
		return 0, err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return 0, err
	}
	return cw.n, nil
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unicode"

	"github.com/kvsp/kvsp"
)

const usage = `kvsp: the KV Cache Storage Protocol toolkit

Usage:
  kvsp serve --config FILE            serve every role the configuration names (SIGTERM: clean exit;
                                      SIGHUP: reload the policy; certificates reload when their files change)
  kvsp certs --config FILE            write a development CA, this process's certificate (one identity for
                                      all its roles), a client certificate, missing scope keys and the policy
  kvsp keys new FILE                  write a new 32-octet scope key (mode 0600); print its scope_id
  kvsp keys scope FILE                print the scope_id of a scope key file
  kvsp keys compat [-jcs] FILE        print the Compatibility ID of a descriptor (or its JCS form)
  kvsp keys blocks --scope-key FILE --descriptor FILE TOKENS
                                      print the Block Keys of a token file (JSON array or whitespace-separated)
  kvsp keys api --principal NAME --scope SCOPE_ID --out FILE
                                      mint a gateway API key into FILE (0600); print its policy entry (SHA-256)
  kvsp digest model DIR               print model_digest of a model directory
  kvsp digest file FILE               print the digest of one file (tokenizer, adapter)
  kvsp model tiny --out FILE [flags]  write a deterministic random-weight llama GGUF (1.3 MB by default;
                                      flags --layers --embd --heads --kv-heads --ff --vocab --context --seed --name)
  kvsp model descriptor FILE.gguf [--block-tokens N] [--name S] [--kv-type f16|bf16|f32]
                                      print the Compatibility Descriptor the llamacpp engine derives from a GGUF
  kvsp model tokenize FILE.gguf [--chat]
                                      print the token ids of standard input (a text, or --chat a JSON array of
                                      messages laid out by the model's template), as the gateway makes them
  kvsp inspect --descriptor FILE [--repr-digest V] BLOCK
                                      decode and verify a KVB1 file: header, digests, layer table
  kvsp fetch --cert F --key F --ca F --descriptor F [--server-identity URI] [--layers a-b] [-o FILE] URL
                                      GET a block with the Go client over mutual TLS, verify each layer and
                                      its Repr-Digest, write the container
  kvsp bench [flags]                  the layer-streaming benchmark: verified block GETs per transport,
                                      block size, layer range and stream count; table, JSON and PNG
                                      (kvsp bench -h lists the flags)
  kvsp replay --config FILE [flags]   replay a trace against a running deployment through its PC: hit ratio
                                      against the infinite-cache bound, TTFT; JSON and PNG
  kvsp demo [flags]                   the whole system in one process on loopback (gateway, IS, PC, holders,
                                      llama.cpp instances on SmolLM2, mutual TLS) replaying chats about kvsp's
                                      documentation through the OpenAI API in three modes (kvsp, local, none),
                                      or --workload trace the Mooncake trace; table, JSON and PNG (-h: flags)
  kvsp workload text [--seed N] [--out FILE] [--model FILE.gguf]
                                      write the demo's text workload (the chats, their prompt lengths and the
                                      infinite-cache bound, counted by SmolLM2's tokenizer)
`

// run executes one command line and returns the exit status: 0 success,
// 1 failure, 2 usage error.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		fmt.Fprint(stdout, usage)
		return 0
	}
	var err error
	switch args[0] {
	case "serve":
		err = cmdServe(args[1:], stdout, stderr)
	case "certs":
		err = cmdCerts(args[1:], stdout)
	case "inspect":
		err = cmdInspect(args[1:], stdout)
	case "digest":
		err = cmdDigest(args[1:], stdout)
	case "model":
		err = cmdModel(args[1:], stdout)
	case "keys":
		err = cmdKeys(args[1:], stdout)
	case "fetch":
		err = cmdFetch(args[1:], stdout)
	case "bench":
		err = cmdBench(args[1:], stdout, stderr)
	case "replay":
		err = cmdReplay(args[1:], stdout, stderr)
	case "demo":
		err = cmdDemo(args[1:], stdout, stderr)
	case "workload":
		err = cmdWorkload(args[1:], stdout, stderr)
	default:
		err = usageError("unknown command %q", args[0])
	}
	var ue usageErr
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "kvsp: %v\n\n%s", err, usage)
		return 2
	default:
		fmt.Fprintf(stderr, "kvsp: %v\n", err)
		return 1
	}
}

type usageErr struct{ msg string }

func (e usageErr) Error() string { return e.msg }

func usageError(format string, args ...any) error { return usageErr{fmt.Sprintf(format, args...)} }

func cmdCompat(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("compat", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	printJCS := fs.Bool("jcs", false, "print the canonical JSON instead of the ID")
	if err := fs.Parse(args); err != nil || fs.NArg() != 1 {
		return usageError("compat takes [-jcs] and one descriptor file")
	}
	data, err := os.ReadFile(fs.Arg(0))
	if err != nil {
		return err
	}
	d, err := kvsp.ParseDescriptor(data)
	if err != nil {
		return err
	}
	if *printJCS {
		j, err := d.JCS()
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(stdout, "%s\n", j)
		return err
	}
	id, err := d.CompatID()
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(stdout, id)
	return err
}

func cmdDigest(args []string, stdout io.Writer) error {
	if len(args) != 2 {
		return usageError("digest takes model DIR or file FILE")
	}
	var (
		d   kvsp.Digest
		err error
	)
	switch args[0] {
	case "model":
		d, err = kvsp.ModelDigest(os.DirFS(args[1]))
	case "file":
		dir, name := filepath.Split(filepath.Clean(args[1]))
		if dir == "" {
			dir = "."
		}
		d, err = kvsp.FileDigest(os.DirFS(dir), name)
	default:
		return usageError("digest takes model DIR or file FILE")
	}
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(stdout, d)
	return err
}

func cmdKeys(args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return usageError("keys takes new, scope, compat, blocks or api")
	}
	switch args[0] {
	case "compat":
		return cmdCompat(args[1:], stdout)
	case "blocks":
		return cmdBlockKeys(args[1:], stdout)
	case "api":
		return cmdAPIKey(args[1:], stdout)
	}
	if len(args) != 2 {
		return usageError("keys %s takes one file", args[0])
	}
	switch args[0] {
	case "new":
		k, err := kvsp.GenerateScopeKey()
		if err != nil {
			return err
		}
		f, err := os.OpenFile(args[1], os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		if _, err := f.Write(k.Export()); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		_, err = fmt.Fprintln(stdout, k.ID())
		return err
	case "scope", "id":
		data, err := os.ReadFile(args[1])
		if err != nil {
			return err
		}
		k, err := kvsp.ScopeKeyFromFile(data)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(stdout, k.ID())
		return err
	}
	return usageError("keys takes new, scope, compat or blocks")
}

// cmdBlockKeys prints the Block Key of every complete block of a token
// file, one per line, in prefix order.
func cmdBlockKeys(args []string, stdout io.Writer) error {
	fl := flag.NewFlagSet("keys blocks", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	keyPath := fl.String("scope-key", "", "scope key file")
	descPath := fl.String("descriptor", "", "descriptor file")
	if err := fl.Parse(args); err != nil || *keyPath == "" || *descPath == "" || fl.NArg() != 1 {
		return usageError("keys blocks takes --scope-key FILE --descriptor FILE TOKENS")
	}
	kd, err := os.ReadFile(*keyPath)
	if err != nil {
		return err
	}
	key, err := kvsp.ScopeKeyFromFile(kd)
	if err != nil {
		return err
	}
	d, err := loadDescriptor(*descPath)
	if err != nil {
		return err
	}
	compat, err := d.CompatID()
	if err != nil {
		return err
	}
	td, err := os.ReadFile(fl.Arg(0))
	if err != nil {
		return err
	}
	toks, err := parseTokens(td)
	if err != nil {
		return err
	}
	keys, err := kvsp.BlockKeys(key, compat, d.BlockTokens, toks)
	if err != nil {
		return err
	}
	for _, k := range keys {
		fmt.Fprintln(stdout, k)
	}
	return nil
}

// parseTokens reads token ids as a JSON array or whitespace-separated
// decimal integers, each 0..2^32-1.
func parseTokens(data []byte) ([]uint32, error) {
	text := strings.TrimSpace(string(data))
	text = strings.TrimSuffix(strings.TrimPrefix(text, "["), "]")
	var out []uint32
	for _, f := range strings.FieldsFunc(text, func(r rune) bool { return r == ',' || unicode.IsSpace(r) }) {
		v, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("tokens: %q is not a token id (0..2^32-1)", f)
		}
		out = append(out, uint32(v))
	}
	return out, nil
}

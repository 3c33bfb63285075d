package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/kvsp/kvsp"
)

const usage = `kvsp: the KV Cache Storage Protocol toolkit

Usage:
  kvsp compat [-jcs] DESCRIPTOR.json   print the Compatibility ID (or the JCS form)
  kvsp digest model DIR                print model_digest of a model directory
  kvsp digest file FILE                print the digest of one file (tokenizer, adapter)
  kvsp keys new FILE                   write a new 32-octet scope key (mode 0600), print its scope_id
  kvsp keys id FILE                    print the scope_id of a scope key file
  kvsp demo                            the whole system in one command (not built yet)
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
	case "compat":
		err = cmdCompat(args[1:], stdout)
	case "digest":
		err = cmdDigest(args[1:], stdout)
	case "keys":
		err = cmdKeys(args[1:], stdout)
	case "demo":
		err = errors.New("demo is not built yet: it lands with issue 11; nothing was run")
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
	if len(args) != 2 {
		return usageError("keys takes new FILE or id FILE")
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
	case "id":
		data, err := os.ReadFile(args[1])
		if err != nil {
			return err
		}
		k, err := kvsp.ParseScopeKey(data)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(stdout, k.ID())
		return err
	}
	return usageError("keys takes new FILE or id FILE")
}

// Command kvsp is the one binary of the project: `kvsp help` lists its
// subcommands. This file stays thin; the commands live in cli.go.
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

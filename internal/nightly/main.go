// Command nightly reads the -v logs of the reliability targets (make
// chaos, make soak, make sim) into results and reports, so that the
// figures docs/reliability.md quotes come from a run and cannot drift from it.
//
//	nightly verdict -stage chaos -status $? -start T LOG...
//	    the stage's result from its log, written to bin/<stage>.json, and
//	    its verdict as the last line: "chaos: ok: ..." or "chaos: FAILED:
//	    B6 (TestB6_...)"; exits 1 if the stage failed.
//	nightly report -out bin STAGE.json...
//	    one dated report of the stages (nightly-<date>.json and .md) in
//	    out; exits 1 naming the failed stages if any failed.
//	nightly install REPORT.json
//	    copies the report to docs/nightly/ and rewrites docs/reliability.md's
//	    "Last full run" section from it (TestDocQuotesTheReport checks
//	    the two agree).
//
// make nightly runs the three stages in sequence and then report.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "verdict":
		err = verdictCmd(os.Args[2:])
	case "report":
		err = reportCmd(os.Args[2:])
	case "install":
		err = installCmd(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: nightly verdict -stage NAME -status N -start UNIX LOG... | report -out DIR STAGE.json... | install REPORT.json")
	os.Exit(2)
}

// errFailed is returned after the failure was printed as the last line.
type errFailed struct{ line string }

func (e errFailed) Error() string { return e.line }

func verdictCmd(args []string) error {
	fs := flag.NewFlagSet("verdict", flag.ExitOnError)
	stage := fs.String("stage", "", "the stage's name (chaos, soak, sim)")
	command := fs.String("command", "", "the command the stage ran, for the report")
	status := fs.Int("status", 0, "the exit status of the stage's go test commands (the first non-zero)")
	start := fs.Int64("start", 0, "when the stage began, Unix seconds")
	out := fs.String("out", "bin", "where the stage's result is written")
	fs.Parse(args)
	if *stage == "" || fs.NArg() == 0 {
		usage()
	}
	st := Stage{Name: *stage, Command: *command, Status: *status}
	for _, p := range fs.Args() {
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		err = st.parse(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %v", p, err)
		}
	}
	if *start > 0 {
		st.setTime(time.Since(time.Unix(*start, 0)))
	}
	st.finish()
	if err := writeJSON(filepath.Join(*out, *stage+".json"), st); err != nil {
		return err
	}
	line := st.Verdict()
	if !st.OK {
		return errFailed{line}
	}
	fmt.Println(line)
	return nil
}

func reportCmd(args []string) error {
	fs := flag.NewFlagSet("report", flag.ExitOnError)
	out := fs.String("out", "bin", "where the report is written")
	fs.Parse(args)
	r, err := newReport(fs.Args())
	if err != nil {
		return err
	}
	base := filepath.Join(*out, "nightly-"+r.Date[:10])
	if err := writeJSON(base+".json", r); err != nil {
		return err
	}
	md := r.Markdown()
	if err := os.WriteFile(base+".md", []byte(md), 0o644); err != nil {
		return err
	}
	fmt.Print(md)
	fmt.Printf("report: %s.json, %s.md\n", base, base)
	if line := r.Verdict(); !r.OK() {
		return errFailed{line}
	} else {
		fmt.Println(line)
	}
	return nil
}

func installCmd(args []string) error {
	if len(args) != 1 {
		usage()
	}
	var r Report
	if err := readJSON(args[0], &r); err != nil {
		return err
	}
	if !r.OK() {
		return fmt.Errorf("nightly: %s: %s; a failed run is not installed", args[0], r.Verdict())
	}
	root, err := repoRoot()
	if err != nil {
		return err
	}
	if err := writeJSON(filepath.Join(root, reportPath), r); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(root, "docs/nightly/report.md"), []byte(r.Markdown()), 0o644); err != nil {
		return err
	}
	doc := filepath.Join(root, reliabilityDoc)
	b, err := os.ReadFile(doc)
	if err != nil {
		return err
	}
	nb, err := replaceSection(string(b), r.DocSection())
	if err != nil {
		return err
	}
	return os.WriteFile(doc, []byte(nb), 0o644)
}

// reportPath is the committed copy of the last report, from the
// repository's root.
const reportPath = "docs/nightly/report.json"

// reliabilityDoc is the page whose "Last full run" section install
// rewrites, from the repository's root.
const reliabilityDoc = "docs/reliability.md"

func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("nightly: no go.mod above %s", dir)
		}
	}
}

// Command mutants checks that each reliability row's test fails when the
// mechanism the row protects is removed (issue 22): every mutation of
// mutants.yaml (a file, the code it changes, the row it belongs to, the
// row's own test) is applied alone to a scratch copy of the working tree,
// and the row's test must then fail. A mutation whose code is not found
// exactly once, or whose copy does not build, proves nothing and fails
// the run, as does a row's test that fails unmutated. It reports each
// mutation killed or survived, the reliability page's rows (docs/reliability.md) that no
// mutation covers, writes bin/mutants.json, and exits non-zero unless
// every mutation was killed and every row covered.
//
//	go run ./internal/mutants [-rows B2,S8] [-list internal/mutants/mutants.yaml]
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

type mutation struct {
	Row  string `yaml:"row" json:"row"`
	File string `yaml:"file" json:"file"`
	What string `yaml:"what" json:"what"`
	Old  string `yaml:"old" json:"-"`
	New  string `yaml:"new" json:"-"`
	Pkg  string `yaml:"pkg" json:"pkg"`
	Run  string `yaml:"run" json:"run"`
	// Env is added to the test's environment (KEY=value).
	Env []string `yaml:"env" json:"env,omitempty"`

	Result  string  `yaml:"-" json:"result"` // killed, survived, invalid
	Why     string  `yaml:"-" json:"why,omitempty"`
	Seconds float64 `yaml:"-" json:"seconds"`
}

func main() {
	list := flag.String("list", "internal/mutants/mutants.yaml", "the mutations")
	rows := flag.String("rows", "", "only the mutations of these rows (comma-separated); uncovered rows are then not reported")
	out := flag.String("out", "bin/mutants.json", "the report")
	flag.Parse()
	if err := run(*list, *rows, *out); err != nil {
		fmt.Fprintln(os.Stderr, "mutants:", err)
		os.Exit(1)
	}
}

func run(list, rows, out string) error {
	raw, err := os.ReadFile(list)
	if err != nil {
		return err
	}
	var ms []*mutation
	if err := yaml.Unmarshal(raw, &ms); err != nil {
		return fmt.Errorf("%s: %w", list, err)
	}
	if rows != "" {
		want := strings.Split(rows, ",")
		ms = slices.DeleteFunc(ms, func(m *mutation) bool { return !slices.Contains(want, m.Row) })
	}
	for i, m := range ms {
		if m.Row == "" || m.File == "" || m.Old == "" || m.Pkg == "" || m.Run == "" || m.Old == m.New {
			return fmt.Errorf("%s: mutation %d (%s) lacks row, file, old, pkg or run, or changes nothing", list, i+1, m.What)
		}
	}
	scratch, err := os.MkdirTemp("", "kvsp-mutants-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(scratch)
	if err := copyTree(scratch); err != nil {
		return err
	}

	// Each row's test must pass unmutated, or its failing under a
	// mutation says nothing.
	failed := 0
	baseline := map[string]string{}
	for _, m := range ms {
		k := m.key()
		if _, done := baseline[k]; done {
			continue
		}
		ok, text := goTest(scratch, m)
		baseline[k] = ""
		if !ok {
			baseline[k] = "fails unmutated: " + lastLine(text)
			fmt.Printf("baseline %s -run %s: FAILS\n%s\n", m.Pkg, m.Run, text)
		}
	}
	for _, m := range ms {
		t0 := time.Now()
		m.Result, m.Why = apply(scratch, m, baseline[m.key()])
		m.Seconds = time.Since(t0).Seconds()
		if m.Result != "killed" {
			failed++
		}
		fmt.Printf("%-8s %-4s %s: %s%s\n", m.Result, m.Row, m.File, m.What, map[bool]string{true: " (" + m.Why + ")"}[m.Why != ""])
	}

	var uncovered []string
	if rows == "" {
		all, err := planRows("docs/reliability.md")
		if err != nil {
			return err
		}
		for _, r := range all {
			if !slices.ContainsFunc(ms, func(m *mutation) bool { return m.Row == r }) {
				uncovered = append(uncovered, r)
			}
		}
	}
	killed := len(ms) - failed
	fmt.Printf("\n%d mutations: %d killed, %d survived or invalid; rows without a mutation: %d %v\n", len(ms), killed, failed, len(uncovered), uncovered)
	rep := struct {
		Date      string      `json:"date"`
		Mutations []*mutation `json:"mutations"`
		Killed    int         `json:"killed"`
		Uncovered []string    `json:"uncovered_rows"`
	}{time.Now().UTC().Format(time.RFC3339), ms, killed, uncovered}
	if b, err := json.MarshalIndent(rep, "", "  "); err == nil {
		os.MkdirAll(filepath.Dir(out), 0o755)
		os.WriteFile(out, append(b, '\n'), 0o644)
	}
	if failed > 0 || len(uncovered) > 0 {
		return fmt.Errorf("%d of %d mutations not killed, %d rows uncovered", failed, len(ms), len(uncovered))
	}
	return nil
}

// apply makes m in the scratch copy, runs its row's test, and restores
// the file.
func apply(scratch string, m *mutation, baseline string) (result, why string) {
	if baseline != "" {
		return "invalid", "the row's test " + baseline
	}
	p := filepath.Join(scratch, m.File)
	orig, err := os.ReadFile(p)
	if err != nil {
		return "invalid", err.Error()
	}
	defer os.WriteFile(p, orig, 0o644)
	if n := bytes.Count(orig, []byte(m.Old)); n != 1 {
		return "invalid", fmt.Sprintf("its code occurs %d times, not once", n)
	}
	if err := os.WriteFile(p, bytes.Replace(orig, []byte(m.Old), []byte(m.New), 1), 0o644); err != nil {
		return "invalid", err.Error()
	}
	ok, text := goTest(scratch, m)
	switch {
	case strings.Contains(text, "[build failed]") || strings.Contains(text, "[setup failed]"):
		return "invalid", "the mutated copy does not build: " + firstLine(text)
	case ok:
		return "survived", "the test passed"
	}
	return "killed", firstFailure(text)
}

// key names m's test run (a baseline per distinct one).
func (m *mutation) key() string { return m.Pkg + " " + m.Run + " " + strings.Join(m.Env, " ") }

func goTest(dir string, m *mutation) (bool, string) {
	cmd := exec.Command("go", "test", "-count=1", "-tags", "nogpu", "-run", m.Run, m.Pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), m.Env...)
	b, err := cmd.CombinedOutput()
	return err == nil, string(b)
}

// copyTree copies the working tree's files (tracked, and untracked ones
// git does not ignore) to dst.
func copyTree(dst string) error {
	b, err := exec.Command("git", "ls-files", "-z", "-c", "-o", "--exclude-standard").Output()
	if err != nil {
		return fmt.Errorf("git ls-files: %w", err)
	}
	for _, f := range strings.Split(strings.TrimRight(string(b), "\x00"), "\x00") {
		st, err := os.Lstat(f)
		if err != nil || !st.Mode().IsRegular() {
			continue // deleted in the working tree, or a link
		}
		if err := os.MkdirAll(filepath.Join(dst, filepath.Dir(f)), 0o755); err != nil {
			return err
		}
		if err := copyFile(filepath.Join(dst, f), f, st.Mode()); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(dst, src string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode.Perm())
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// planRows gives the row IDs of the reliability page's tables.
func planRows(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	row := regexp.MustCompile(`^\| ((?:B|S|F|L)[0-9]+|DS1) \|`)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if m := row.FindStringSubmatch(sc.Text()); m != nil && !slices.Contains(out, m[1]) {
			out = append(out, m[1])
		}
	}
	return out, sc.Err()
}

func firstLine(s string) string { return strings.SplitN(strings.TrimSpace(s), "\n", 2)[0] }

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// firstFailure gives the first failing test's line of go test's output.
func firstFailure(s string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "--- FAIL") {
			return strings.TrimSpace(l)
		}
	}
	return lastLine(s)
}

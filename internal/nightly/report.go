package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"
)

// Report is one make nightly: its stages in order, on one commit.
type Report struct {
	// Date is when the report was made (UTC, RFC 3339).
	Date    string `json:"date"`
	Commit  string `json:"commit"`
	Go      string `json:"go"`
	Machine string `json:"machine"`
	// Stages are in the order they ran; a stage whose result is missing
	// (it stopped before its verdict) is there, failed.
	Stages []*Stage `json:"stages"`
}

// stageFiles are read in the order given; a missing file is a stage that
// did not reach its verdict.
func newReport(stageFiles []string) (*Report, error) {
	if len(stageFiles) == 0 {
		return nil, fmt.Errorf("nightly report: no stage results")
	}
	r := &Report{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Commit:  commit(),
		Go:      runtime.Version(),
		Machine: fmt.Sprintf("%d cores, %s", runtime.NumCPU(), memTotal()),
	}
	for _, p := range stageFiles {
		var s Stage
		if err := readJSON(p, &s); err != nil {
			if !os.IsNotExist(err) {
				return nil, err
			}
			name := strings.TrimSuffix(p[strings.LastIndexByte(p, '/')+1:], ".json")
			s = Stage{Name: name, Failed: []string{"no result: the stage stopped before its verdict (see its log)"}}
		}
		r.Stages = append(r.Stages, &s)
	}
	return r, nil
}

// OK is whether every stage passed.
func (r *Report) OK() bool {
	for _, s := range r.Stages {
		if !s.OK {
			return false
		}
	}
	return true
}

// Verdict is the report's last line.
func (r *Report) Verdict() string {
	var failed, names []string
	for _, s := range r.Stages {
		names = append(names, s.Name)
		if !s.OK {
			failed = append(failed, s.Verdict())
		}
	}
	if len(failed) > 0 {
		return "nightly: FAILED: " + strings.Join(failed, " | ")
	}
	return fmt.Sprintf("nightly: ok: %s passed on %s", strings.Join(names, ", "), r.Commit)
}

// Markdown is the report as a table of the stages and a list of what
// held, row by row.
func (r *Report) Markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# make nightly, %s\n\n", r.Date)
	fmt.Fprintf(&b, "Commit %s, %s, %s.\n\n", r.Commit, r.Go, r.Machine)
	r.body(&b)
	fmt.Fprintf(&b, "\n%s\n", r.Verdict())
	return b.String()
}

// DocSection is what the "Last full run" section of docs/reliability.md
// holds, between its markers (its link relative to docs/).
func (r *Report) DocSection() string {
	var b strings.Builder
	fmt.Fprintf(&b, "Last full run: `make nightly` on %s (commit %s, %s, this machine: %s, loopback). Its report is\n", r.Date[:10], r.Commit, r.Go, r.Machine)
	fmt.Fprintf(&b, "[`%s`](%s); `TestDocQuotesTheReport` (internal/nightly) fails if a figure here is not the report's.\n\n", reportPath, strings.TrimPrefix(reportPath, "docs/"))
	r.body(&b)
	return b.String()
}

func (r *Report) body(b *strings.Builder) {
	b.WriteString("| stage | command | rows | tests passed | faults injected | bad inputs tried | requests under load | took | result |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	for _, s := range r.Stages {
		res := "ok"
		if !s.OK {
			res = "FAILED: " + strings.Join(s.Failed, "; ")
		}
		fmt.Fprintf(b, "| %s | `%s` | %d | %d | %d | %d | %d | %s | %s |\n", s.Name, s.Command, len(s.Rows), s.Tests, s.Faults, s.Inputs, s.Requests, s.Took, res)
	}
	for _, s := range r.Stages {
		fmt.Fprintf(b, "\n%s, what held:\n", s.Name)
		var quiet []string
		for _, row := range s.Rows {
			if len(row.Figures) == 0 {
				if row.Passed {
					quiet = append(quiet, row.Row)
				}
				continue
			}
			var held []string
			for _, f := range row.Figures {
				if !slices.Contains(held, f.Held) {
					held = append(held, f.Held)
				}
			}
			runs := ""
			if row.Runs > 1 {
				runs = fmt.Sprintf(" (%d runs; the last)", row.Runs)
				held = held[len(held)-1:]
			}
			fmt.Fprintf(b, "- %s%s: %s.\n", row.Row, runs, strings.Join(held, "; "))
		}
		if len(quiet) > 0 {
			fmt.Fprintf(b, "- passed, without figures of their own: %s.\n", strings.Join(quiet, ", "))
		}
	}
}

const (
	beginMarker = "<!-- nightly:begin (internal/nightly install writes this section) -->\n"
	endMarker   = "<!-- nightly:end -->\n"
)

// section returns the reliability page's section between the markers.
func section(readme string) (string, error) {
	i := strings.Index(readme, beginMarker)
	j := strings.Index(readme, endMarker)
	if i < 0 || j < i {
		return "", fmt.Errorf("nightly: %s has no section between %q and %q", reliabilityDoc, strings.TrimSpace(beginMarker), strings.TrimSpace(endMarker))
	}
	return readme[i+len(beginMarker) : j], nil
}

func replaceSection(readme, body string) (string, error) {
	if _, err := section(readme); err != nil {
		return "", err
	}
	i := strings.Index(readme, beginMarker) + len(beginMarker)
	j := strings.Index(readme, endMarker)
	return readme[:i] + body + readme[j:], nil
}

func commit() string {
	out, err := exec.Command("git", "rev-parse", "--short=12", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(bytes.TrimSpace(st)) > 0 {
		c += "+changes"
	}
	return c
}

func memTotal() string {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "memory unknown"
	}
	var kb int64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "MemTotal:") {
			fmt.Sscan(strings.TrimPrefix(line, "MemTotal:"), &kb)
		}
	}
	return fmt.Sprintf("%d GiB", (kb+512<<10)>>20)
}

func writeJSON(path string, v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // "->" as it is, in a report people read
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	b := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	if err := os.MkdirAll(path[:max(strings.LastIndexByte(path, '/'), 0)+1], 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

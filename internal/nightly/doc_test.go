package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocQuotesTheReport: docs/reliability.md's "Last full run" section is the
// committed report's, rendered, and every figure in it is in the report,
// so a figure cannot be edited by hand or outlive its run.
func TestDocQuotesTheReport(t *testing.T) {
	root := filepath.Join("..", "..")
	var r Report
	if err := readJSON(filepath.Join(root, reportPath), &r); err != nil {
		t.Fatal(err)
	}
	if !r.OK() {
		t.Fatalf("the committed report is of a failed run: %s", r.Verdict())
	}
	b, err := os.ReadFile(filepath.Join(root, reliabilityDoc))
	if err != nil {
		t.Fatal(err)
	}
	sec, err := section(string(b))
	if err != nil {
		t.Fatal(err)
	}
	if want := r.DocSection(); sec != want {
		t.Errorf("the page's section is not the report's (go run ./internal/nightly install %s rewrites it):\n got %s\nwant %s", reportPath, sec, want)
	}
	raw, err := os.ReadFile(filepath.Join(root, reportPath))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range regexp.MustCompile(`[0-9][0-9.,]*[0-9]|[0-9]`).FindAllString(sec, -1) {
		if !strings.Contains(string(raw), strings.ReplaceAll(n, ",", "")) {
			t.Errorf("%s quotes %s, which the report does not hold", reliabilityDoc, n)
		}
	}
	if md, err := os.ReadFile(filepath.Join(root, "docs/nightly/report.md")); err != nil || string(md) != r.Markdown() {
		t.Errorf("docs/nightly/report.md is not the report's Markdown (%v)", err)
	}
}

package docs

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

const root = "../.."

// pages are README.md and every Markdown file under docs/, by their path
// from the repository's root.
func pages(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	add := func(p string) {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		out[p] = string(b)
	}
	add("README.md")
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			rel, _ := filepath.Rel(root, p)
			add(filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// prose gives a page's lines outside fenced code blocks.
func prose(text string) []string {
	var out []string
	fenced := false
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			out = append(out, l)
		}
	}
	return out
}

var heading = regexp.MustCompile(`^(#+) (.*)$`)

// TestNothingLost: every heading and table row of the README before it
// became a front page is somewhere in README.md or docs/: a heading as a
// heading (at any level), a row verbatim.
func TestNothingLost(t *testing.T) {
	f, err := os.Open(filepath.Join("testdata", "readme-6c89cf3.inventory"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	headings, rows := map[string]bool{}, map[string]bool{}
	for _, text := range pages(t) {
		for _, l := range prose(text) {
			if m := heading.FindStringSubmatch(l); m != nil {
				headings[m[2]] = true
			} else if strings.HasPrefix(l, "|") {
				rows[l] = true
			}
		}
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	var h, r int
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "H "):
			h++
			if !headings[l[2:]] {
				t.Errorf("heading lost: %q", l[2:])
			}
		case strings.HasPrefix(l, "R "):
			r++
			if !rows[l[2:]] {
				t.Errorf("table row lost: %.120q", l[2:])
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if h < 20 || r < 150 {
		t.Fatalf("the inventory holds %d headings and %d rows: not the README's", h, r)
	}
	t.Logf("%d headings and %d table rows of the old README, all found", h, r)
}

var (
	link       = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)\)`)
	codeSpan   = regexp.MustCompile("`[^`]*`")
	notInSlug  = regexp.MustCompile(`[^\p{L}\p{N} _-]`)
	externalRe = regexp.MustCompile(`^[a-z][a-z0-9+.-]*:`)
)

// slug is GitHub's anchor for a heading: lower case, punctuation dropped
// (hyphens and underscores kept), spaces to hyphens.
func slug(h string) string {
	return strings.ReplaceAll(notInSlug.ReplaceAllString(strings.ToLower(h), ""), " ", "-")
}

// anchors gives a page's heading anchors (a repeated heading's later
// ones get -1, -2, ... as on GitHub).
func anchors(text string) map[string]bool {
	out, seen := map[string]bool{}, map[string]int{}
	for _, l := range prose(text) {
		if m := heading.FindStringSubmatch(l); m != nil {
			s := slug(strings.ReplaceAll(m[2], "`", ""))
			if n := seen[s]; n > 0 {
				out[s+"-"+strconv.Itoa(n)] = true
			} else {
				out[s] = true
			}
			seen[s]++
		}
	}
	return out
}

// TestLinksResolve: every link of README.md and docs/ to a file names one
// that exists, and every link to a heading (#anchor, in the page or
// another) names one the page has.
func TestLinksResolve(t *testing.T) {
	all := pages(t)
	n := 0
	for p, text := range all {
		for _, l := range prose(text) {
			for _, m := range link.FindAllStringSubmatch(codeSpan.ReplaceAllString(l, ""), -1) {
				target := m[1]
				if externalRe.MatchString(target) {
					continue
				}
				n++
				file, frag, _ := strings.Cut(target, "#")
				dest := p
				if file != "" {
					dest = filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(p), file)))
					if _, err := os.Stat(filepath.Join(root, dest)); err != nil {
						t.Errorf("%s: link to %s: no such file", p, target)
						continue
					}
				}
				if frag == "" {
					continue
				}
				body, ok := all[dest]
				if !ok {
					t.Errorf("%s: link to %s: an anchor in a page that is not Markdown under docs/", p, target)
					continue
				}
				if !anchors(body)[frag] {
					t.Errorf("%s: link to %s: %s has no such heading", p, target, dest)
				}
			}
		}
	}
	if n < 20 {
		t.Fatalf("%d links checked: the pages are not what this test expects", n)
	}
	t.Logf("%d links to files and headings, all resolve", n)
}

// TestSlug: GitHub's anchors for the kinds of headings the pages have.
func TestSlug(t *testing.T) {
	for h, want := range map[string]string{
		"vLLM: the KV connector":                 "vllm-the-kv-connector",
		"The Mooncake trace (--workload trace)":  "the-mooncake-trace---workload-trace",
		"Serving an engine's KV from GPU memory": "serving-an-engines-kv-from-gpu-memory",
	} {
		if got := slug(h); got != want {
			t.Errorf("slug(%q) = %q, want %q", h, got, want)
		}
	}
}

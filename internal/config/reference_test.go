package config

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
)

var updateReference = flag.Bool("update-reference", false, "rewrite the reference in docs/configuration.md from the code")

const (
	referencePage  = "../../docs/configuration.md"
	referenceBegin = "<!-- reference:begin (go test ./internal/config -run TestConfigurationReference -update-reference writes this) -->\n"
	referenceEnd   = "<!-- reference:end -->\n"
)

// fieldDocs reads the package's struct fields' comments: type -> field -> text.
func fieldDocs(t *testing.T) map[string]map[string]string {
	t.Helper()
	fset := token.NewFileSet()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	out := map[string]map[string]string{}
	for _, f := range files {
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				return true
			}
			m := map[string]string{}
			for _, fl := range st.Fields.List {
				text := fl.Doc.Text()
				if text == "" {
					text = fl.Comment.Text()
				}
				for _, name := range fl.Names {
					m[name.Name] = strings.Join(strings.Fields(text), " ")
				}
			}
			out[ts.Name.Name] = m
			return true
		})
	}
	return out
}

type refRow struct{ key, kind, doc string }

// reference walks Config as YAML sees it: every member, its kind, and its
// field's comment.
func reference(t *testing.T) []refRow {
	docs := fieldDocs(t)
	var rows []refRow
	var walk func(rt reflect.Type, prefix string)
	walk = func(rt reflect.Type, prefix string) {
		for i := 0; i < rt.NumField(); i++ {
			f := rt.Field(i)
			tag := strings.Split(f.Tag.Get("yaml"), ",")[0]
			if tag == "-" || tag == "" || !f.IsExported() {
				continue
			}
			key := prefix + tag
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			kind, sub := ft.Kind().String(), reflect.Type(nil)
			switch {
			case ft.Name() == "Size":
				kind = "size (octets; 1MiB, 4GiB allowed)"
			case ft.Kind() == reflect.Struct:
				kind, sub = "section", ft
			case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
				kind, sub = "list", ft.Elem()
			case ft.Kind() == reflect.Slice:
				kind = "list of " + ft.Elem().Kind().String()
			case ft.Kind() == reflect.Map:
				kind = "map"
			}
			doc := docs[rt.Name()][f.Name]
			rows = append(rows, refRow{key, kind, doc})
			if sub != nil {
				p := key + "."
				if kind == "list" {
					p = key + "[]."
				}
				walk(sub, p)
			}
		}
	}
	walk(reflect.TypeOf(Config{}), "")
	return rows
}

func renderReference(rows []refRow) string {
	var b strings.Builder
	b.WriteString("| key | kind | what it is |\n|---|---|---|\n")
	for _, r := range rows {
		doc := strings.ReplaceAll(r.doc, "|", "\\|")
		if doc == "" {
			doc = "—"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", r.key, r.kind, doc)
	}
	return b.String()
}

// TestConfigurationReference: docs/configuration.md's reference is every
// member of the configuration, with its field's comment, and nothing
// else: a key cannot be documented and missing, or the reverse.
func TestConfigurationReference(t *testing.T) {
	rows := reference(t)
	want := renderReference(rows)
	b, err := os.ReadFile(referencePage)
	if err != nil {
		t.Fatal(err)
	}
	page := string(b)
	i, j := strings.Index(page, referenceBegin), strings.Index(page, referenceEnd)
	if i < 0 || j < i {
		t.Fatalf("%s has no reference between its markers", referencePage)
	}
	got := page[i+len(referenceBegin) : j]
	if got != want {
		if *updateReference {
			page = page[:i+len(referenceBegin)] + want + page[j:]
			if err := os.WriteFile(referencePage, []byte(page), 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
		documented := map[string]bool{}
		for _, l := range strings.Split(got, "\n") {
			if k, _, ok := strings.Cut(strings.TrimPrefix(l, "| `"), "`"); ok && strings.HasPrefix(l, "| `") {
				documented[k] = true
			}
		}
		var missing, extra []string
		have := map[string]bool{}
		for _, r := range rows {
			have[r.key] = true
			if !documented[r.key] {
				missing = append(missing, r.key)
			}
		}
		for k := range documented {
			if !have[k] {
				extra = append(extra, k)
			}
		}
		sort.Strings(extra)
		t.Fatalf("%s's reference is not the code's (rewrite it: go test ./internal/config -run TestConfigurationReference -update-reference); undocumented %v, documented but not in the code %v", filepath.Base(referencePage), missing, extra)
	}
	undocumented := 0
	for _, r := range rows {
		if r.doc == "" {
			undocumented++
		}
	}
	t.Logf("%d configuration keys in the reference, %d without a comment", len(rows), undocumented)
}

package docs

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A shell block's marker is an HTML comment on the line before its fence:
//
//	(none)                   runs in make test: must exit 0 within shortTimeout
//	<!-- run: long -->       runs in make nightly (KVSP_DOCS_LONG=1), within an hour
//	<!-- run: serves PORT -->  its last command serves: it must listen on 127.0.0.1:PORT
//	                         within shortTimeout; it is stopped after the next block
//	                         if that one is marked with-previous, else at once
//	<!-- run: with-previous --> runs while the serving block before it still serves
//	<!-- no-run: REASON -->  does not run, for the reason given (never on the front page)
type shellBlock struct {
	page   string
	line   int // the fence's, 1-based
	mode   string
	port   string
	reason string
	script string
}

const (
	shortTimeout = 3 * time.Minute
	longTimeout  = time.Hour
)

var marker = regexp.MustCompile(`^<!-- (run|no-run):\s*(.*?)\s*-->$`)

func shellBlocks(t *testing.T) []shellBlock {
	t.Helper()
	var out []shellBlock
	all := pages(t)
	names := make([]string, 0, len(all))
	for p := range all {
		names = append(names, p)
	}
	sort.Strings(names)
	for _, p := range names {
		lines := strings.Split(all[p], "\n")
		for i := 0; i < len(lines); i++ {
			if strings.HasPrefix(lines[i], "```") && strings.TrimSpace(lines[i][3:]) != "" && !strings.HasPrefix(lines[i], "```sh") {
				for i++; i < len(lines) && !strings.HasPrefix(lines[i], "```"); i++ { // another language's block
				}
				continue
			}
			if lines[i] != "```sh" {
				continue
			}
			b := shellBlock{page: p, line: i + 1, mode: "short"}
			if i > 0 {
				if m := marker.FindStringSubmatch(lines[i-1]); m != nil {
					switch kind, arg := m[1], m[2]; {
					case kind == "no-run":
						b.mode, b.reason = "no-run", arg
					case arg == "long" || arg == "with-previous":
						b.mode = arg
					case strings.HasPrefix(arg, "serves "):
						b.mode, b.port = "serves", strings.TrimPrefix(arg, "serves ")
					default:
						t.Fatalf("%s:%d: unknown marker %q", p, i, lines[i-1])
					}
				}
			}
			var body []string
			for i++; i < len(lines) && !strings.HasPrefix(lines[i], "```"); i++ {
				body = append(body, lines[i])
			}
			b.script = strings.Join(body, "\n") + "\n"
			out = append(out, b)
		}
	}
	return out
}

// TestShellBlocks runs every shell block of README.md and docs/, as a
// reader would paste it, from the repository's root: the short ones in
// make test, the long ones too with KVSP_DOCS_LONG=1 (make nightly). A
// block that may not run says why (no-run), and no block of the front
// page may be one. It prints how many ran.
func TestShellBlocks(t *testing.T) {
	blocks := shellBlocks(t)
	long := os.Getenv("KVSP_DOCS_LONG") == "1"
	ran, skippedLong, noRun := 0, 0, 0
	var serving *exec.Cmd
	stopServing := func() {
		if serving != nil {
			stop(serving)
			serving = nil
		}
	}
	defer stopServing()
	for _, b := range blocks {
		where := fmt.Sprintf("%s:%d", b.page, b.line)
		switch b.mode {
		case "no-run":
			if len(b.reason) < 20 {
				t.Errorf("%s: no-run needs its reason", where)
			}
			if b.page == "README.md" {
				t.Errorf("%s: the front page's blocks all run", where)
			}
			noRun++
			stopServing()
			continue
		case "long":
			if !long {
				skippedLong++
				stopServing()
				continue
			}
		}
		if b.mode != "with-previous" {
			stopServing()
		} else if serving == nil {
			t.Errorf("%s: with-previous, but the block before it serves nothing", where)
			continue
		}
		timeout := shortTimeout
		if b.mode == "long" {
			timeout = longTimeout
		}
		t0 := time.Now()
		cmd, out := start(t, b.script)
		var err error
		if b.mode == "serves" {
			err = listening(cmd, "127.0.0.1:"+b.port, timeout)
			if err == nil {
				serving = cmd
			} else {
				stop(cmd)
			}
		} else {
			err = wait(cmd, timeout)
		}
		ran++
		if err != nil {
			t.Errorf("%s (%s): %v\n%s", where, b.mode, err, tail(output(out), 3000))
			continue
		}
		t.Logf("%s (%s): ran in %.1f s", where, b.mode, time.Since(t0).Seconds())
	}
	t.Logf("%d shell blocks ran, %d long ones left to make nightly (KVSP_DOCS_LONG=1), %d marked no-run", ran, skippedLong, noRun)
	fmt.Printf("docs: %d shell blocks ran, %d long ones left to make nightly, %d marked no-run\n", ran, skippedLong, noRun)
	if ran == 0 {
		t.Fatal("no shell block ran")
	}
}

// start runs a block in bash (-e, pipefail) from the repository's root,
// in its own process group, its output to a file (a pipe would keep Wait
// waiting for what the block leaves in the background).
func start(t *testing.T, script string) (*exec.Cmd, string) {
	t.Helper()
	abs, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.CreateTemp(t.TempDir(), "block-*.log")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command("bash", "-e", "-o", "pipefail", "-c", script)
	cmd.Dir = abs
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// A block that runs make test runs this test again: short blocks only.
	cmd.Env = slices.DeleteFunc(os.Environ(), func(e string) bool { return strings.HasPrefix(e, "KVSP_DOCS_LONG=") })
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, f.Name()
}

func output(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

func wait(cmd *exec.Cmd, timeout time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		stop(cmd) // what it left in the background
		return err
	case <-time.After(timeout):
		stop(cmd)
		<-done
		return fmt.Errorf("still running after %v", timeout)
	}
}

// listening waits until addr accepts a connection while cmd runs.
func listening(cmd *exec.Cmd, addr string, timeout time.Duration) error {
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case err := <-exited:
			return fmt.Errorf("exited (%v) before it listened on %s", err, addr)
		case <-ctx.Done():
			return errors.New("never listened on " + addr)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// stop ends a block's process group: SIGTERM, then SIGKILL.
func stop(cmd *exec.Cmd) {
	if cmd.Process == nil {
		return
	}
	pg := -cmd.Process.Pid
	_ = syscall.Kill(pg, syscall.SIGTERM)
	for i := 0; i < 50; i++ {
		if syscall.Kill(pg, 0) != nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	_ = syscall.Kill(pg, syscall.SIGKILL)
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

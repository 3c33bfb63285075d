// Package failpoint injects faults at named steps of the code that a
// crash or a stall could split: between writing a file and renaming it,
// between persisting an epoch and answering, while a lock is held. The
// reliability tests (issue 12, ../shared/RELIABILITY.md rows F1, F5, F8,
// F12, F15, L4) arm them in-process with Enable, or in a subprocess with the
// KVSP_FAILPOINTS environment variable:
//
//	KVSP_FAILPOINTS='pc/epoch-persisted=kill;holder/corrupt-on-read=1*return'
//
// A point costs one atomic load when nothing is armed, so the points stay
// in production builds (the way etcd's gofail points are compiled in for
// its robustness tests) and the binary that is tested is the one that
// ships. Terms, each optionally prefixed by a count ("2*" fires twice,
// then the point is off), itself optionally prefixed by evaluations to
// pass first ("7+1*return": the first seven pass, the eighth fires):
//
//	return         Eval returns ErrInjected (Armed reports true)
//	return(text)   Eval returns an error with the text
//	sleep(d)       Eval sleeps d (a time.ParseDuration string), then goes on
//	pause          Eval blocks until the point is disabled (Disable, Reset)
//	panic          Eval panics
//	kill           the process sends itself SIGKILL: a crash at that step
//	off            nothing
//
// Every firing is counted (Hits), so a test can assert that its fault was
// injected rather than assume it.
package failpoint

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Env is the environment variable read at start-up.
const Env = "KVSP_FAILPOINTS"

// ErrInjected is what a point armed with "return" makes Eval return.
var ErrInjected = errors.New("failpoint: injected fault")

type kind int

const (
	kOff kind = iota
	kReturn
	kSleep
	kPause
	kPanic
	kKill
)

type action struct {
	kind  kind
	err   error
	sleep time.Duration
	left  int64 // firings left; < 0 means unlimited, 0 spent
	skip  int64 // evaluations that pass before the first firing
	// released is closed when a paused point is disabled.
	released chan struct{}
}

var (
	armed atomic.Int32 // number of armed points: the fast path
	mu    sync.Mutex
	table = map[string]*action{}
	hits  = map[string]int64{}
)

func init() {
	if s := os.Getenv(Env); s != "" {
		if err := EnableAll(s); err != nil {
			fmt.Fprintf(os.Stderr, "kvsp: %s: %v\n", Env, err)
			os.Exit(2)
		}
	}
}

// EnableAll arms the points of a specification "name=term;name=term".
func EnableAll(spec string) error {
	for part := range strings.SplitSeq(spec, ";") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, term, ok := strings.Cut(part, "=")
		if !ok {
			return fmt.Errorf("failpoint %q: want name=term", part)
		}
		if err := Enable(strings.TrimSpace(name), strings.TrimSpace(term)); err != nil {
			return err
		}
	}
	return nil
}

// Enable arms the point name with a term (see the package comment),
// replacing what it had.
func Enable(name, term string) error {
	a, err := parse(term)
	if err != nil {
		return fmt.Errorf("failpoint %s: %w", name, err)
	}
	mu.Lock()
	defer mu.Unlock()
	disableLocked(name)
	if a.kind != kOff {
		table[name] = a
		armed.Add(1)
	}
	return nil
}

// Disable disarms the point; goroutines paused at it go on.
func Disable(name string) {
	mu.Lock()
	defer mu.Unlock()
	disableLocked(name)
}

func disableLocked(name string) {
	a, ok := table[name]
	if !ok {
		return
	}
	delete(table, name)
	armed.Add(-1)
	if a.released != nil {
		close(a.released)
	}
}

// Reset disarms every point and forgets the counts.
func Reset() {
	mu.Lock()
	defer mu.Unlock()
	for name := range table {
		disableLocked(name)
	}
	clear(hits)
}

// Hits reports how many times the point fired since the last Reset.
func Hits(name string) int64 {
	mu.Lock()
	defer mu.Unlock()
	return hits[name]
}

// Eval runs the point's action: nil unless it is armed with "return". It is
// cheap when no point is armed.
func Eval(name string) error {
	if armed.Load() == 0 {
		return nil
	}
	return eval(name)
}

// Active reports whether the point is enabled with firings left, without
// firing it: for a point evaluated later in a step that costs something
// to set up (a wrapper around a body). It is cheap when no point is armed.
func Active(name string) bool {
	if armed.Load() == 0 {
		return false
	}
	mu.Lock()
	defer mu.Unlock()
	a, ok := table[name]
	return ok && a.left != 0
}

// Armed reports whether the point fired with "return": for points that
// change a value rather than fail a step (a corrupted byte).
func Armed(name string) bool {
	return Eval(name) != nil
}

func eval(name string) error {
	mu.Lock()
	a, ok := table[name]
	if !ok || a.left == 0 {
		mu.Unlock()
		return nil
	}
	if a.skip > 0 {
		a.skip--
		mu.Unlock()
		return nil
	}
	hits[name]++
	if a.left > 0 {
		a.left-- // a spent point stays in the table until disabled: a pause it holds is released then
	}
	k, err, d, released := a.kind, a.err, a.sleep, a.released
	mu.Unlock()
	switch k {
	case kReturn:
		return err
	case kSleep:
		time.Sleep(d)
	case kPause:
		<-released
	case kPanic:
		panic("failpoint " + name)
	case kKill:
		kill()
	}
	return nil
}

func parse(term string) (*action, error) {
	a := &action{left: -1}
	if n, rest, ok := strings.Cut(term, "+"); ok && !strings.Contains(n, "(") {
		c, err := strconv.ParseInt(n, 10, 64)
		if err != nil || c <= 0 {
			return nil, fmt.Errorf("bad skip %q", n)
		}
		a.skip, term = c, rest
	}
	if n, rest, ok := strings.Cut(term, "*"); ok {
		c, err := strconv.ParseInt(n, 10, 64)
		if err != nil || c <= 0 {
			return nil, fmt.Errorf("bad count %q", n)
		}
		a.left, term = c, rest
	}
	verb, arg, hasArg := strings.Cut(term, "(")
	if hasArg {
		if !strings.HasSuffix(arg, ")") {
			return nil, fmt.Errorf("term %q: missing )", term)
		}
		arg = strings.TrimSuffix(arg, ")")
	}
	switch verb {
	case "off":
		a.kind = kOff
	case "return":
		a.kind, a.err = kReturn, ErrInjected
		if hasArg {
			a.err = fmt.Errorf("%w: %s", ErrInjected, arg)
		}
	case "sleep":
		d, err := time.ParseDuration(arg)
		if err != nil || d < 0 {
			return nil, fmt.Errorf("term %q: bad duration", term)
		}
		a.kind, a.sleep = kSleep, d
	case "pause":
		a.kind, a.released = kPause, make(chan struct{})
	case "panic":
		a.kind = kPanic
	case "kill":
		a.kind = kKill
	default:
		return nil, fmt.Errorf("unknown term %q", term)
	}
	if hasArg && verb != "return" && verb != "sleep" {
		return nil, fmt.Errorf("term %q takes no argument", verb)
	}
	return a, nil
}

package failpoint

import (
	"errors"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv("KVSP_FAILPOINT_CHILD") != "" {
		// The subprocess of TestKillFromEnvironment: the point was armed
		// from the environment at init.
		Eval("child/step")
		os.Exit(0) // reached only if the point did not kill
	}
	goleak.VerifyTestMain(m)
}

func TestTerms(t *testing.T) {
	t.Cleanup(Reset)
	if err := Eval("a"); err != nil {
		t.Fatalf("unarmed point: %v", err)
	}
	if err := EnableAll("a=return; b=2*return(disk full) ;c=sleep(20ms);d=off"); err != nil {
		t.Fatal(err)
	}
	if err := Eval("a"); !errors.Is(err, ErrInjected) {
		t.Fatalf("a: %v", err)
	}
	for i := range 3 {
		err := Eval("b")
		if (i < 2) != (err != nil) || (err != nil && (!errors.Is(err, ErrInjected) || err.Error() != "failpoint: injected fault: disk full")) {
			t.Fatalf("b firing %d: %v", i, err)
		}
	}
	start := time.Now()
	if err := Eval("c"); err != nil || time.Since(start) < 20*time.Millisecond {
		t.Fatalf("c: %v after %v", err, time.Since(start))
	}
	if Armed("d") {
		t.Fatal("d is off")
	}
	if Hits("a") != 1 || Hits("b") != 2 || Hits("c") != 1 || Hits("d") != 0 {
		t.Fatalf("hits a=%d b=%d c=%d d=%d", Hits("a"), Hits("b"), Hits("c"), Hits("d"))
	}
	Disable("a")
	if Armed("a") {
		t.Fatal("a disabled")
	}
	Reset()
	if Hits("b") != 0 || armed.Load() != 0 {
		t.Fatalf("after Reset: hits %d, armed %d", Hits("b"), armed.Load())
	}
}

// TestSkip: "N+" passes N evaluations before the term applies, so a test
// can aim a fault at the third GET of a run (the vLLM connector's
// corrupted block, in the middle of a prefix).
func TestSkip(t *testing.T) {
	t.Cleanup(Reset)
	if err := EnableAll("a=2+1*return;b=1+return(late)"); err != nil {
		t.Fatal(err)
	}
	var got []bool
	for range 5 {
		got = append(got, Armed("a"))
	}
	if want := []bool{false, false, true, false, false}; !slices.Equal(got, want) {
		t.Fatalf("a fired %v, want %v", got, want)
	}
	if Armed("b") || !Armed("b") || !Armed("b") {
		t.Fatal("b: one pass, then fires every time")
	}
	if Hits("a") != 1 || Hits("b") != 2 {
		t.Fatalf("hits a=%d b=%d: passes are not firings", Hits("a"), Hits("b"))
	}
}

func TestBadTerms(t *testing.T) {
	t.Cleanup(Reset)
	for _, spec := range []string{"a", "a=0+return", "a=x+1*return", "a=explode", "a=sleep(x)", "a=sleep(-1s)", "a=0*return", "a=x*return", "a=panic(now)", "a=return(x"} {
		if err := EnableAll(spec); err == nil {
			t.Errorf("%q accepted", spec)
		}
	}
	if armed.Load() != 0 {
		t.Fatalf("bad terms armed %d points", armed.Load())
	}
}

func TestPauseUntilDisabled(t *testing.T) {
	t.Cleanup(Reset)
	if err := Enable("p", "1*pause"); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { Eval("p"); close(done) }()
	select {
	case <-done:
		t.Fatal("a paused point went on before it was disabled")
	case <-time.After(50 * time.Millisecond):
	}
	if err := Eval("p"); err != nil { // spent: the second caller passes
		t.Fatal(err)
	}
	Disable("p")
	<-done
}

func TestPanic(t *testing.T) {
	t.Cleanup(Reset)
	Enable("x", "panic")
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	Eval("x")
}

// A point armed through KVSP_FAILPOINTS in a subprocess kills it with
// SIGKILL: what the crash tests of the holder and the PC rely on.
func TestKillFromEnvironment(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), "KVSP_FAILPOINT_CHILD=1", Env+"=child/step=kill")
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("child: %v, want killed by SIGKILL", err)
	}
	cmd = exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), "KVSP_FAILPOINT_CHILD=1", Env+"=child/step=explode")
	if err := cmd.Run(); !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("bad specification: %v, want exit 2", err)
	}
}

// TestActive: Active reports an enabled point with firings left, without
// firing it or counting a hit.
func TestActive(t *testing.T) {
	t.Cleanup(Reset)
	if Active("t/active") {
		t.Fatal("active before Enable")
	}
	if err := Enable("t/active", "1*return"); err != nil {
		t.Fatal(err)
	}
	first := Active("t/active")
	if !first || !Active("t/active") || Hits("t/active") != 0 { // asked twice: asking does not fire it
		t.Fatalf("enabled: active %v, %d hits", Active("t/active"), Hits("t/active"))
	}
	if Eval("t/active") == nil || Active("t/active") {
		t.Fatal("after its one firing it is still active")
	}
}

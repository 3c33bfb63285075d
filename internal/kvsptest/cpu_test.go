package kvsptest

import (
	"os"
	"testing"
	"time"
)

// ProcessTreeCounts counts this process's write system calls and its
// threads' context switches.
func TestProcessTreeCounts(t *testing.T) {
	f, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c0, err := ProcessTreeCounts(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for range 100 {
		f.Write([]byte{0})
	}
	time.Sleep(10 * time.Millisecond) // a voluntary switch, at least
	c1, err := ProcessTreeCounts(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if d := c1.Writes - c0.Writes; d < 100 {
		t.Errorf("%d write system calls counted, want at least 100", d)
	}
	if c1.Switches <= c0.Switches {
		t.Errorf("context switches %d then %d, want more", c0.Switches, c1.Switches)
	}
	if _, err := ProcessTreeCounts(1 << 30); err == nil {
		t.Error("a process that does not exist: no error")
	}
}

package tier

import (
	"bytes"
	"errors"
	"sync"
	"testing"

	"github.com/kvsp/kvsp/gpu"
)

// TestOpenDevice: a nogpu build opens the stand-in, which says it is one;
// other builds open a real device or report gpu.ErrNoDevice (never a
// stand-in posing as a device).
func TestOpenDevice(t *testing.T) {
	d, err := OpenDevice(0)
	if err != nil {
		if !errors.Is(err, gpu.ErrNoDevice) {
			t.Fatalf("not ErrNoDevice: %v", err)
		}
		return
	}
	defer d.Close()
	b, err := d.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	src := []byte("kv")
	out := make([]byte, 2)
	if b.CopyIn(100, src) != nil || b.CopyOut(out, 100) != nil || string(out) != "kv" {
		t.Fatal("round trip through device memory")
	}
	t.Logf("device %q, stand-in %v", d.Name(), d.StandIn())
	if d.StandIn() != standInBuild {
		t.Fatalf("stand-in %v in a build where it is %v", d.StandIn(), standInBuild)
	}
}

// TestStagersBounded: more concurrent device reads than stagers may exist
// all complete, byte for byte, while at most maxStagers stagers (pinned
// staging) are in use at once.
func TestStagersBounded(t *testing.T) {
	d, err := OpenDevice(0)
	if err != nil {
		t.Skipf("no device: %v", err)
	}
	defer d.Close()
	b, err := d.Alloc(256 << 10)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	src := make([]byte, 256<<10)
	for i := range src {
		src[i] = byte(i * 31)
	}
	if err := b.CopyIn(0, src); err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		peak int
		wg   sync.WaitGroup
	)
	for range 2 * maxStagers {
		wg.Go(func() {
			var out bytes.Buffer
			w := writerFunc(func(p []byte) (int, error) {
				mu.Lock()
				peak = max(peak, len(d.inUse))
				mu.Unlock()
				return out.Write(p)
			})
			if _, err := d.WriteRange(w, b, 1, 256<<10-1); err != nil || !bytes.Equal(out.Bytes(), src[1:]) {
				t.Errorf("a concurrent device read: %v", err)
			}
		})
	}
	wg.Wait()
	if peak > maxStagers || len(d.inUse) != 0 {
		t.Fatalf("stagers in use: peak %d (bound %d), %d left", peak, maxStagers, len(d.inUse))
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

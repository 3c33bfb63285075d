package tier

import (
	"errors"
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

//go:build cgo && !nogpu

package gpu

import (
	"errors"
	"strings"
	"testing"
)

// TestOpenSaysWhy: the CUDA build starts anywhere; where libcuda.so.1 or a
// device is missing, Open is ErrNoDevice and says which (so a holder with
// a device tier refuses to start with that reason). With a device, the
// other tests of the package run against it.
func TestOpenSaysWhy(t *testing.T) {
	d, err := Open(0)
	if err == nil {
		d.Close()
		t.Skip("a CUDA device is present: TestDeviceCopies and TestStager cover it")
	}
	if !errors.Is(err, ErrNoDevice) {
		t.Fatalf("Open without a device: %v, want ErrNoDevice", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "libcuda.so.1") && !strings.Contains(msg, "cuInit") && !strings.Contains(msg, "CUDA devices") {
		t.Fatalf("the error does not say what is missing: %s", msg)
	}
	if _, err := Open(-1); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("ordinal -1: %v", err)
	}
}

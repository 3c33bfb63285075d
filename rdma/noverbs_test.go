//go:build !rdma || !cgo

package rdma

import (
	"errors"
	"testing"
)

func TestVerbsNotBuilt(t *testing.T) {
	if _, err := OpenVerbs(""); !errors.Is(err, ErrNotBuilt) || Enabled {
		t.Fatalf("OpenVerbs in a build without rdma: %v", err)
	}
}

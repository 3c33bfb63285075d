//go:build !amd64 || purego

package llamacpp

import "unsafe"

// tiles8 has no vector path here: tile4x4 does the work.
func tiles8(d, s unsafe.Pointer, dstStride, srcStride, r0, r1, c0, c1 int) bool { return false }

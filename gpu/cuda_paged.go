//go:build cgo && !nogpu

package gpu

/*
#include <stdlib.h>
#include "../csrc/kvsp_cuda.h"
*/
import "C"

import (
	_ "embed"
	"fmt"
	"sync"
	"unsafe"
)

// kvspGatherPTX is csrc/kvsp_gather.cu compiled by `make ptx`.
//
//go:embed kvsp_gather.ptx
var kvspGatherPTX string

// kernels is the gather/scatter module of a device, loaded once, and the
// device scratch the block tables go through.
type kernels struct {
	once            sync.Once
	err             error
	mod             unsafe.Pointer // unloaded by Close
	gather, scatter unsafe.Pointer

	mu      sync.Mutex // one table in flight at a time
	scratch *Buffer
}

func (d *Device) paged() (*kernels, error) {
	k := &d.kern
	k.once.Do(func() {
		image := C.CString(kvspGatherPTX) // a NUL-terminated PTX image
		defer C.free(unsafe.Pointer(image))
		var mod unsafe.Pointer
		if k.err = check("cuModuleLoadData", C.kvsp_cuda_module_load(d.h(), unsafe.Pointer(image), &mod)); k.err != nil {
			return
		}
		k.mod = mod
		for name, fn := range map[string]*unsafe.Pointer{"kvsp_gather": &k.gather, "kvsp_scatter": &k.scatter} {
			cname := C.CString(name)
			k.err = check("cuModuleGetFunction "+name, C.kvsp_cuda_module_function(d.h(), mod, cname, fn))
			C.free(unsafe.Pointer(cname))
			if k.err != nil {
				return
			}
		}
	})
	return k, k.err
}

// Gather copies tokens [first, first+tokens) of a sequence from the paged
// pool into dst as kvsp-layout-1 sections (for each layer, K then V), with
// the kvsp_gather kernel on s. It returns once the copy is done.
func (d *Device) Gather(dst, pool *Buffer, p Paged, table []int32, first, tokens int, s *Stream) error {
	return d.launchPaged(true, pool, dst, p, table, first, tokens, s)
}

// Scatter copies kvsp-layout-1 sections from src into tokens [first,
// first+tokens) of a sequence in the paged pool, with the kvsp_scatter
// kernel on s. It returns once the copy is done.
func (d *Device) Scatter(pool, src *Buffer, p Paged, table []int32, first, tokens int, s *Stream) error {
	return d.launchPaged(false, pool, src, p, table, first, tokens, s)
}

func (d *Device) launchPaged(gather bool, pool, sections *Buffer, p Paged, table []int32, first, tokens int, s *Stream) error {
	if err := p.check(pool.Len(), sections.Len(), table, first, tokens); err != nil {
		return err
	}
	k, err := d.paged()
	if err != nil {
		return err
	}
	fn := k.scatter
	if gather {
		fn = k.gather
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	need := int64(4 * len(table))
	if k.scratch == nil || k.scratch.Len() < need {
		if k.scratch != nil {
			k.scratch.Free()
		}
		if k.scratch, err = d.Alloc(max(need, 4096)); err != nil {
			k.scratch = nil
			return err
		}
	}
	if err := k.scratch.CopyIn(0, unsafe.Slice((*byte)(unsafe.Pointer(&table[0])), need)); err != nil {
		return err
	}
	rc := C.kvsp_cuda_launch_paged(d.h(), fn, pool.ptr, sections.ptr, k.scratch.ptr, C.int(p.PageTokens),
		C.longlong(p.LayerStride), C.longlong(p.VOffset), C.longlong(p.PageStride), C.int(first), C.int(tokens),
		C.int(p.RowBytes), C.int(p.Layers), s.s)
	if err := check("cuLaunchKernel", rc); err != nil {
		return fmt.Errorf("gpu: paged copy: %w", err)
	}
	return s.Sync() // the table's scratch is reused by the next call
}

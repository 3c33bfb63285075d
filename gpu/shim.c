//go:build cgo && !nogpu

// cgo compiles no C files in subfolders: the shim's source lives in csrc/
// and is compiled here.
#include "../csrc/kvsp_cuda.c"

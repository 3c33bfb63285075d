//go:build rdma && cgo

#include "../csrc/kvsp_verbs.c"

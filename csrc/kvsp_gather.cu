// kvsp_gather: conversion between an engine's paged KV pool and
// kvsp-layout-1 sections, on the device.
//
// The pool holds, for (layer l, K or V, page p, row r), a row of
// row_bytes octets (kv_heads x head_dim elements) at
//   l * layer_stride + kv * v_offset + p * page_stride + r * row_bytes.
// A block's tokens [first, first + tokens) of a sequence are at page
// table[t / page_tokens], row t % page_tokens. The sections are the
// block's payload in kvsp-layout-1: for each layer, K then V, each
// `tokens` rows back to back.
//
// One thread block per (token, layer x K/V) copies a row, 16 octets per
// thread and step when everything is 16-aligned (rows of bf16 heads of 64
// or more elements always are), octet by octet otherwise.
//
// Built by `make ptx` (nvcc -ptx for compute_80, which the driver
// compiles for sm_80 and later, H100/H200 included) into
// gpu/kvsp_gather.ptx, which is embedded and loaded with cuModuleLoadData;
// `make build-gpu` checks the committed PTX against a rebuild.

__device__ __forceinline__ void copy_row(unsigned char *dst, const unsigned char *src, int n) {
	if ((((unsigned long long)dst | (unsigned long long)src | (unsigned long long)n) & 15) == 0) {
		const uint4 *s = (const uint4 *)src;
		uint4 *d = (uint4 *)dst;
		for (int i = threadIdx.x; i < n / 16; i += blockDim.x) {
			d[i] = s[i];
		}
		return;
	}
	for (int i = threadIdx.x; i < n; i += blockDim.x) {
		dst[i] = src[i];
	}
}

__device__ __forceinline__ long long pool_offset(const int *table, int page_tokens, long long layer_stride, long long v_offset,
                                                 long long page_stride, int first, int row_bytes) {
	int t = first + blockIdx.x;
	int kv = blockIdx.y & 1;
	int layer = blockIdx.y >> 1;
	int page = table[t / page_tokens];
	return (long long)layer * layer_stride + (long long)kv * v_offset + (long long)page * page_stride +
	       (long long)(t % page_tokens) * row_bytes;
}

__device__ __forceinline__ long long section_offset(int tokens, int row_bytes) {
	return ((long long)blockIdx.y * tokens + blockIdx.x) * row_bytes;
}

extern "C" __global__ void kvsp_gather(const unsigned char *pool, unsigned char *sections, const int *table, int page_tokens,
                                       long long layer_stride, long long v_offset, long long page_stride, int first, int tokens,
                                       int row_bytes) {
	copy_row(sections + section_offset(tokens, row_bytes),
	         pool + pool_offset(table, page_tokens, layer_stride, v_offset, page_stride, first, row_bytes), row_bytes);
}

extern "C" __global__ void kvsp_scatter(unsigned char *pool, const unsigned char *sections, const int *table, int page_tokens,
                                        long long layer_stride, long long v_offset, long long page_stride, int first, int tokens,
                                        int row_bytes) {
	copy_row(pool + pool_offset(table, page_tokens, layer_stride, v_offset, page_stride, first, row_bytes),
	         sections + section_offset(tokens, row_bytes), row_bytes);
}

/*
 * kvsp_cuda: a thin shim of kvsp over the CUDA driver API.
 *
 * libcuda.so.1 is loaded with dlopen at run time (as go-nvml does for
 * NVML), so a binary built with the shim starts on any machine and reports
 * a clear error where no NVIDIA driver or device exists. Every entry takes
 * the device ordinal and makes that device's primary context current on
 * the calling thread first (Go moves goroutines between threads).
 *
 * Return values are CUresult codes (0: success); KVSP_CUDA_NO_DRIVER and
 * KVSP_CUDA_NOT_OPEN are the shim's own. kvsp_cuda_error describes any.
 */
#ifndef KVSP_CUDA_H
#define KVSP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#define KVSP_CUDA_IPC_HANDLE_SIZE 64
#define KVSP_CUDA_MAX_DEVICES 64

/* The shim's own codes, outside CUresult's range. */
#define KVSP_CUDA_NO_DRIVER 100001 /* libcuda.so.1 or a symbol is missing */
#define KVSP_CUDA_NOT_OPEN 100002  /* the ordinal was not opened */
#define KVSP_CUDA_NOT_SUPPORTED 100003 /* see kvsp_cuda_dmabuf */

/* Loading and devices. */
int kvsp_cuda_load(char *err, size_t errlen);
int kvsp_cuda_device_count(int *n);
int kvsp_cuda_open(int ordinal, char *name, int namelen, size_t *total);
int kvsp_cuda_close(int ordinal);
int kvsp_cuda_mem_info(int ordinal, size_t *free_bytes, size_t *total);
int kvsp_cuda_sync(int ordinal); /* waits for all the device's work */
int kvsp_cuda_pci_bus_id(int ordinal, char *id, int len);
const char *kvsp_cuda_error(int code);

/* Device memory. */
int kvsp_cuda_alloc(int ordinal, uint64_t *dptr, size_t n);
int kvsp_cuda_free(int ordinal, uint64_t dptr);

/* Pinned host memory: allocated by the driver, or registered. */
int kvsp_cuda_host_alloc(int ordinal, void **p, size_t n);
int kvsp_cuda_host_free(int ordinal, void *p);
int kvsp_cuda_host_register(int ordinal, void *p, size_t n);
int kvsp_cuda_host_unregister(int ordinal, void *p);

/* Copies: synchronous, and asynchronous on a stream (host side pinned). */
int kvsp_cuda_htod(int ordinal, uint64_t dst, const void *src, size_t n);
int kvsp_cuda_dtoh(int ordinal, void *dst, uint64_t src, size_t n);
int kvsp_cuda_dtod(int ordinal, uint64_t dst, uint64_t src, size_t n);
int kvsp_cuda_htod_async(int ordinal, uint64_t dst, const void *src, size_t n, void *stream);
int kvsp_cuda_dtoh_async(int ordinal, void *dst, uint64_t src, size_t n, void *stream);

/* Streams and events. */
int kvsp_cuda_stream_create(int ordinal, void **stream);
int kvsp_cuda_stream_destroy(int ordinal, void *stream);
int kvsp_cuda_stream_sync(int ordinal, void *stream);
int kvsp_cuda_event_create(int ordinal, void **event);
int kvsp_cuda_event_record(int ordinal, void *event, void *stream);
int kvsp_cuda_event_sync(int ordinal, void *event);
int kvsp_cuda_event_destroy(int ordinal, void *event);

/* CUDA IPC: export device memory to another process on the node. */
int kvsp_cuda_ipc_get(int ordinal, uint64_t dptr, unsigned char handle[KVSP_CUDA_IPC_HANDLE_SIZE]);
int kvsp_cuda_ipc_open(int ordinal, const unsigned char handle[KVSP_CUDA_IPC_HANDLE_SIZE], uint64_t *dptr, size_t *size);
int kvsp_cuda_ipc_close(int ordinal, uint64_t dptr);

/* GPUDirect RDMA: kvsp_cuda_dmabuf exports the host-page-aligned range
 * around [dptr, dptr+n) of one allocation as a dma-buf (a NIC registers it
 * with ibv_reg_dmabuf_mr); *offset is dptr's offset in it, *size its
 * length. The caller closes *fd. KVSP_CUDA_NOT_SUPPORTED when the device,
 * the driver (before CUDA 11.7) or the allocation's alignment does not
 * allow it. */
int kvsp_cuda_dmabuf(int ordinal, uint64_t dptr, size_t n, int *fd, uint64_t *offset, uint64_t *size);

/* Modules (PTX) and kernel launches. */
int kvsp_cuda_module_load(int ordinal, const void *image, void **module);
int kvsp_cuda_module_unload(int ordinal, void *module);
int kvsp_cuda_module_function(int ordinal, void *module, const char *name, void **fn);
int kvsp_cuda_launch(int ordinal, void *fn, unsigned grid_x, unsigned grid_y, unsigned block_x, unsigned shared,
                     void *stream, void **params);

/* The paged gather/scatter kernels (csrc/kvsp_gather.cu): one thread block
 * per (token, layer x K/V). */
int kvsp_cuda_launch_paged(int ordinal, void *fn, uint64_t pool, uint64_t sections, uint64_t table, int page_tokens,
                           long long layer_stride, long long v_offset, long long page_stride, int first, int tokens,
                           int row_bytes, int layers, void *stream);

#endif

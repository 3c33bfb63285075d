/*
 * kvsp_cuda: the CUDA driver API through dlopen (see kvsp_cuda.h).
 *
 * Built two ways: by cgo in package gpu, with the few driver types
 * declared here; and by `make build-gpu` with -DKVSP_WITH_CUDA_H against
 * the real <cuda.h>, where every function pointer type below is checked
 * against the driver's own prototype, so a wrong prototype fails to
 * compile.
 */
#include "kvsp_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* The driver's flag values the shim uses, checked against cuda.h's by
 * the build against it. */
#define KVSP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
#define KVSP_MEMHOSTALLOC_PORTABLE 0x01
#define KVSP_MEMHOSTREGISTER_PORTABLE 0x01
#define KVSP_EVENT_DISABLE_TIMING 0x2
#define KVSP_STREAM_NON_BLOCKING 0x1
#define KVSP_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED 124
#define KVSP_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 0x1

#ifdef KVSP_WITH_CUDA_H
#include <cuda.h>
_Static_assert(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS == KVSP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, "flag value");
_Static_assert(CU_MEMHOSTALLOC_PORTABLE == KVSP_MEMHOSTALLOC_PORTABLE, "flag value");
_Static_assert(CU_MEMHOSTREGISTER_PORTABLE == KVSP_MEMHOSTREGISTER_PORTABLE, "flag value");
_Static_assert(CU_EVENT_DISABLE_TIMING == KVSP_EVENT_DISABLE_TIMING, "flag value");
_Static_assert(CU_STREAM_NON_BLOCKING == KVSP_STREAM_NON_BLOCKING, "flag value");
#else
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef int CUdevice_attribute;
typedef int CUmemRangeHandleType;
typedef struct CUipcMemHandle_st {
	char reserved[KVSP_CUDA_IPC_HANDLE_SIZE];
} CUipcMemHandle;
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS KVSP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
#define CU_MEMHOSTALLOC_PORTABLE KVSP_MEMHOSTALLOC_PORTABLE
#define CU_MEMHOSTREGISTER_PORTABLE KVSP_MEMHOSTREGISTER_PORTABLE
#define CU_EVENT_DISABLE_TIMING KVSP_EVENT_DISABLE_TIMING
#define CU_STREAM_NON_BLOCKING KVSP_STREAM_NON_BLOCKING
#endif

/* Every driver entry the shim uses: name (the exported symbol), and the
 * parameter list. The return type is CUresult for all. */
#define KVSP_CU_FUNCS(X)                                                                                    \
	X(cuInit, (unsigned int))                                                                           \
	X(cuDeviceGetCount, (int *))                                                                        \
	X(cuDeviceGet, (CUdevice *, int))                                                                   \
	X(cuDeviceGetName, (char *, int, CUdevice))                                                         \
	X(cuDeviceTotalMem_v2, (size_t *, CUdevice))                                                        \
	X(cuDeviceGetPCIBusId, (char *, int, CUdevice))                                                     \
	X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                                                \
	X(cuDevicePrimaryCtxRelease_v2, (CUdevice))                                                         \
	X(cuCtxSetCurrent, (CUcontext))                                                                     \
	X(cuCtxSynchronize, (void))                                                                         \
	X(cuMemGetInfo_v2, (size_t *, size_t *))                                                            \
	X(cuMemAlloc_v2, (CUdeviceptr *, size_t))                                                           \
	X(cuMemFree_v2, (CUdeviceptr))                                                                      \
	X(cuMemHostAlloc, (void **, size_t, unsigned int))                                                  \
	X(cuMemFreeHost, (void *))                                                                          \
	X(cuMemHostRegister_v2, (void *, size_t, unsigned int))                                             \
	X(cuMemHostUnregister, (void *))                                                                    \
	X(cuMemcpyHtoD_v2, (CUdeviceptr, const void *, size_t))                                             \
	X(cuMemcpyDtoH_v2, (void *, CUdeviceptr, size_t))                                                   \
	X(cuMemcpyDtoD_v2, (CUdeviceptr, CUdeviceptr, size_t))                                              \
	X(cuMemcpyHtoDAsync_v2, (CUdeviceptr, const void *, size_t, CUstream))                              \
	X(cuMemcpyDtoHAsync_v2, (void *, CUdeviceptr, size_t, CUstream))                                    \
	X(cuStreamCreate, (CUstream *, unsigned int))                                                       \
	X(cuStreamDestroy_v2, (CUstream))                                                                   \
	X(cuStreamSynchronize, (CUstream))                                                                  \
	X(cuEventCreate, (CUevent *, unsigned int))                                                         \
	X(cuEventRecord, (CUevent, CUstream))                                                               \
	X(cuEventSynchronize, (CUevent))                                                                    \
	X(cuEventDestroy_v2, (CUevent))                                                                     \
	X(cuIpcGetMemHandle, (CUipcMemHandle *, CUdeviceptr))                                               \
	X(cuIpcOpenMemHandle_v2, (CUdeviceptr *, CUipcMemHandle, unsigned int))                             \
	X(cuIpcCloseMemHandle, (CUdeviceptr))                                                               \
	X(cuMemGetAddressRange_v2, (CUdeviceptr *, size_t *, CUdeviceptr))                                  \
	X(cuModuleLoadData, (CUmodule *, const void *))                                                     \
	X(cuModuleUnload, (CUmodule))                                                                       \
	X(cuModuleGetFunction, (CUfunction *, CUmodule, const char *))                                      \
	X(cuLaunchKernel, (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, \
	                   unsigned int, unsigned int, CUstream, void **, void **))                         \
	X(cuDeviceGetAttribute, (int *, CUdevice_attribute, CUdevice))                                     \
	X(cuGetErrorString, (CUresult, const char **))

/* Entries the shim does without on older drivers: looked up, not
 * required. */
#define KVSP_CU_OPTIONAL(X) X(cuMemGetHandleForAddressRange, (void *, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long))

#define KVSP_PFN(name, params) typedef CUresult (*kvsp_pfn_##name) params;
KVSP_CU_FUNCS(KVSP_PFN)
KVSP_CU_OPTIONAL(KVSP_PFN)

#ifdef KVSP_WITH_CUDA_H
/* The prototype check: each pointer type must be the driver's own. */
/* And the symbol: dlsym takes the name as written (#name), while cuda.h
 * may map a plain name to a versioned one (cuMemAlloc to cuMemAlloc_v2);
 * the plain symbol is then an older ABI. The expanded name must be the
 * written one. */
#define KVSP_STR(x) #x
#define KVSP_XSTR(x) KVSP_STR(x)
#define KVSP_CHECK(name, params)                                                       \
	_Static_assert(__builtin_types_compatible_p(__typeof__(&name), kvsp_pfn_##name),     \
	               "kvsp_cuda: the prototype of " #name " differs from cuda.h");         \
	_Static_assert(sizeof(KVSP_XSTR(name)) == sizeof(#name),                              \
	               "kvsp_cuda: cuda.h maps " #name " to a versioned symbol: use that one");
KVSP_CU_FUNCS(KVSP_CHECK)
KVSP_CU_OPTIONAL(KVSP_CHECK)
_Static_assert(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED == KVSP_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, "attribute value");
_Static_assert(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD == KVSP_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, "handle type value");
#endif

static struct {
#define KVSP_FIELD(name, params) kvsp_pfn_##name name;
	KVSP_CU_FUNCS(KVSP_FIELD)
	KVSP_CU_OPTIONAL(KVSP_FIELD)
} cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_status = KVSP_CUDA_NO_DRIVER;
static char load_error[256];
static void *lib;

static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static CUcontext ctx[KVSP_CUDA_MAX_DEVICES];
static CUdevice dev[KVSP_CUDA_MAX_DEVICES];
/* refs counts the opens of each ordinal: every open retains the primary
 * context and every close releases it, so closing one Device of an
 * ordinal leaves the others' context (their memory, streams, modules)
 * alone; the driver resets it when the last is released. */
static int refs[KVSP_CUDA_MAX_DEVICES];

static void load(void) {
	lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (lib == NULL) {
		const char *e = dlerror();
		snprintf(load_error, sizeof load_error, "libcuda.so.1 could not be loaded (no NVIDIA driver?): %s",
		         e ? e : "unknown error");
		return;
	}
#define KVSP_SYM(name, params)                                                                    \
	cu.name = (kvsp_pfn_##name)dlsym(lib, #name);                                                  \
	if (cu.name == NULL) {                                                                         \
		snprintf(load_error, sizeof load_error, "libcuda.so.1 has no %s (driver too old)", #name); \
		return;                                                                                    \
	}
	KVSP_CU_FUNCS(KVSP_SYM)
#define KVSP_OPT_SYM(name, params) cu.name = (kvsp_pfn_##name)dlsym(lib, #name);
	KVSP_CU_OPTIONAL(KVSP_OPT_SYM)
	load_status = (int)cu.cuInit(0);
	if (load_status != 0) {
		const char *s = NULL;
		cu.cuGetErrorString((CUresult)load_status, &s);
		snprintf(load_error, sizeof load_error, "cuInit: %s (code %d)", s ? s : "unknown error", load_status);
	}
}

int kvsp_cuda_load(char *err, size_t errlen) {
	pthread_once(&load_once, load);
	if (load_status != 0 && err != NULL && errlen > 0) {
		snprintf(err, errlen, "%s", load_error);
	}
	return load_status;
}

const char *kvsp_cuda_error(int code) {
	switch (code) {
	case 0:
		return "no error";
	case KVSP_CUDA_NO_DRIVER:
		return load_error[0] ? load_error : "the CUDA driver is not loaded";
	case KVSP_CUDA_NOT_OPEN:
		return "the device was not opened";
	case KVSP_CUDA_NOT_SUPPORTED:
		return "not supported by this device, driver or allocation (dma-buf export needs CUDA 11.7+, the device's dma-buf support and page-aligned allocations)";
	}
	const char *s = NULL;
	if (load_status == 0 && cu.cuGetErrorString((CUresult)code, &s) == 0 && s != NULL) {
		return s;
	}
	return "unknown CUDA error";
}

/* current makes the ordinal's primary context current on this thread. */
static int current(int ordinal) {
	if (load_status != 0) {
		return KVSP_CUDA_NO_DRIVER;
	}
	if (ordinal < 0 || ordinal >= KVSP_CUDA_MAX_DEVICES) {
		return KVSP_CUDA_NOT_OPEN;
	}
	pthread_mutex_lock(&ctx_mu);
	CUcontext c = refs[ordinal] > 0 ? ctx[ordinal] : NULL;
	pthread_mutex_unlock(&ctx_mu);
	if (c == NULL) {
		return KVSP_CUDA_NOT_OPEN;
	}
	return (int)cu.cuCtxSetCurrent(c);
}

#define CALL(expr)                   \
	do {                         \
		int rc_ = current(ordinal); \
		if (rc_ != 0) {      \
			return rc_;  \
		}                    \
		return (int)(expr);  \
	} while (0)

int kvsp_cuda_device_count(int *n) {
	if (load_status != 0) {
		return KVSP_CUDA_NO_DRIVER;
	}
	return (int)cu.cuDeviceGetCount(n);
}

int kvsp_cuda_open(int ordinal, char *name, int namelen, size_t *total) {
	if (load_status != 0) {
		return KVSP_CUDA_NO_DRIVER;
	}
	if (ordinal < 0 || ordinal >= KVSP_CUDA_MAX_DEVICES) {
		return KVSP_CUDA_NOT_OPEN;
	}
	pthread_mutex_lock(&ctx_mu);
	CUdevice d;
	CUcontext c;
	int rc = (int)cu.cuDeviceGet(&d, ordinal);
	if (rc == 0) {
		rc = (int)cu.cuDevicePrimaryCtxRetain(&c, d);
	}
	if (rc == 0) {
		rc = (int)cu.cuDeviceGetName(name, namelen, d);
		if (rc == 0) {
			rc = (int)cu.cuDeviceTotalMem_v2(total, d);
		}
		if (rc != 0) {
			cu.cuDevicePrimaryCtxRelease_v2(d);
		}
	}
	if (rc == 0) {
		dev[ordinal] = d;
		ctx[ordinal] = c;
		refs[ordinal]++;
	}
	pthread_mutex_unlock(&ctx_mu);
	return rc;
}

int kvsp_cuda_close(int ordinal) {
	if (load_status != 0) {
		return KVSP_CUDA_NO_DRIVER;
	}
	if (ordinal < 0 || ordinal >= KVSP_CUDA_MAX_DEVICES) {
		return KVSP_CUDA_NOT_OPEN;
	}
	pthread_mutex_lock(&ctx_mu);
	int rc = KVSP_CUDA_NOT_OPEN;
	if (refs[ordinal] > 0) {
		rc = (int)cu.cuDevicePrimaryCtxRelease_v2(dev[ordinal]);
		if (--refs[ordinal] == 0) {
			ctx[ordinal] = NULL;
		}
	}
	pthread_mutex_unlock(&ctx_mu);
	return rc;
}

int kvsp_cuda_mem_info(int ordinal, size_t *free_bytes, size_t *total) { CALL(cu.cuMemGetInfo_v2(free_bytes, total)); }

int kvsp_cuda_sync(int ordinal) { CALL(cu.cuCtxSynchronize()); }

int kvsp_cuda_pci_bus_id(int ordinal, char *id, int len) {
	if (load_status != 0) {
		return KVSP_CUDA_NO_DRIVER;
	}
	if (ordinal < 0 || ordinal >= KVSP_CUDA_MAX_DEVICES) {
		return KVSP_CUDA_NOT_OPEN;
	}
	pthread_mutex_lock(&ctx_mu);
	int open = refs[ordinal] > 0;
	CUdevice d = dev[ordinal];
	pthread_mutex_unlock(&ctx_mu);
	if (!open) {
		return KVSP_CUDA_NOT_OPEN;
	}
	return (int)cu.cuDeviceGetPCIBusId(id, len, d);
}

int kvsp_cuda_alloc(int ordinal, uint64_t *dptr, size_t n) {
	CUdeviceptr p = 0;
	int rc = current(ordinal);
	if (rc == 0) {
		rc = (int)cu.cuMemAlloc_v2(&p, n);
	}
	*dptr = (uint64_t)p;
	return rc;
}

int kvsp_cuda_free(int ordinal, uint64_t dptr) { CALL(cu.cuMemFree_v2((CUdeviceptr)dptr)); }

int kvsp_cuda_host_alloc(int ordinal, void **p, size_t n) { CALL(cu.cuMemHostAlloc(p, n, CU_MEMHOSTALLOC_PORTABLE)); }

int kvsp_cuda_host_free(int ordinal, void *p) { CALL(cu.cuMemFreeHost(p)); }

int kvsp_cuda_host_register(int ordinal, void *p, size_t n) {
	CALL(cu.cuMemHostRegister_v2(p, n, CU_MEMHOSTREGISTER_PORTABLE));
}

int kvsp_cuda_host_unregister(int ordinal, void *p) { CALL(cu.cuMemHostUnregister(p)); }

/* The synchronous copies return only once the octets are in place: from
 * pageable memory cuMemcpyHtoD may return once they are staged, and
 * cuMemcpyDtoD before it ran, both on the legacy stream, which the
 * shim's non-blocking streams do not wait for. */
int kvsp_cuda_htod(int ordinal, uint64_t dst, const void *src, size_t n) {
	int rc = current(ordinal);
	if (rc == 0) {
		rc = (int)cu.cuMemcpyHtoD_v2((CUdeviceptr)dst, src, n);
	}
	if (rc == 0) {
		rc = (int)cu.cuStreamSynchronize(NULL);
	}
	return rc;
}

int kvsp_cuda_dtoh(int ordinal, void *dst, uint64_t src, size_t n) { CALL(cu.cuMemcpyDtoH_v2(dst, (CUdeviceptr)src, n)); }

int kvsp_cuda_dtod(int ordinal, uint64_t dst, uint64_t src, size_t n) {
	int rc = current(ordinal);
	if (rc == 0) {
		rc = (int)cu.cuMemcpyDtoD_v2((CUdeviceptr)dst, (CUdeviceptr)src, n);
	}
	if (rc == 0) {
		rc = (int)cu.cuStreamSynchronize(NULL);
	}
	return rc;
}

int kvsp_cuda_htod_async(int ordinal, uint64_t dst, const void *src, size_t n, void *stream) {
	CALL(cu.cuMemcpyHtoDAsync_v2((CUdeviceptr)dst, src, n, (CUstream)stream));
}

int kvsp_cuda_dtoh_async(int ordinal, void *dst, uint64_t src, size_t n, void *stream) {
	CALL(cu.cuMemcpyDtoHAsync_v2(dst, (CUdeviceptr)src, n, (CUstream)stream));
}

int kvsp_cuda_stream_create(int ordinal, void **stream) {
	CALL(cu.cuStreamCreate((CUstream *)stream, CU_STREAM_NON_BLOCKING));
}

int kvsp_cuda_stream_destroy(int ordinal, void *stream) { CALL(cu.cuStreamDestroy_v2((CUstream)stream)); }

int kvsp_cuda_stream_sync(int ordinal, void *stream) { CALL(cu.cuStreamSynchronize((CUstream)stream)); }

int kvsp_cuda_event_create(int ordinal, void **event) {
	CALL(cu.cuEventCreate((CUevent *)event, CU_EVENT_DISABLE_TIMING));
}

int kvsp_cuda_event_record(int ordinal, void *event, void *stream) {
	CALL(cu.cuEventRecord((CUevent)event, (CUstream)stream));
}

int kvsp_cuda_event_sync(int ordinal, void *event) { CALL(cu.cuEventSynchronize((CUevent)event)); }

int kvsp_cuda_event_destroy(int ordinal, void *event) { CALL(cu.cuEventDestroy_v2((CUevent)event)); }

int kvsp_cuda_ipc_get(int ordinal, uint64_t dptr, unsigned char handle[KVSP_CUDA_IPC_HANDLE_SIZE]) {
	CUipcMemHandle h;
	int rc = current(ordinal);
	if (rc == 0) {
		rc = (int)cu.cuIpcGetMemHandle(&h, (CUdeviceptr)dptr);
	}
	if (rc == 0) {
		memcpy(handle, h.reserved, KVSP_CUDA_IPC_HANDLE_SIZE);
	}
	return rc;
}

int kvsp_cuda_ipc_open(int ordinal, const unsigned char handle[KVSP_CUDA_IPC_HANDLE_SIZE], uint64_t *dptr, size_t *size) {
	CUipcMemHandle h;
	CUdeviceptr p = 0, base = 0;
	memcpy(h.reserved, handle, KVSP_CUDA_IPC_HANDLE_SIZE);
	*size = 0;
	int rc = current(ordinal);
	if (rc == 0) {
		rc = (int)cu.cuIpcOpenMemHandle_v2(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	}
	if (rc == 0) { /* the allocation's real size: the importer's claim is not trusted */
		rc = (int)cu.cuMemGetAddressRange_v2(&base, size, p);
		if (rc == 0) {
			*size -= (size_t)(p - base);
		} else {
			cu.cuIpcCloseMemHandle(p);
			p = 0;
		}
	}
	*dptr = (uint64_t)p;
	return rc;
}

int kvsp_cuda_ipc_close(int ordinal, uint64_t dptr) { CALL(cu.cuIpcCloseMemHandle((CUdeviceptr)dptr)); }

int kvsp_cuda_dmabuf(int ordinal, uint64_t dptr, size_t n, int *fd, uint64_t *offset, uint64_t *size) {
	int rc = current(ordinal);
	if (rc != 0) {
		return rc;
	}
	if (cu.cuMemGetHandleForAddressRange == NULL) {
		return KVSP_CUDA_NOT_SUPPORTED;
	}
	pthread_mutex_lock(&ctx_mu);
	CUdevice d = dev[ordinal];
	pthread_mutex_unlock(&ctx_mu);
	int ok = 0;
	if (cu.cuDeviceGetAttribute(&ok, (CUdevice_attribute)KVSP_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, d) != 0 || !ok) {
		return KVSP_CUDA_NOT_SUPPORTED;
	}
	CUdeviceptr base;
	size_t len;
	if ((rc = (int)cu.cuMemGetAddressRange_v2(&base, &len, (CUdeviceptr)dptr)) != 0) {
		return rc;
	}
	uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
	uint64_t lo = dptr / pg * pg, hi = (dptr + n + pg - 1) / pg * pg;
	if (lo < base || hi > base + len) { /* the page-aligned range leaves the allocation */
		return KVSP_CUDA_NOT_SUPPORTED;
	}
	int h = -1;
	if ((rc = (int)cu.cuMemGetHandleForAddressRange(&h, (CUdeviceptr)lo, (size_t)(hi - lo),
	                                                (CUmemRangeHandleType)KVSP_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)) != 0) {
		return rc;
	}
	*fd = h;
	*offset = dptr - lo;
	*size = hi - lo;
	return 0;
}

int kvsp_cuda_module_load(int ordinal, const void *image, void **module) {
	CALL(cu.cuModuleLoadData((CUmodule *)module, image));
}

int kvsp_cuda_module_unload(int ordinal, void *module) { CALL(cu.cuModuleUnload((CUmodule)module)); }

int kvsp_cuda_module_function(int ordinal, void *module, const char *name, void **fn) {
	CALL(cu.cuModuleGetFunction((CUfunction *)fn, (CUmodule)module, name));
}

int kvsp_cuda_launch(int ordinal, void *fn, unsigned grid_x, unsigned grid_y, unsigned block_x, unsigned shared,
                     void *stream, void **params) {
	CALL(cu.cuLaunchKernel((CUfunction)fn, grid_x, grid_y, 1, block_x, 1, 1, shared, (CUstream)stream, params, NULL));
}

int kvsp_cuda_launch_paged(int ordinal, void *fn, uint64_t pool, uint64_t sections, uint64_t table, int page_tokens,
                           long long layer_stride, long long v_offset, long long page_stride, int first, int tokens,
                           int row_bytes, int layers, void *stream) {
	/* The kernels' parameters, in order: see csrc/kvsp_gather.cu. */
	CUdeviceptr p = (CUdeviceptr)pool, s = (CUdeviceptr)sections, t = (CUdeviceptr)table;
	void *params[] = {&p, &s, &t, &page_tokens, &layer_stride, &v_offset, &page_stride, &first, &tokens, &row_bytes};
	unsigned threads = row_bytes >= 16 * 128 ? 128 : (unsigned)((row_bytes + 15) / 16 + 31) / 32 * 32;
	CALL(cu.cuLaunchKernel((CUfunction)fn, (unsigned)tokens, (unsigned)(2 * layers), 1, threads, 1, 1, 0, (CUstream)stream,
	                       params, NULL));
}

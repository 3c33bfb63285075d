/* kvsp_verbs: a flat C ABI over libibverbs for package rdma (build tag
 * rdma): one device and protection domain, memory registration, RC queue
 * pairs (one completion queue each) and one-sided RDMA READ. */
#ifndef KVSP_VERBS_H
#define KVSP_VERBS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvsp_rdma_dev kvsp_rdma_dev;
typedef struct kvsp_rdma_qp kvsp_rdma_qp;

/* kvsp_rdma_open opens the device named name (NULL or "": the first) on
 * port 1. It returns NULL and a message in err when there is none. */
kvsp_rdma_dev *kvsp_rdma_open(const char *name, char *err, size_t errlen);
void kvsp_rdma_close(kvsp_rdma_dev *d);
const char *kvsp_rdma_name(kvsp_rdma_dev *d);

/* Registration: the MR's keys come back through lkey and rkey. access:
 * KVSP_RDMA_REMOTE_READ lets peers read it with its rkey,
 * KVSP_RDMA_MW_BIND lets memory windows be bound over it. */
#define KVSP_RDMA_REMOTE_READ 1
#define KVSP_RDMA_MW_BIND 2
void *kvsp_rdma_reg(kvsp_rdma_dev *d, void *addr, size_t len, int access, uint32_t *lkey, uint32_t *rkey, int *err);
int kvsp_rdma_dereg(void *mr);
/* kvsp_rdma_reg_dmabuf registers len octets at offset of a dma-buf (an
 * accelerator's memory: GPUDirect RDMA), addressed by peers at iova. */
void *kvsp_rdma_reg_dmabuf(kvsp_rdma_dev *d, int fd, uint64_t offset, size_t len, uint64_t iova, int access, uint32_t *lkey,
			   uint32_t *rkey, int *err);

/* Memory windows (type 2): a window bound through a queue pair's send
 * queue lets that pair's peer, and no other, read [addr, addr+len) of an
 * MR registered with KVSP_RDMA_MW_BIND, with the window's own rkey;
 * invalidating it (a local-invalidate work request) revokes that rkey
 * while the MR stays registered. kvsp_rdma_mw_supported says whether the
 * device has them. Posts are signaled: the caller polls their completion
 * with kvsp_rdma_poll. */
int kvsp_rdma_mw_supported(kvsp_rdma_dev *d);
void *kvsp_rdma_mw_alloc(kvsp_rdma_dev *d, int *err);
int kvsp_rdma_mw_dealloc(void *mw);
int kvsp_rdma_mw_bind_post(kvsp_rdma_qp *q, void *mw, void *mr, uint64_t addr, uint64_t len, uint32_t *rkey);
int kvsp_rdma_inv_post(kvsp_rdma_qp *q, uint32_t rkey);

kvsp_rdma_qp *kvsp_rdma_qp_create(kvsp_rdma_dev *d, int *err);
void kvsp_rdma_qp_endpoint(kvsp_rdma_dev *d, kvsp_rdma_qp *q, uint16_t *lid, uint32_t *qpn, uint32_t *psn, uint8_t gid[16]);
int kvsp_rdma_qp_connect(kvsp_rdma_dev *d, kvsp_rdma_qp *q, uint16_t lid, uint32_t qpn, uint32_t psn, const uint8_t gid[16]);
int kvsp_rdma_read_post(kvsp_rdma_qp *q, void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t len);
/* kvsp_rdma_poll returns 1 with the completion status, 0 when none, -1
 * on error. */
int kvsp_rdma_poll(kvsp_rdma_qp *q, int *status);
void kvsp_rdma_qp_destroy(kvsp_rdma_qp *q);

#endif

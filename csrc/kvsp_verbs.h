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

/* Registration: the MR's keys come back through lkey and rkey. */
void *kvsp_rdma_reg(kvsp_rdma_dev *d, void *addr, size_t len, int remote_read, uint32_t *lkey, uint32_t *rkey, int *err);
int kvsp_rdma_dereg(void *mr);

kvsp_rdma_qp *kvsp_rdma_qp_create(kvsp_rdma_dev *d, int *err);
void kvsp_rdma_qp_endpoint(kvsp_rdma_dev *d, kvsp_rdma_qp *q, uint16_t *lid, uint32_t *qpn, uint32_t *psn, uint8_t gid[16]);
int kvsp_rdma_qp_connect(kvsp_rdma_dev *d, kvsp_rdma_qp *q, uint16_t lid, uint32_t qpn, uint32_t psn, const uint8_t gid[16]);
int kvsp_rdma_read_post(kvsp_rdma_qp *q, void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t len);
/* kvsp_rdma_poll returns 1 with the completion status, 0 when none, -1
 * on error. */
int kvsp_rdma_poll(kvsp_rdma_qp *q, int *status);
void kvsp_rdma_qp_destroy(kvsp_rdma_qp *q);

#endif

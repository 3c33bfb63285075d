/* See kvsp_verbs.h. Compiled into package rdma only with -tags rdma. */
#include "kvsp_verbs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

struct kvsp_rdma_dev {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	uint8_t port;
	int gid_index;
	uint16_t lid;
	union ibv_gid gid;
	enum ibv_mtu mtu;
	char name[64];
};

struct kvsp_rdma_qp {
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	uint32_t psn;
};

kvsp_rdma_dev *kvsp_rdma_open(const char *name, char *err, size_t errlen) {
	int n = 0;
	errno = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (list == NULL) {
		/* No RDMA kernel support: ENOSYS, not an empty list. */
		snprintf(err, errlen, "ibv_get_device_list: %s (no RDMA support in this kernel or machine)",
			 strerror(errno ? errno : ENOSYS));
		return NULL;
	}
	struct ibv_device *dev = NULL;
	for (int i = 0; i < n; i++) {
		if (name == NULL || name[0] == 0 || strcmp(ibv_get_device_name(list[i]), name) == 0) {
			dev = list[i];
			break;
		}
	}
	if (dev == NULL) {
		snprintf(err, errlen, n == 0 ? "ibv_get_device_list found none" : "none named %s", name ? name : "");
		ibv_free_device_list(list);
		return NULL;
	}
	kvsp_rdma_dev *d = calloc(1, sizeof *d);
	if (d == NULL) {
		snprintf(err, errlen, "out of memory");
		ibv_free_device_list(list);
		return NULL;
	}
	snprintf(d->name, sizeof d->name, "%s", ibv_get_device_name(dev));
	d->ctx = ibv_open_device(dev);
	ibv_free_device_list(list);
	if (d->ctx == NULL) {
		snprintf(err, errlen, "ibv_open_device %s: %s", d->name, strerror(errno));
		free(d);
		return NULL;
	}
	d->port = 1;
	struct ibv_port_attr pa;
	if (ibv_query_port(d->ctx, d->port, &pa) != 0) {
		snprintf(err, errlen, "ibv_query_port %s: %s", d->name, strerror(errno));
		ibv_close_device(d->ctx);
		free(d);
		return NULL;
	}
	d->lid = pa.lid;
	d->mtu = pa.active_mtu;
	d->gid_index = 0;
	if (ibv_query_gid(d->ctx, d->port, d->gid_index, &d->gid) != 0) {
		memset(&d->gid, 0, sizeof d->gid);
	}
	d->pd = ibv_alloc_pd(d->ctx);
	if (d->pd == NULL) {
		snprintf(err, errlen, "ibv_alloc_pd %s: %s", d->name, strerror(errno));
		ibv_close_device(d->ctx);
		free(d);
		return NULL;
	}
	return d;
}

void kvsp_rdma_close(kvsp_rdma_dev *d) {
	if (d == NULL) {
		return;
	}
	ibv_dealloc_pd(d->pd);
	ibv_close_device(d->ctx);
	free(d);
}

const char *kvsp_rdma_name(kvsp_rdma_dev *d) { return d->name; }

static int access_flags(int access) {
	int flags = IBV_ACCESS_LOCAL_WRITE;
	if (access & KVSP_RDMA_REMOTE_READ) {
		flags |= IBV_ACCESS_REMOTE_READ;
	}
	if (access & KVSP_RDMA_MW_BIND) {
		flags |= IBV_ACCESS_MW_BIND;
	}
	return flags;
}

void *kvsp_rdma_reg(kvsp_rdma_dev *d, void *addr, size_t len, int access, uint32_t *lkey, uint32_t *rkey, int *err) {
	struct ibv_mr *mr = ibv_reg_mr(d->pd, addr, len, access_flags(access));
	if (mr == NULL) {
		*err = errno;
		return NULL;
	}
	*lkey = mr->lkey;
	*rkey = mr->rkey;
	return mr;
}

void *kvsp_rdma_reg_dmabuf(kvsp_rdma_dev *d, int fd, uint64_t offset, size_t len, uint64_t iova, int access, uint32_t *lkey,
			   uint32_t *rkey, int *err) {
	errno = 0;
	struct ibv_mr *mr = ibv_reg_dmabuf_mr(d->pd, offset, len, iova, fd, access_flags(access));
	if (mr == NULL) {
		*err = errno ? errno : EOPNOTSUPP;
		return NULL;
	}
	*lkey = mr->lkey;
	*rkey = mr->rkey;
	return mr;
}

int kvsp_rdma_dereg(void *mr) { return ibv_dereg_mr((struct ibv_mr *)mr); }

int kvsp_rdma_mw_supported(kvsp_rdma_dev *d) {
	struct ibv_device_attr a;
	if (ibv_query_device(d->ctx, &a) != 0) {
		return 0;
	}
	return (a.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0;
}

void *kvsp_rdma_mw_alloc(kvsp_rdma_dev *d, int *err) {
	errno = 0;
	struct ibv_mw *mw = ibv_alloc_mw(d->pd, IBV_MW_TYPE_2);
	if (mw == NULL) {
		*err = errno ? errno : EOPNOTSUPP;
	}
	return mw;
}

int kvsp_rdma_mw_dealloc(void *mw) { return ibv_dealloc_mw((struct ibv_mw *)mw); }

int kvsp_rdma_mw_bind_post(kvsp_rdma_qp *q, void *mw, void *mr, uint64_t addr, uint64_t len, uint32_t *rkey) {
	struct ibv_mw *w = mw;
	/* A type 2 window gets a new key on each bind: the key's low octet
	 * moves on, so a key of an earlier binding no longer matches. */
	uint32_t k = ibv_inc_rkey(w->rkey);
	struct ibv_send_wr wr = {
		.wr_id = 2,
		.opcode = IBV_WR_BIND_MW,
		.send_flags = IBV_SEND_SIGNALED,
	};
	wr.bind_mw.mw = w;
	wr.bind_mw.rkey = k;
	wr.bind_mw.bind_info.mr = mr;
	wr.bind_mw.bind_info.addr = addr;
	wr.bind_mw.bind_info.length = len;
	wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
	struct ibv_send_wr *bad = NULL;
	int rc = ibv_post_send(q->qp, &wr, &bad);
	if (rc == 0) {
		w->rkey = k; /* the library leaves a type 2 window's key to us */
		*rkey = k;
	}
	return rc;
}

int kvsp_rdma_inv_post(kvsp_rdma_qp *q, uint32_t rkey) {
	struct ibv_send_wr wr = {
		.wr_id = 3,
		.opcode = IBV_WR_LOCAL_INV,
		.send_flags = IBV_SEND_SIGNALED,
	};
	wr.invalidate_rkey = rkey;
	struct ibv_send_wr *bad = NULL;
	return ibv_post_send(q->qp, &wr, &bad);
}

kvsp_rdma_qp *kvsp_rdma_qp_create(kvsp_rdma_dev *d, int *err) {
	kvsp_rdma_qp *q = calloc(1, sizeof *q);
	if (q == NULL) {
		*err = ENOMEM;
		return NULL;
	}
	q->cq = ibv_create_cq(d->ctx, 64, NULL, NULL, 0);
	if (q->cq == NULL) {
		*err = errno;
		free(q);
		return NULL;
	}
	struct ibv_qp_init_attr ia = {
		.send_cq = q->cq,
		.recv_cq = q->cq,
		.qp_type = IBV_QPT_RC,
		.sq_sig_all = 1,
		.cap = {.max_send_wr = 16, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1},
	};
	q->qp = ibv_create_qp(d->pd, &ia);
	if (q->qp == NULL) {
		*err = errno;
		ibv_destroy_cq(q->cq);
		free(q);
		return NULL;
	}
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_INIT,
		.pkey_index = 0,
		.port_num = d->port,
		.qp_access_flags = IBV_ACCESS_REMOTE_READ,
	};
	if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
		*err = errno;
		kvsp_rdma_qp_destroy(q);
		return NULL;
	}
	q->psn = (uint32_t)(random() & 0xffffff);
	return q;
}

void kvsp_rdma_qp_endpoint(kvsp_rdma_dev *d, kvsp_rdma_qp *q, uint16_t *lid, uint32_t *qpn, uint32_t *psn, uint8_t gid[16]) {
	*lid = d->lid;
	*qpn = q->qp->qp_num;
	*psn = q->psn;
	memcpy(gid, d->gid.raw, 16);
}

int kvsp_rdma_qp_connect(kvsp_rdma_dev *d, kvsp_rdma_qp *q, uint16_t lid, uint32_t qpn, uint32_t psn, const uint8_t gid[16]) {
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_RTR,
		.path_mtu = d->mtu,
		.dest_qp_num = qpn,
		.rq_psn = psn,
		.max_dest_rd_atomic = 16,
		.min_rnr_timer = 12,
		.ah_attr = {.dlid = lid, .sl = 0, .src_path_bits = 0, .port_num = d->port},
	};
	int global = 0;
	for (int i = 0; i < 16; i++) {
		global |= gid[i];
	}
	if (global) { /* RoCE, or InfiniBand across subnets: route by GID */
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, gid, 16);
		a.ah_attr.grh.sgid_index = d->gid_index;
		a.ah_attr.grh.hop_limit = 64;
	}
	if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
		return errno;
	}
	struct ibv_qp_attr s = {
		.qp_state = IBV_QPS_RTS,
		.timeout = 14,
		.retry_cnt = 7,
		.rnr_retry = 7,
		.sq_psn = q->psn,
		.max_rd_atomic = 16,
	};
	if (ibv_modify_qp(q->qp, &s, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
					     IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
		return errno;
	}
	return 0;
}

int kvsp_rdma_read_post(kvsp_rdma_qp *q, void *laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t len) {
	struct ibv_sge sge = {.addr = (uintptr_t)laddr, .length = len, .lkey = lkey};
	struct ibv_send_wr wr = {
		.wr_id = 1,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_RDMA_READ,
		.send_flags = IBV_SEND_SIGNALED,
		.wr.rdma = {.remote_addr = raddr, .rkey = rkey},
	};
	struct ibv_send_wr *bad = NULL;
	return ibv_post_send(q->qp, &wr, &bad);
}

int kvsp_rdma_poll(kvsp_rdma_qp *q, int *status) {
	struct ibv_wc wc;
	int n = ibv_poll_cq(q->cq, 1, &wc);
	if (n == 1) {
		*status = wc.status;
	}
	return n;
}

void kvsp_rdma_qp_destroy(kvsp_rdma_qp *q) {
	if (q == NULL) {
		return;
	}
	if (q->qp) {
		ibv_destroy_qp(q->qp);
	}
	if (q->cq) {
		ibv_destroy_cq(q->cq);
	}
	free(q);
}

/* Step 2 of opening an endpoint: CQ, address vector and RDM endpoint on an open domain; the
   endpoint's peers (AV) and its flow-control settings. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "pd_internal.h"

#if PD_HAVE_CUDA_API_PERMITTED
/* EFA with FI_HMEM: forbid the provider's own CUDA calls, so a node without GPUDirect RDMA
   (where EFA would fall back to copies through cudaMemcpy inside libfabric) fails here, at
   start-up, instead of moving KV at a fraction of the speed. */
static int pd_forbid_cuda_api(pd_ep *ep, char *errbuf, size_t errlen) {
    if (!ep->dom->hmem || strcmp(ep->info->fabric_attr->prov_name, "efa") != 0) return 0;
    bool permitted = false;
    int ret = fi_setopt(&ep->ep->fid, FI_OPT_ENDPOINT, FI_OPT_CUDA_API_PERMITTED, &permitted,
                        sizeof(permitted));
    if (ret)
        pd_seterr(errbuf, errlen, "fi_setopt(FI_OPT_CUDA_API_PERMITTED=false): this EFA "
                  "device cannot move GPU memory without CUDA calls (no GPUDirect RDMA)", ret);
    return ret;
}
#else
static int pd_forbid_cuda_api(pd_ep *ep, char *errbuf, size_t errlen) {
    (void)ep; (void)errbuf; (void)errlen;
    return 0;
}
#endif

void pd_close(pd_ep *ep) {
    if (!ep) return;
    /* a progress thread stuck inside the provider still uses everything: leak, don't free */
    if (pd_progress_stop(ep, 2000000000LL)) return;
    if (ep->ep) fi_close(&ep->ep->fid);
    if (ep->av) fi_close(&ep->av->fid);
    if (ep->cq) fi_close(&ep->cq->fid);
    if (ep->rcntr) fi_close(&ep->rcntr->fid);
    pd_domain_release(ep->dom);
    pthread_mutex_destroy(&ep->err_lock);
    free(ep->errs);
    free(ep->ctx);
    free(ep);
}


#define PD_FID(call, what) do { int _r = (int)(call); if (_r) { \
    pd_seterr(errbuf, errlen, what, _r); return _r; } } while (0)

/* The endpoint's CQ, address vector and RDM endpoint, bound and enabled (opening and reset). */
static int pd_ep_fids(pd_ep *ep, char *errbuf, size_t errlen) {
    pd_dom *dom = ep->dom;
    struct fi_info *fi = dom->info;
    struct fi_cq_attr cq_attr;
    memset(&cq_attr, 0, sizeof(cq_attr));
    cq_attr.format = FI_CQ_FORMAT_DATA;
    /* A bounded CQ bounds the work of ONE fi_cq_read: shm's progress copies every queued
       write (process_vm_readv) until the CQ is full, so with the default size one call could
       copy a whole GiB queue and the caller's timeout/slice was never checked. 0 = default. */
    cq_attr.size = ep->cq_size;
    /* tcp's CQ offers a wait fd (its sockets' epoll set): the idle sleeps end when bytes
       arrive instead of after a blind backoff (kick.c: pd_sleep_ns). Asked of tcp only, where
       it was measured; shm refuses one, and verbs/efa (the NIC moves the bytes) keep
       FI_WAIT_NONE, as does tcp if it refuses. */
    ep->wait_fd = -1;
    const char *prov = fi->fabric_attr->prov_name;
    cq_attr.wait_obj = prov && strncmp(prov, "tcp", 3) == 0 ? FI_WAIT_FD : FI_WAIT_NONE;
    if (cq_attr.wait_obj == FI_WAIT_FD && fi_cq_open(dom->domain, &cq_attr, &ep->cq, NULL) == 0) {
        if (fi_control(&ep->cq->fid, FI_GETWAIT, &ep->wait_fd) != 0) ep->wait_fd = -1;
    } else {
        ep->cq = NULL;
        cq_attr.wait_obj = FI_WAIT_NONE;
        PD_FID(fi_cq_open(dom->domain, &cq_attr, &ep->cq, NULL), "fi_cq_open");
    }
    struct fi_av_attr av_attr;
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    PD_FID(fi_av_open(dom->domain, &av_attr, &ep->av, NULL), "fi_av_open");
    PD_FID(fi_endpoint(dom->domain, fi, &ep->ep, NULL), "fi_endpoint");
    PD_FID(fi_ep_bind(ep->ep, &ep->av->fid, 0), "fi_ep_bind(av)");
    PD_FID(fi_ep_bind(ep->ep, &ep->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    if (dom->want_remote_cntr && (fi->caps & FI_RMA_EVENT)) {
        struct fi_cntr_attr ca;
        memset(&ca, 0, sizeof(ca));
        ca.events = FI_CNTR_EVENTS_COMP;
        ca.wait_obj = FI_WAIT_NONE;
        PD_FID(fi_cntr_open(dom->domain, &ca, &ep->rcntr, NULL), "fi_cntr_open");
        PD_FID(fi_ep_bind(ep->ep, &ep->rcntr->fid, FI_REMOTE_WRITE), "fi_ep_bind(cntr)");
    }
    int ret = pd_forbid_cuda_api(ep, errbuf, errlen);
    if (ret) return ret;
    PD_FID(fi_enable(ep->ep), "fi_enable");
    return 0;
}

/* Open an endpoint on `dom` (taking a reference to it). ctx_pool bounds the local writes in
   flight; cq_size 0 = the provider's default. */
int pd_ep_open(pd_ep **out, pd_dom *dom, uint32_t ctx_pool, size_t cq_size,
               char *errbuf, size_t errlen) {
    *out = NULL;
    pd_ep *ep = calloc(1, sizeof(*ep));
    if (!ep) { pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM); return -FI_ENOMEM; }
    pthread_mutex_init(&ep->err_lock, NULL);
    pd_domain_retain(dom);
    ep->dom = dom;
    ep->info = dom->info;
    ep->mr_mode = dom->info->domain_attr->mr_mode;
    ep->cq_size = cq_size;
    ep->wait_fd = ep->wake_fd = ep->ctl_fd = ep->news_fd = -1;
    int ret = pd_ep_fids(ep, errbuf, errlen);
    if (ret) { pd_close(ep); return ret; }
    ep->ctx_n = ctx_pool ? ctx_pool : 1;
    ep->ctx = calloc(ep->ctx_n, sizeof(*ep->ctx));
    if (!ep->ctx) {
        pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM);
        pd_close(ep);
        return -FI_ENOMEM;
    }
    for (uint32_t i = 0; i < ep->ctx_n; i++) ep->ctx[i].next_free = i + 1;
    ep->ctx_free = 0;
    *out = ep;
    return 0;
}

pd_dom *pd_ep_domain(pd_ep *ep) { return ep->dom; }

int pd_getname(pd_ep *ep, void *buf, size_t *len) {
    return fi_getname(&ep->ep->fid, buf, len);
}

int pd_has_remote_cntr(pd_ep *ep) { return ep->rcntr != NULL; }

uint64_t pd_remote_cntr(pd_ep *ep) { return ep->rcntr ? fi_cntr_read(ep->rcntr) : 0; }

int pd_av_insert(pd_ep *ep, const void *name, uint64_t *fi_addr) {
    fi_addr_t a = FI_ADDR_UNSPEC;
    int n = fi_av_insert(ep->av, name, 1, &a, 0, NULL);
    if (n == 1) { *fi_addr = a; return 0; }
    return n < 0 ? n : -FI_EINVAL;
}

int pd_av_remove(pd_ep *ep, uint64_t fi_addr) {
    fi_addr_t a = fi_addr;
    return fi_av_remove(ep->av, &a, 1, 0);
}

void pd_set_idle(pd_ep *ep, int yield_idle, uint32_t spins_before_sleep, int64_t sleep_ns) {
    ep->yield_idle = yield_idle;
    ep->idle_spins = spins_before_sleep;
    ep->idle_sleep_ns = pd_clamp_ns(sleep_ns);
}

/* Let the idle sleep grow (see pd_backoff_ns) up to `max_sleep_ns`; <= the sleep: fixed. */
void pd_set_idle_backoff(pd_ep *ep, int64_t max_sleep_ns) {
    ep->idle_max_sleep_ns = pd_clamp_ns(max_sleep_ns);
}

void pd_set_max_inflight_bytes(pd_ep *ep, uint64_t max_bytes) {
    ep->max_inflight_bytes = max_bytes;
}

void pd_set_drain(pd_ep *ep, int64_t sleep_ns) {
    ep->drain_sleep_ns = pd_clamp_ns(sleep_ns);
    ep->draining = 0;
}

/* Cancel every local write in flight and reopen the CQ, address vector and endpoint on the same
   domain (registrations stay valid; the peers must be inserted again, in the same order, by the
   caller). Each cancelled write is reported as a completion error (FI_ECANCELED, `why`) on its
   tag, so the caller's accounting settles it as it settles any failed write.

   Why: shm (1.17) retires a sender's writes from one response queue in order; a write to a
   peer that died stays busy at its head for ever, so no write to any other peer completes after
   it and the queue fills (docs/libfabric.md, "Progress and errors"). No call drops it but
   closing the endpoint. A sender only: refused with a progress thread, as a lane or with a remote
   counter (a receiver's counts would be lost). Its idle-wait settings stay. */
int pd_ep_reset(pd_ep *ep, const char *why, char *errbuf, size_t errlen) {
    if (ep->thread_on || ep->owner || ep->rcntr) {
        pd_seterr(errbuf, errlen, "reset: only a sender endpoint can be reset", -FI_EBUSY);
        return -FI_EBUSY;
    }
    uint8_t *free_ctx = calloc(ep->ctx_n, 1);
    if (!free_ctx) { pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM); return -FI_ENOMEM; }
    for (uint32_t i = ep->ctx_free; i < ep->ctx_n; i = ep->ctx[i].next_free) free_ctx[i] = 1;
    if (ep->ep) fi_close(&ep->ep->fid);
    if (ep->av) fi_close(&ep->av->fid);
    if (ep->cq) fi_close(&ep->cq->fid);
    ep->ep = NULL;
    ep->av = NULL;
    ep->cq = NULL;
    for (uint32_t i = 0; i < ep->ctx_n; i++) {
        if (!free_ctx[i]) {
            pd_record_err(ep, ep->ctx[i].tag, FI_ECANCELED, 0, why);
            ep->completions++;
        }
        ep->ctx[i].next_free = i + 1;
    }
    free(free_ctx);
    ep->ctx_free = 0;
    ep->inflight = 0;
    ep->inflight_bytes = 0;
    ep->draining = 0;
    ep->lane_cursor = 0;
    memset(ep->peer_bytes, 0, sizeof(ep->peer_bytes));
    memset(ep->peer_drain, 0, sizeof(ep->peer_drain));
    return pd_ep_fids(ep, errbuf, errlen);
}

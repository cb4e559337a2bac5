"""cffi (API mode) build script for `transfer._fabric`, the private libfabric binding.

Why API mode: most `fi_*` calls are `static inline` wrappers around function-pointer tables, so
they only exist to a C compiler. Why a C source and not one Python call per `fi_*` call: the hot
paths (submitting thousands of page writes, draining the completion queue and counting CQ data per
transfer slot) cost ~1 µs per page through cffi, which caps small pages far below the copy speed
(DESIGN §5). Here they are C loops; cffi releases the GIL around every call.

Built at install time by setup.py (only when `rdma/fabric.h` is found), or by hand from the
repository root: `python transfer/_fabric_build.py`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from cffi import FFI

MODULE = "transfer._fabric"

# the C types shared by the declarations cffi reads and the source it compiles
TYPES = r"""
typedef struct pd_ep pd_ep;
typedef struct pd_mr pd_mr;

struct pd_info {
    char provider[64];
    char fabric[128];
    char domain[128];
    uint64_t mr_mode;
    uint64_t caps;
    uint64_t mode;
    size_t cq_data_size;
    size_t max_msg_size;
    size_t tx_size;
    size_t mr_key_size;
    int has_rma_event;
    int has_remote_cntr;
    uint32_t addr_format;
    size_t addrlen;
};

struct pd_err {
    uint64_t tag;
    int err;
    int prov_errno;
    char msg[256];
    uint32_t count;      /* failed operations of this tag and error folded into this entry */
};
"""

CDEF = TYPES + r"""
int pd_open(pd_ep **out, const char *prov, const char *domain, const char *node,
            const char *service, int want_remote_cntr, uint32_t ctx_pool, size_t cq_size,
            struct pd_info *info, char *errbuf, size_t errlen);
void pd_close(pd_ep *ep);
int pd_getname(pd_ep *ep, void *buf, size_t *len);
void pd_set_counters(pd_ep *ep, uint32_t *recv_counts, uint16_t *recv_gen, uint32_t *send_done,
                     uint32_t nslots);
uint64_t pd_stale(pd_ep *ep);
void pd_set_yield(pd_ep *ep, int on);
void pd_set_idle(pd_ep *ep, int yield_idle, uint32_t spins_before_sleep, int64_t sleep_ns);
void pd_set_max_inflight_bytes(pd_ep *ep, uint64_t max_bytes);
void pd_set_drain(pd_ep *ep, int64_t sleep_ns);
uint64_t pd_inflight_bytes(pd_ep *ep);
uint64_t pd_inflight(pd_ep *ep);
uint64_t pd_remote_cntr(pd_ep *ep);
uint64_t pd_remote_writes(pd_ep *ep);

int pd_av_insert(pd_ep *ep, const void *name, uint64_t *fi_addr);
int pd_av_remove(pd_ep *ep, uint64_t fi_addr);

int pd_mr_reg(pd_ep *ep, void *addr, size_t len, uint64_t access, int iface, int device,
              uint64_t requested_key, pd_mr **out, uint64_t *key, char *errbuf, size_t errlen);
void pd_mr_close(pd_mr *mr);
void *pd_mr_desc(pd_mr *mr);

int pd_write_batch(pd_ep *ep, const uint64_t *peers, const uint64_t *remote_bases,
                   const uint64_t *remote_keys, size_t nlanes, pd_mr *local,
                   uint64_t remote_len, const uint64_t *src,
                   const uint64_t *dst, const uint64_t *len, size_t n, const uint32_t *op_len,
                   size_t nops, uint32_t imm, uint32_t tag, int64_t timeout_ns, size_t *done,
                   char *errbuf, size_t errlen);
size_t pd_iov_limit(pd_ep *ep);
size_t pd_nerr(pd_ep *ep);
int pd_poll(pd_ep *ep, size_t max_entries);
int pd_wait_recv(pd_ep *ep, uint32_t slot, uint32_t target, int64_t timeout_ns);
int pd_wait_send(pd_ep *ep, uint32_t tag, uint32_t target, int64_t timeout_ns);
int pd_wait_idle(pd_ep *ep, int64_t timeout_ns);
int pd_wait_change(pd_ep *ep, const int64_t *a, int64_t a_seen, const int64_t *b, int64_t b_seen,
                   int64_t sleep_ns, int64_t timeout_ns);
void pd_set_targets(pd_ep *ep, const uint32_t *targets);
void pd_share_counts(pd_ep *lane, pd_ep *owner);
void pd_set_active(pd_ep *ep, int on);
int pd_progress_start(pd_ep *ep, int64_t sleep_ns);
int pd_progress_stop(pd_ep *ep, int64_t timeout_ns);
int64_t pd_progress_stalled_ns(pd_ep *ep);
int pd_wait_complete(pd_ep *ep, const int64_t *bell, int64_t bell_seen, int64_t timeout_ns);
size_t pd_take_errors(pd_ep *ep, struct pd_err *out, size_t max);
const char *pd_strerror(int err);

#define PD_ETIMEDOUT ...
#define PD_EINVAL ...
#define PD_EOVERFLOW ...
#define PD_HMEM_SYSTEM ...
#define PD_HMEM_CUDA ...
#define PD_ACCESS_LOCAL_WRITE ...
#define PD_ACCESS_REMOTE_WRITE ...
#define PD_ADDR_STR ...
"""

SOURCE = r"""
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define PD_ETIMEDOUT FI_ETIMEDOUT
#define PD_EINVAL FI_EINVAL
#define PD_EOVERFLOW FI_EOVERFLOW
#define PD_HMEM_SYSTEM FI_HMEM_SYSTEM
#define PD_HMEM_CUDA FI_HMEM_CUDA
#define PD_ACCESS_LOCAL_WRITE (FI_WRITE | FI_READ)
#define PD_ACCESS_REMOTE_WRITE (FI_REMOTE_WRITE | FI_REMOTE_READ)
#define PD_ADDR_STR FI_ADDR_STR
#define PD_MAX_ERRORS 64   /* first capacity of the error list (it grows) */
#define PD_CQ_BATCH 64
#define PD_MAX_IOV 16
#define PD_MAX_PEERS 1024   /* fi_addrs (FI_AV_TABLE: 0, 1, ...) with per-peer bytes in flight */
#define PD_NO_PEER UINT32_MAX

""" + TYPES + r"""
/* One outstanding local write: the provider hands `ctx` back in the completion, so the tag rides
   along and providers that demand FI_CONTEXT/FI_CONTEXT2 scratch space get it. */
struct pd_ctx {
    struct fi_context2 fi;   /* must stay first: some providers write into it */
    uint64_t len;
    uint32_t tag;
    uint32_t next_free;
    uint32_t peer;           /* fi_addr for per-peer accounting, PD_NO_PEER when untracked */
};

struct pd_ep {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_cntr *rcntr;
    struct fid_ep *ep;
    uint64_t mr_mode;
    /* counting state; the arrays belong to Python (numpy) and outlive this struct's use */
    uint32_t *recv_counts;
    uint16_t *recv_gen;
    uint32_t *send_done;
    const uint32_t *recv_target;  /* per slot: the count that completes it (NULL: not watched) */
    int completed;                /* a slot reached its target (cleared by pd_wait_complete) */
    /* Receive lanes: an endpoint whose counts live in `owner` (its arrays, targets and
       `completed`), drained by its own progress thread; counting is atomic for that reason. */
    struct pd_ep *owner;
    int active;                   /* owner: transfers are being counted (lanes poll eagerly) */
    pthread_t thread;
    int thread_on;
    int thread_stop;
    int64_t thread_sleep_ns;
    int64_t thread_in_poll_ns;    /* when the thread's current poll began (0: not polling) */
    pthread_mutex_t err_lock;     /* the error ring is filled by a progress thread */
    /* sender: bytes in flight per peer, and peers being let drain (several lanes) */
    uint64_t peer_bytes[PD_MAX_PEERS];
    uint8_t peer_drain[PD_MAX_PEERS];
    size_t lane_cursor;
    uint32_t nslots;
    uint64_t stale;
    uint64_t remote_writes;
    uint64_t inflight;
    uint64_t inflight_bytes;
    uint64_t max_inflight_bytes;  /* 0 = only the provider's queue depth limits */
    int64_t drain_sleep_ns;       /* > 0: refill in bursts, sleeping while the queue drains */
    uint64_t drain_low;           /* draining until inflight_bytes <= this */
    int draining;
    int yield_idle;         /* sched_yield() when a wait/retry loop found nothing to do */
    uint32_t idle_spins;    /* ... and after this many empty polls in a row, */
    int64_t idle_sleep_ns;  /* sleep this long per empty poll (0: never sleep) */
    /* context pool */
    struct pd_ctx *ctx;
    uint32_t ctx_n;
    uint32_t ctx_free;      /* head of free list, ctx_n == empty */
    /* completion errors not taken yet, one entry per (tag, error) with a count; grows as
       needed, so none is ever dropped (a sender counts each failed operation as done) */
    struct pd_err *errs;
    size_t nerr;
    size_t err_cap;
};

struct pd_mr {
    struct fid_mr *mr;
    void *desc;
    uint64_t base;
    uint64_t len;
};

static int64_t pd_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A wait/retry loop's poll found nothing to do. Busy-polling keeps latency low, but on a box
   with fewer cores than spinning threads the spinner steals the core from the thread that does
   the work (on shm the TARGET performs the copy, process_vm_readv, inside its poll, while the
   initiator with a full queue only waits): yield at once, and after `idle_spins` empty polls in
   a row sleep `idle_sleep_ns` per poll, so a long wait costs almost no CPU. */
static void pd_idle(pd_ep *ep, unsigned *empty) {
    if (ep->idle_sleep_ns > 0 && ++*empty > ep->idle_spins) {
        struct timespec ts = { 0, (long)ep->idle_sleep_ns };
        nanosleep(&ts, NULL);
    } else if (ep->yield_idle) {
        sched_yield();
    }
}

int pd_progress_stop(pd_ep *ep, int64_t timeout_ns);

static void pd_seterr(char *buf, size_t len, const char *call, int ret) {
    if (buf && len)
        snprintf(buf, len, "%s: %s (%d)", call, fi_strerror(ret < 0 ? -ret : ret), ret);
}

const char *pd_strerror(int err) { return fi_strerror(err < 0 ? -err : err); }

/* Errors of a tag already listed fold into its entry (one entry per (tag, error): bounded by
   the tags in use, the first message kept); a new one grows the list. Dropping one would leave
   its sender waiting forever for an operation that will never complete. */
static void pd_record_err(pd_ep *ep, uint64_t tag, int err, int prov_errno, const char *msg) {
    pthread_mutex_lock(&ep->err_lock);
    for (size_t i = ep->nerr; i-- > 0;) {
        if (ep->errs[i].tag == tag && ep->errs[i].err == err) {
            ep->errs[i].count++;
            pthread_mutex_unlock(&ep->err_lock);
            return;
        }
    }
    if (ep->nerr == ep->err_cap) {
        size_t cap = ep->err_cap ? 2 * ep->err_cap : PD_MAX_ERRORS;
        struct pd_err *grown = realloc(ep->errs, cap * sizeof(*grown));
        if (!grown) {  /* out of memory: fold into the newest entry rather than lose the count */
            if (ep->nerr) ep->errs[ep->nerr - 1].count++;
            pthread_mutex_unlock(&ep->err_lock);
            return;
        }
        ep->errs = grown;
        ep->err_cap = cap;
    }
    struct pd_err *e = &ep->errs[ep->nerr++];
    e->tag = tag;
    e->err = err;
    e->prov_errno = prov_errno;
    e->count = 1;
    snprintf(e->msg, sizeof(e->msg), "%s", msg ? msg : "");
    pthread_mutex_unlock(&ep->err_lock);
}

size_t pd_nerr(pd_ep *ep) { return ep->nerr; }

size_t pd_take_errors(pd_ep *ep, struct pd_err *out, size_t max) {
    pthread_mutex_lock(&ep->err_lock);
    size_t n = ep->nerr < max ? ep->nerr : max;
    if (n == 0) { pthread_mutex_unlock(&ep->err_lock); return 0; }
    memcpy(out, ep->errs, n * sizeof(*out));
    memmove(&ep->errs[0], &ep->errs[n], (ep->nerr - n) * sizeof(*out));
    ep->nerr -= n;
    pthread_mutex_unlock(&ep->err_lock);
    return n;
}

static struct pd_ctx *pd_ctx_get(pd_ep *ep) {
    if (ep->ctx_free == ep->ctx_n) return NULL;
    struct pd_ctx *c = &ep->ctx[ep->ctx_free];
    ep->ctx_free = c->next_free;
    return c;
}

static void pd_ctx_put(pd_ep *ep, struct pd_ctx *c) {
    c->next_free = ep->ctx_free;
    ep->ctx_free = (uint32_t)(c - ep->ctx);
}

static int pd_is_our_ctx(pd_ep *ep, void *p) {
    return p && (struct pd_ctx *)p >= ep->ctx && (struct pd_ctx *)p < ep->ctx + ep->ctx_n;
}

static void pd_count_remote(pd_ep *ep, uint64_t data) {
    uint32_t imm = (uint32_t)data;
    uint32_t slot = imm >> 16;
    uint16_t gen = (uint16_t)(imm & 0xffff);
    pd_ep *o = ep->owner ? ep->owner : ep;  /* a lane counts into its owner's slots */
    ep->remote_writes++;
    if (o->recv_counts && slot < o->nslots
        && __atomic_load_n(&o->recv_gen[slot], __ATOMIC_ACQUIRE) == gen) {
        /* atomic: the owner's thread and its lanes' threads count the same slots */
        uint32_t c = __atomic_add_fetch(&o->recv_counts[slot], 1, __ATOMIC_ACQ_REL);
        const uint32_t *t = __atomic_load_n(&o->recv_target, __ATOMIC_ACQUIRE);
        if (t && c == t[slot]) __atomic_store_n(&o->completed, 1, __ATOMIC_RELEASE);
    } else
        ep->stale++;
}

static void pd_unaccount(pd_ep *ep, struct pd_ctx *c) {
    ep->inflight--;
    ep->inflight_bytes -= c->len;
    if (c->peer != PD_NO_PEER) ep->peer_bytes[c->peer] -= c->len;
    pd_ctx_put(ep, c);
}

static void pd_complete_local(pd_ep *ep, void *op_context) {
    if (!pd_is_our_ctx(ep, op_context)) return;
    struct pd_ctx *c = (struct pd_ctx *)op_context;
    if (ep->send_done && c->tag < ep->nslots) ep->send_done[c->tag]++;
    pd_unaccount(ep, c);
}

/* Read the error entry behind -FI_EAVAIL; a failed local write still returns its context. */
static int pd_read_cq_error(pd_ep *ep) {
    struct fi_cq_err_entry e;
    char pbuf[200];
    memset(&e, 0, sizeof(e));
    ssize_t r = fi_cq_readerr(ep->cq, &e, 0);
    if (r == -FI_EAGAIN) return 0;
    if (r < 0) return (int)r;
    const char *pmsg = fi_cq_strerror(ep->cq, e.prov_errno, e.err_data, pbuf, sizeof(pbuf));
    char msg[256];
    snprintf(msg, sizeof(msg), "%s; provider: %s", fi_strerror(e.err), pmsg ? pmsg : "?");
    uint64_t tag = UINT64_MAX;
    if (pd_is_our_ctx(ep, e.op_context)) {
        struct pd_ctx *c = (struct pd_ctx *)e.op_context;
        tag = c->tag;
        pd_unaccount(ep, c);
    } else if (e.flags & FI_REMOTE_CQ_DATA) {
        tag = (uint32_t)e.data;
    }
    pd_record_err(ep, tag, e.err, e.prov_errno, msg);
    return 0;
}

/* Drain the CQ: remote CQ data -> per-slot counts, local completions -> per-tag counts.
   Returns entries handled (>= 0) or a negative fi errno on a CQ failure. */
int pd_poll(pd_ep *ep, size_t max_entries) {
    struct fi_cq_data_entry ent[PD_CQ_BATCH];
    size_t total = 0;
    while (total < max_entries) {
        ssize_t n = fi_cq_read(ep->cq, ent, PD_CQ_BATCH);
        if (n == -FI_EAGAIN) break;
        if (n == -FI_EAVAIL) {
            int r = pd_read_cq_error(ep);
            if (r < 0) return r;
            total++;
            continue;
        }
        if (n < 0) return (int)n;
        for (ssize_t i = 0; i < n; i++) {
            if (ent[i].flags & FI_REMOTE_CQ_DATA)
                pd_count_remote(ep, ent[i].data);
            else
                pd_complete_local(ep, ent[i].op_context);
        }
        total += (size_t)n;
        if (n < PD_CQ_BATCH) break;
    }
    return (int)(total > 0x7fffffff ? 0x7fffffff : total);
}

static struct fi_info *pd_pick(struct fi_info *list, const char *prov, const char *domain) {
    for (struct fi_info *fi = list; fi; fi = fi->next) {
        if (prov && *prov && strcmp(fi->fabric_attr->prov_name, prov) != 0) continue;
        if (domain && *domain && strcmp(fi->domain_attr->name, domain) != 0) continue;
        return fi;
    }
    return NULL;
}

static struct fi_info *pd_hints(const char *prov, uint64_t extra_caps) {
    struct fi_info *h = fi_allocinfo();
    if (!h) return NULL;
    h->ep_attr->type = FI_EP_RDM;
    /* FI_REMOTE_CQ_DATA is an operation flag, not a capability bit: CQ-data support shows as
       domain_attr->cq_data_size (checked >= 4 by the caller). FI_RX_CQ_DATA is deliberately not
       offered in `mode`, so providers that need posted receives to deliver CQ data (raw verbs
       MSG) are filtered out; verbs;ofi_rxm hides that requirement. */
    h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | extra_caps;
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY
                              | FI_MR_ENDPOINT | FI_MR_HMEM;
    h->domain_attr->threading = FI_THREAD_DOMAIN;
    h->domain_attr->av_type = FI_AV_TABLE;
    if (prov && *prov) h->fabric_attr->prov_name = strdup(prov);
    return h;
}

void pd_close(pd_ep *ep) {
    if (!ep) return;
    /* a progress thread stuck inside the provider still uses everything: leak, don't free */
    if (pd_progress_stop(ep, 2000000000LL)) return;
    if (ep->ep) fi_close(&ep->ep->fid);
    if (ep->av) fi_close(&ep->av->fid);
    if (ep->cq) fi_close(&ep->cq->fid);
    if (ep->rcntr) fi_close(&ep->rcntr->fid);
    if (ep->domain) fi_close(&ep->domain->fid);
    if (ep->fabric) fi_close(&ep->fabric->fid);
    if (ep->info) fi_freeinfo(ep->info);
    pthread_mutex_destroy(&ep->err_lock);
    free(ep->errs);
    free(ep->ctx);
    free(ep);
}

#define PD_TRY(call, what) do { int _r = (int)(call); if (_r) { \
    pd_seterr(errbuf, errlen, what, _r); pd_close(ep); return _r; } } while (0)

int pd_open(pd_ep **out, const char *prov, const char *domain, const char *node,
            const char *service, int want_remote_cntr, uint32_t ctx_pool, size_t cq_size,
            struct pd_info *pi, char *errbuf, size_t errlen) {
    *out = NULL;
    pd_ep *ep = calloc(1, sizeof(*ep));
    if (!ep) { pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM); return -FI_ENOMEM; }
    pthread_mutex_init(&ep->err_lock, NULL);
    struct fi_info *list = NULL, *hints;
    int ret = -FI_ENODATA;
    /* The remote-write counter needs FI_RMA_EVENT, which tcp/efa/verbs lack: ask with it first,
       fall back to CQ data only. */
    for (int attempt = want_remote_cntr ? 0 : 1; attempt < 2; attempt++) {
        hints = pd_hints(prov, attempt == 0 ? FI_RMA_EVENT : 0);
        if (!hints) { ret = -FI_ENOMEM; break; }
        /* node/service name the LOCAL address to bind (FI_SOURCE), e.g. 127.0.0.1 for tcp */
        int local = (node && *node) || (service && *service);
        ret = fi_getinfo(FI_VERSION(1, 17), (node && *node) ? node : NULL,
                         (service && *service) ? service : NULL, local ? FI_SOURCE : 0,
                         hints, &list);
        fi_freeinfo(hints);
        if (ret == 0) {
            struct fi_info *pick = pd_pick(list, prov, domain);
            if (pick) { ep->info = fi_dupinfo(pick); fi_freeinfo(list); list = NULL; break; }
            fi_freeinfo(list); list = NULL; ret = -FI_ENODATA;
        }
    }
    if (!ep->info) {
        pd_seterr(errbuf, errlen, "fi_getinfo", ret ? ret : -FI_ENODATA);
        pd_close(ep);
        return ret ? ret : -FI_ENODATA;
    }
    struct fi_info *fi = ep->info;
    ep->mr_mode = fi->domain_attr->mr_mode;
    PD_TRY(fi_fabric(fi->fabric_attr, &ep->fabric, NULL), "fi_fabric");
    PD_TRY(fi_domain(ep->fabric, fi, &ep->domain, NULL), "fi_domain");
    struct fi_cq_attr cq_attr;
    memset(&cq_attr, 0, sizeof(cq_attr));
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    /* A bounded CQ bounds the work of ONE fi_cq_read: shm's progress copies every queued
       write (process_vm_readv) until the CQ is full, so with the default size one call could
       copy a whole GiB queue and the caller's timeout/slice was never checked. 0 = default. */
    cq_attr.size = cq_size;
    PD_TRY(fi_cq_open(ep->domain, &cq_attr, &ep->cq, NULL), "fi_cq_open");
    struct fi_av_attr av_attr;
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    PD_TRY(fi_av_open(ep->domain, &av_attr, &ep->av, NULL), "fi_av_open");
    PD_TRY(fi_endpoint(ep->domain, fi, &ep->ep, NULL), "fi_endpoint");
    PD_TRY(fi_ep_bind(ep->ep, &ep->av->fid, 0), "fi_ep_bind(av)");
    PD_TRY(fi_ep_bind(ep->ep, &ep->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    if (want_remote_cntr && (fi->caps & FI_RMA_EVENT)) {
        struct fi_cntr_attr ca;
        memset(&ca, 0, sizeof(ca));
        ca.events = FI_CNTR_EVENTS_COMP;
        ca.wait_obj = FI_WAIT_NONE;
        PD_TRY(fi_cntr_open(ep->domain, &ca, &ep->rcntr, NULL), "fi_cntr_open");
        PD_TRY(fi_ep_bind(ep->ep, &ep->rcntr->fid, FI_REMOTE_WRITE), "fi_ep_bind(cntr)");
    }
    PD_TRY(fi_enable(ep->ep), "fi_enable");
    ep->ctx_n = ctx_pool ? ctx_pool : 1;
    ep->ctx = calloc(ep->ctx_n, sizeof(*ep->ctx));
    if (!ep->ctx) {
        pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM);
        pd_close(ep);
        return -FI_ENOMEM;
    }
    for (uint32_t i = 0; i < ep->ctx_n; i++) ep->ctx[i].next_free = i + 1;
    ep->ctx_free = 0;
    memset(pi, 0, sizeof(*pi));
    snprintf(pi->provider, sizeof(pi->provider), "%s", fi->fabric_attr->prov_name);
    snprintf(pi->fabric, sizeof(pi->fabric), "%s", fi->fabric_attr->name);
    snprintf(pi->domain, sizeof(pi->domain), "%s", fi->domain_attr->name);
    pi->mr_mode = fi->domain_attr->mr_mode;
    pi->caps = fi->caps;
    pi->mode = fi->mode;
    pi->cq_data_size = fi->domain_attr->cq_data_size;
    pi->max_msg_size = fi->ep_attr->max_msg_size;
    pi->tx_size = fi->tx_attr->size;
    pi->mr_key_size = fi->domain_attr->mr_key_size;
    pi->has_rma_event = (fi->caps & FI_RMA_EVENT) != 0;
    pi->has_remote_cntr = ep->rcntr != NULL;
    pi->addr_format = fi->addr_format;
    pi->addrlen = fi->src_addrlen;
    *out = ep;
    return 0;
}

int pd_getname(pd_ep *ep, void *buf, size_t *len) {
    return fi_getname(&ep->ep->fid, buf, len);
}

void pd_set_counters(pd_ep *ep, uint32_t *recv_counts, uint16_t *recv_gen, uint32_t *send_done,
                     uint32_t nslots) {
    ep->recv_counts = recv_counts;
    ep->recv_gen = recv_gen;
    ep->send_done = send_done;
    ep->nslots = nslots;
}

void pd_set_yield(pd_ep *ep, int on) { ep->yield_idle = on; }
void pd_set_max_inflight_bytes(pd_ep *ep, uint64_t max_bytes) {
    ep->max_inflight_bytes = max_bytes;
}
void pd_set_drain(pd_ep *ep, int64_t sleep_ns) {
    ep->drain_sleep_ns = sleep_ns < 0 ? 0 : (sleep_ns > 999999999 ? 999999999 : sleep_ns);
    ep->draining = 0;
}
uint64_t pd_inflight_bytes(pd_ep *ep) { return ep->inflight_bytes; }
void pd_set_idle(pd_ep *ep, int yield_idle, uint32_t spins_before_sleep, int64_t sleep_ns) {
    ep->yield_idle = yield_idle;
    ep->idle_spins = spins_before_sleep;
    ep->idle_sleep_ns = sleep_ns < 0 ? 0 : (sleep_ns > 999999999 ? 999999999 : sleep_ns);
}
uint64_t pd_stale(pd_ep *ep) { return ep->stale; }
uint64_t pd_inflight(pd_ep *ep) { return ep->inflight; }
uint64_t pd_remote_writes(pd_ep *ep) { return ep->remote_writes; }
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

int pd_mr_reg(pd_ep *ep, void *addr, size_t len, uint64_t access, int iface, int device,
              uint64_t requested_key, pd_mr **out, uint64_t *key, char *errbuf, size_t errlen) {
    *out = NULL;
    pd_mr *m = calloc(1, sizeof(*m));
    if (!m) { pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM); return -FI_ENOMEM; }
    struct iovec iov = { .iov_base = addr, .iov_len = len };
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = (enum fi_hmem_iface)iface;
    if (iface == FI_HMEM_CUDA) attr.device.cuda = device;
    uint64_t flags = 0;
    int ret = fi_mr_regattr(ep->domain, &attr, flags, &m->mr);
    if (ret) { pd_seterr(errbuf, errlen, "fi_mr_regattr", ret); free(m); return ret; }
    if (ep->mr_mode & FI_MR_ENDPOINT) {
        ret = fi_mr_bind(m->mr, &ep->ep->fid, 0);
        if (!ret) ret = fi_mr_enable(m->mr);
        if (ret) {
            pd_seterr(errbuf, errlen, "fi_mr_bind/enable", ret);
            fi_close(&m->mr->fid); free(m); return ret;
        }
    }
    if (ep->rcntr && (access & FI_REMOTE_WRITE) && (ep->mr_mode & FI_MR_RMA_EVENT)) {
        ret = fi_mr_bind(m->mr, &ep->rcntr->fid, FI_REMOTE_WRITE);
        if (!ret) ret = fi_mr_enable(m->mr);
        if (ret) {
            pd_seterr(errbuf, errlen, "fi_mr_bind(cntr)", ret);
            fi_close(&m->mr->fid); free(m); return ret;
        }
    }
    *key = fi_mr_key(m->mr);
    if (*key == FI_KEY_NOTAVAIL) {
        pd_seterr(errbuf, errlen, "fi_mr_key (raw keys unsupported)", -FI_ENOSYS);
        fi_close(&m->mr->fid); free(m); return -FI_ENOSYS;
    }
    m->desc = fi_mr_desc(m->mr);
    m->base = (uint64_t)(uintptr_t)addr;
    m->len = len;
    *out = m;
    return 0;
}

void *pd_mr_desc(pd_mr *m) { return m->desc; }

void pd_mr_close(pd_mr *m) {
    if (!m) return;
    if (m->mr) fi_close(&m->mr->fid);
    free(m);
}

/* Submit n writes with one call. Each carries `imm` as remote CQ data and a context naming `tag`,
   so the sender counts local completions per tag. On -FI_EAGAIN (queue full) or an empty context
   pool, drain the CQ (that also drives manual progress) and retry, bounded by timeout_ns. */
/* Writes per operation the provider takes on both sides: local iovs and remote rma iovs. */
size_t pd_iov_limit(pd_ep *ep) {
    size_t a = ep->info->tx_attr->iov_limit, b = ep->info->tx_attr->rma_iov_limit;
    size_t m = a < b ? a : b;
    if (m > PD_MAX_IOV) m = PD_MAX_IOV;
    return m ? m : 1;
}

/* One receive lane: whether an operation of `op_bytes` must wait. Bytes in flight are capped
   (one write may always go): the queue is bounded in entries, so with big pages the target
   would otherwise have up to tx_size pages queued, and shm's target copies everything queued
   inside ONE fi_cq_read (1 GiB of 1 MiB pages: its poll loop blind for ~200 ms, new requests
   waiting). While capped, only our own CQ is polled: no spinning on the peer's queue lock. */
static int pd_capped(pd_ep *ep, uint64_t op_bytes) {
    int capped = ep->max_inflight_bytes && ep->inflight
                 && ep->inflight_bytes + op_bytes > ep->max_inflight_bytes;
    if (ep->draining) {
        if (ep->inflight && ep->inflight_bytes > ep->drain_low) capped = 1;
        else ep->draining = 0;
    }
    return capped;
}

/* Pick the lane for an operation of `op_bytes` among several receive lanes of one peer, or -1
   when every lane is full. A lane is refilled only once it has drained COMPLETELY: on shm the
   receiver holds its queue lock while it copies what is queued, so a sender posting to a busy
   lane spins on that lock instead of feeding the idle one. A lane is filled up to `cap` bytes
   before the next one is used, so each receiver gets long bursts. */
static int pd_pick_lane(pd_ep *ep, const uint64_t *peers, size_t nlanes, uint64_t op_bytes,
                        uint64_t cap) {
    for (size_t t = 0; t < nlanes; t++) {
        size_t l = (ep->lane_cursor + t) % nlanes;
        uint64_t p = peers[l];
        if (p >= PD_MAX_PEERS) return (int)l;  /* untracked: the provider's queue limits */
        if (ep->peer_drain[p]) {
            if (ep->peer_bytes[p]) continue;
            ep->peer_drain[p] = 0;
        }
        if (ep->peer_bytes[p] && ep->peer_bytes[p] + op_bytes > cap) {
            ep->peer_drain[p] = 1;
            continue;
        }
        ep->lane_cursor = l;
        return (int)l;
    }
    return -1;
}

/* Submit n writes as nops operations: operation j carries the next op_len[j] writes (NULL: one
   write per operation) as ONE fi_writemsg with an iov per write, one imm and one completion on
   each side. Grouping several scattered pages into one operation divides the per-operation cost
   (a command, a CQ entry, a syscall on shm/tcp) by up to the iov limit; the decoder counts
   operations, so the grouping is the caller's part of the count protocol.
   `nlanes` > 1: the peer has several receive lanes (peers[l], remote_bases[l], remote_keys[l]
   for the same remote memory); each operation goes to one of them (pd_pick_lane), and with
   max_inflight_bytes set each lane gets an equal share of it. */
int pd_write_batch(pd_ep *ep, const uint64_t *peers, const uint64_t *remote_bases,
                   const uint64_t *remote_keys, size_t nlanes, pd_mr *local,
                   uint64_t remote_len, const uint64_t *src,
                   const uint64_t *dst, const uint64_t *len, size_t n, const uint32_t *op_len,
                   size_t nops, uint32_t imm, uint32_t tag, int64_t timeout_ns, size_t *done,
                   char *errbuf, size_t errlen) {
    int64_t deadline = 0;
    char *lbase = (char *)(uintptr_t)local->base;
    size_t max_msg = ep->info->ep_attr->max_msg_size;
    size_t iov_max = pd_iov_limit(ep);
    uint64_t lane_cap = nlanes > 1 && ep->max_inflight_bytes
                        ? ep->max_inflight_bytes / nlanes : UINT64_MAX;
    *done = 0;
    if (nlanes < 1) {
        snprintf(errbuf, errlen, "write lanes: at least one peer is needed");
        return -FI_EINVAL;
    }
    if (op_len) {
        size_t sum = 0;
        for (size_t j = 0; j < nops; j++) {
            if (op_len[j] < 1 || op_len[j] > iov_max) {
                snprintf(errbuf, errlen, "write op %zu: %u writes in one operation, the provider "
                         "takes 1..%zu", j, op_len[j], iov_max);
                return -FI_EINVAL;
            }
            sum += op_len[j];
        }
        if (sum != n) {
            snprintf(errbuf, errlen, "write ops: operations cover %zu writes, the batch has %zu",
                     sum, n);
            return -FI_EINVAL;
        }
    } else {
        nops = n;
    }
    /* Bounds first, all of them, so a bad batch submits nothing (-FI_EINVAL = caller error). */
    for (size_t i = 0; i < n; i++) {
        const char *what = NULL;
        if (len[i] > max_msg) what = "length exceeds the provider's max_msg_size";
        else if (src[i] > local->len || len[i] > local->len - src[i])
            what = "source range exceeds the local region";
        else if (dst[i] > remote_len || len[i] > remote_len - dst[i])
            what = "destination range exceeds the remote region";
        if (what) {
            snprintf(errbuf, errlen, "write %zu (src %llu, dst %llu, len %llu): %s "
                     "(local %llu, remote %llu bytes)", i, (unsigned long long)src[i],
                     (unsigned long long)dst[i], (unsigned long long)len[i], what,
                     (unsigned long long)local->len, (unsigned long long)remote_len);
            return -FI_EINVAL;
        }
    }
    size_t i = 0;  /* first write of operation j */
    for (size_t j = 0; j < nops; j++) {
        unsigned spins = 0, empty = 0;
        size_t k = op_len ? op_len[j] : 1;
        uint64_t op_bytes = 0;
        for (size_t q = 0; q < k; q++) op_bytes += len[i + q];
        for (;;) {
            int lane = 0, capped;
            if (nlanes > 1) {
                lane = pd_pick_lane(ep, peers, nlanes, op_bytes, lane_cap);
                capped = lane < 0;
            } else {
                capped = pd_capped(ep, op_bytes);
            }
            struct pd_ctx *c = capped ? NULL : pd_ctx_get(ep);
            ssize_t ret = -FI_EAGAIN;
            uint64_t peer = peers[lane < 0 ? 0 : lane];
            if (c) {
                c->tag = tag;
                c->len = op_bytes;
                c->peer = peer < PD_MAX_PEERS ? (uint32_t)peer : PD_NO_PEER;
                uint64_t rbase = remote_bases[lane], rkey = remote_keys[lane];
                if (k == 1) {
                    ret = fi_writedata(ep->ep, lbase + src[i], len[i], local->desc, imm,
                                       (fi_addr_t)peer, rbase + dst[i], rkey, &c->fi);
                } else {
                    struct iovec iov[PD_MAX_IOV];
                    void *desc[PD_MAX_IOV];
                    struct fi_rma_iov rma[PD_MAX_IOV];
                    for (size_t q = 0; q < k; q++) {
                        iov[q].iov_base = lbase + src[i + q];
                        iov[q].iov_len = len[i + q];
                        desc[q] = local->desc;
                        rma[q].addr = rbase + dst[i + q];
                        rma[q].len = len[i + q];
                        rma[q].key = rkey;
                    }
                    struct fi_msg_rma msg = {
                        .msg_iov = iov, .desc = desc, .iov_count = k, .addr = (fi_addr_t)peer,
                        .rma_iov = rma, .rma_iov_count = k, .context = &c->fi, .data = imm,
                    };
                    ret = fi_writemsg(ep->ep, &msg, FI_REMOTE_CQ_DATA | FI_COMPLETION);
                }
                if (ret == 0) {
                    ep->inflight++;
                    ep->inflight_bytes += op_bytes;
                    if (c->peer != PD_NO_PEER) ep->peer_bytes[c->peer] += op_bytes;
                    break;
                }
                pd_ctx_put(ep, c);
                if (ret == -FI_EAGAIN && nlanes > 1 && peer < PD_MAX_PEERS)
                    ep->peer_drain[peer] = 1;  /* its queue is full: let it drain */
            }
            if (ret != -FI_EAGAIN) {
                pd_seterr(errbuf, errlen, k == 1 ? "fi_writedata" : "fi_writemsg", (int)ret);
                *done = i;
                return (int)ret;
            }
            /* Burst refill (drain_sleep_ns > 0, the shm default): once the queue is full, let
               it drain to half before posting again, sleeping between polls. On shm the target
               does the copy and holds its queue lock while copying, so a sender that posts one
               write per completion spins on that lock (a whole core, measured with perf) that
               the target needs on a small box; the half-full queue keeps the target busy. */
            if (nlanes == 1 && ep->drain_sleep_ns && ep->inflight && !ep->draining) {
                ep->draining = 1;
                ep->drain_low = ep->inflight_bytes / 2;
            }
            int p = pd_poll(ep, 1u << 16);
            if (p < 0) {
                pd_seterr(errbuf, errlen, "fi_cq_read", p);
                *done = i;
                return p;
            }
            /* every lane full: sleep like a draining single lane */
            if ((nlanes > 1 ? capped : ep->draining) && ep->drain_sleep_ns) {
                struct timespec ts = { 0, (long)ep->drain_sleep_ns };
                nanosleep(&ts, NULL);
            } else if (p == 0) {
                pd_idle(ep, &empty);  /* let a peer sharing this core run */
            } else {
                empty = 0;
            }
            if ((++spins & 255) == 0) {
                int64_t now = pd_now_ns();
                if (!deadline) deadline = now + timeout_ns;
                else if (now > deadline) {
                    pd_seterr(errbuf, errlen, "fi_writedata (queue stayed full)", -FI_ETIMEDOUT);
                    *done = i;
                    return -FI_ETIMEDOUT;
                }
            }
        }
        i += k;
    }
    *done = n;
    return 0;
}

/* Bounded busy waits; each drives progress by draining the CQ. 0 = reached, -FI_ETIMEDOUT. */
#define PD_WAIT(cond) do { \
    int64_t deadline = pd_now_ns() + timeout_ns; unsigned spins = 0, empty = 0; \
    for (;;) { \
        int p = pd_poll(ep, PD_CQ_BATCH); if (p < 0) return p; /* bounded: check often */ \
        if (cond) return 0; \
        if (p == 0) pd_idle(ep, &empty);  /* let a peer sharing this core run */ \
        else empty = 0; \
        /* after a poll that did work (on shm: copied up to the bytes in flight) check the \
           clock at once; empty polls are cheap, check every 64 */ \
        if ((p > 0 || (++spins & 63) == 0) && pd_now_ns() > deadline) return -FI_ETIMEDOUT; \
    } } while (0)

int pd_wait_recv(pd_ep *ep, uint32_t slot, uint32_t target, int64_t timeout_ns) {
    if (!ep->recv_counts || slot >= ep->nslots) return -FI_EINVAL;
    PD_WAIT(ep->recv_counts[slot] >= target);
}

int pd_wait_send(pd_ep *ep, uint32_t tag, uint32_t target, int64_t timeout_ns) {
    if (!ep->send_done || tag >= ep->nslots) return -FI_EINVAL;
    PD_WAIT(ep->send_done[tag] >= target || ep->nerr > 0);
}

int pd_wait_idle(pd_ep *ep, int64_t timeout_ns) {
    PD_WAIT(ep->inflight == 0);
}

void pd_set_targets(pd_ep *ep, const uint32_t *targets) {
    __atomic_store_n(&ep->recv_target, targets, __ATOMIC_RELEASE);
}

/* Make `lane` count into `owner`'s slots (before its progress thread starts). */
void pd_share_counts(pd_ep *lane, pd_ep *owner) { lane->owner = owner; }

/* Owner: whether transfers are being counted. Its lanes' threads poll eagerly while on, and
   sleep `thread_sleep_ns` x 50 per empty poll while off (1 ms by default: an idle decoder
   costs no core, and a new transfer waits at most that long for its first copy). */
void pd_set_active(pd_ep *ep, int on) { __atomic_store_n(&ep->active, on, __ATOMIC_RELEASE); }

static void *pd_progress_main(void *arg) {
    pd_ep *ep = arg;
    pd_ep *o = ep->owner ? ep->owner : ep;
    unsigned empty = 0;
    while (!__atomic_load_n(&ep->thread_stop, __ATOMIC_ACQUIRE)) {
        __atomic_store_n(&ep->thread_in_poll_ns, pd_now_ns(), __ATOMIC_RELEASE);
        int p = pd_poll(ep, PD_CQ_BATCH);
        __atomic_store_n(&ep->thread_in_poll_ns, 0, __ATOMIC_RELEASE);
        if (p < 0) {
            pd_record_err(ep, UINT64_MAX, -p, 0, "progress thread: fi_cq_read failed");
            struct timespec ts = { 0, 1000000 };
            nanosleep(&ts, NULL);
            continue;
        }
        if (p > 0) { empty = 0; continue; }
        if (++empty <= ep->idle_spins && __atomic_load_n(&o->active, __ATOMIC_ACQUIRE)) {
            sched_yield();
            continue;
        }
        int64_t ns = ep->thread_sleep_ns * (__atomic_load_n(&o->active, __ATOMIC_ACQUIRE) ? 1 : 50);
        struct timespec ts = { ns / 1000000000LL, (long)(ns % 1000000000LL) };
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* Drive this endpoint's progress (and so, on shm, its copies) from a thread of its own until
   pd_progress_stop. While it runs nobody else may call into the endpoint. */
int pd_progress_start(pd_ep *ep, int64_t sleep_ns) {
    if (ep->thread_on) return -FI_EBUSY;
    ep->thread_sleep_ns = sleep_ns > 0 ? sleep_ns : 1;
    ep->thread_stop = 0;
    int r = pthread_create(&ep->thread, NULL, pd_progress_main, ep);
    if (r) return -r;
    pthread_setname_np(ep->thread, "pdtool-lane");  /* shows in top -H, perf, /proc */
    ep->thread_on = 1;
    return 0;
}

/* Stop and join the progress thread: 0, or -FI_ETIMEDOUT when it did not come back within
   timeout_ns (stuck inside the provider: on shm 1.17, spinning on a queue lock that a killed
   peer held); it is then left running and the endpoint must be leaked, not closed. */
int pd_progress_stop(pd_ep *ep, int64_t timeout_ns) {
    if (!ep->thread_on) return 0;
    __atomic_store_n(&ep->thread_stop, 1, __ATOMIC_RELEASE);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t end = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + timeout_ns;
    ts.tv_sec = end / 1000000000LL;
    ts.tv_nsec = end % 1000000000LL;
    if (pthread_timedjoin_np(ep->thread, NULL, &ts)) return -FI_ETIMEDOUT;
    ep->thread_on = 0;
    return 0;
}

/* How long the progress thread has been inside its current poll (0: not in one). */
int64_t pd_progress_stalled_ns(pd_ep *ep) {
    int64_t since = __atomic_load_n(&ep->thread_in_poll_ns, __ATOMIC_ACQUIRE);
    return since ? pd_now_ns() - since : 0;
}

/* The decoder's wait while transfers are being counted: drive progress (on shm this thread
   does the copies) until some slot's count reaches its target (1), the engine rang *bell (2),
   or the timeout (0). Returning only then keeps the Python loop out of the copy path: one
   return per completed request instead of one per short slice. */
int pd_wait_complete(pd_ep *ep, const int64_t *bell, int64_t bell_seen, int64_t timeout_ns) {
    const volatile int64_t *vb = bell;
    int64_t deadline = pd_now_ns() + timeout_ns;
    unsigned spins = 0, empty = 0;
    for (;;) {
        int p = pd_poll(ep, PD_CQ_BATCH);
        if (p < 0) return p;
        /* consumed, not reset on entry: a lane thread may complete a slot at any moment, and
           a flag set just before this call must not be lost (a spare return is harmless) */
        if (__atomic_exchange_n(&ep->completed, 0, __ATOMIC_ACQ_REL)) return 1;
        if (vb && *vb != bell_seen) return 2;
        if (p == 0) pd_idle(ep, &empty);
        else empty = 0;
        if ((p > 0 || (++spins & 63) == 0) && pd_now_ns() > deadline) return 0;
    }
}

/* Wait for another thread to write a new value into *a or *b (an engine's per-layer progress
   word, a command doorbell), draining the CQ meanwhile: 1 = changed, 0 = timeout. Meant for
   waits on COMPUTE (a prefill forward pass): after a few empty polls it sleeps `sleep_ns` per
   poll, so the waiting thread neither spins a core the engine needs nor holds the GIL (a
   Python loop calling poll() did both). */
int pd_wait_change(pd_ep *ep, const int64_t *a, int64_t a_seen, const int64_t *b, int64_t b_seen,
                   int64_t sleep_ns, int64_t timeout_ns) {
    const volatile int64_t *va = a, *vb = b;
    int64_t deadline = pd_now_ns() + timeout_ns;
    unsigned spins = 0;
    for (;;) {
        int p = pd_poll(ep, PD_CQ_BATCH);
        if (p < 0) return p;
        if ((va && *va != a_seen) || (vb && *vb != b_seen)) return 1;
        if (pd_now_ns() > deadline) return 0;
        if (p > 0) { spins = 0; continue; }
        if (++spins > 16 && sleep_ns > 0) {
            struct timespec ts = { 0, (long)(sleep_ns > 999999999 ? 999999999 : sleep_ns) };
            nanosleep(&ts, NULL);
        } else {
            sched_yield();
        }
    }
}
"""


def _pkg_config(flag: str) -> list[str]:
    try:
        out = subprocess.run(
            ["pkg-config", flag, "libfabric"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return shlex.split(out)


def include_dirs() -> list[str]:
    """Where to look for `rdma/fabric.h`: $PDTOOL_FABRIC_INCLUDE alone when set (os.pathsep
    separated; for a libfabric in an odd place), else pkg-config, $CPATH/$C_INCLUDE_PATH and the
    system dirs (incl. the EFA installer's /opt/amazon/efa/include)."""
    override = os.environ.get("PDTOOL_FABRIC_INCLUDE")
    if override is not None:
        return [d for d in override.split(os.pathsep) if d]
    dirs = [f[2:] for f in _pkg_config("--cflags-only-I") if f.startswith("-I")]
    for var in ("CPATH", "C_INCLUDE_PATH"):
        dirs += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
    dirs += ["/usr/local/include", "/usr/include", "/opt/amazon/efa/include"]
    return dirs


def find_header(dirs: list[str] | None = None) -> Path | None:
    """Path of `rdma/fabric.h` in the first directory that has it, or None (libfabric absent)."""
    for d in include_dirs() if dirs is None else dirs:
        p = Path(d) / "rdma" / "fabric.h"
        if p.is_file():
            return p
    return None


def _library_dirs() -> list[str]:
    dirs = [f[2:] for f in _pkg_config("--libs-only-L") if f.startswith("-L")]
    efa = Path("/opt/amazon/efa/lib")
    if efa.is_dir():
        dirs.append(str(efa))
    return dirs


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_header = find_header()
_inc = [str(_header.parent.parent)] if _header else []
ffibuilder.set_source(
    MODULE,
    SOURCE,
    libraries=["fabric"],
    include_dirs=[d for d in _inc if d != "/usr/include"],
    library_dirs=_library_dirs(),
    runtime_library_dirs=_library_dirs(),
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    # Run from anywhere: builds transfer/_fabric.abi3.so in the checkout.
    os.chdir(Path(__file__).resolve().parent.parent)
    built = Path(ffibuilder.compile(tmpdir=".", verbose=False))
    for leftover in Path("transfer").glob("_fabric*.o"):
        leftover.unlink()
    # Same file name as a pip/setuptools build (cffi compiles against the limited API), so a
    # later `pip install -e .` replaces it instead of being shadowed by a higher-priority suffix.
    for other in Path("transfer").glob("_fabric.*.so"):
        if other.resolve() != built.resolve():
            other.unlink()
    built.rename(built.with_name("_fabric.abi3.so"))

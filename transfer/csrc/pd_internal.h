/* Shared by the binding's C files, never seen by cffi: the structs behind the opaque handles
   of pd.h and the helpers more than one file needs. */
#ifndef PD_INTERNAL_H
#define PD_INTERNAL_H

#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>

#include "pd.h"

/* FI_OPT_CUDA_API_PERMITTED (libfabric >= 1.18) is an enum value in fi_endpoint.h, not a
   macro: test the headers' version. */
#define PD_HAVE_CUDA_API_PERMITTED \
    FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 18))

#define PD_CQ_BATCH 64
#define PD_MAX_IOV 16
#define PD_MAX_PEERS 1024   /* fi_addrs (FI_AV_TABLE: 0, 1, ...) with per-peer bytes in flight */
#define PD_NO_PEER UINT32_MAX

/* One fabric + domain. Endpoints (a decoder's receive lanes) and registrations each hold a
   reference, so a KV buffer is registered once for all lanes and the domain closes last. */
struct pd_dom {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    int refs;
    int want_remote_cntr;
    int hmem;
    uint32_t api;  /* the FI_VERSION the domain was opened at (pd_api_version) */
};

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
    pd_dom *dom;
    struct fi_info *info;         /* the domain's (borrowed) */
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
    uint64_t completions;         /* local writes settled (done or failed), ever */
    size_t cq_size;               /* as opened: a reset opens the same */
    uint64_t inflight_bytes;
    uint64_t max_inflight_bytes;  /* 0 = only the provider's queue depth limits */
    int64_t drain_sleep_ns;       /* > 0: refill in bursts, sleeping while the queue drains */
    uint64_t drain_low;           /* draining until inflight_bytes <= this */
    int draining;
    int yield_idle;         /* sched_yield() when a wait/retry loop found nothing to do */
    uint32_t idle_spins;    /* ... and after this many empty polls in a row, */
    int64_t idle_sleep_ns;  /* sleep this long per empty poll (0: never sleep), */
    int64_t idle_max_sleep_ns; /* ... doubling every 8 empty polls up to this (<= sleep: fixed) */
    uint32_t *kick;            /* decoder: idle sleeps wait on this word (kick.c), NULL: none */
    int64_t kick_max_sleep_ns; /* ... and may then grow up to this */
    int kick_change_only;      /* only pd_wait_change's events are kicked (a prefill's engine) */
    uint64_t kick_wakes;       /* sleeps a kick ended (or made needless): counted, tests read it */
    int wait_fd;               /* the CQ's wait object (FI_WAIT_FD: tcp), -1: none (kick.c) */
    int wake_fd;               /* ... slept on beside it: the engine's command pipe, -1: none */
    uint64_t fd_wakes;         /* sleeps on wait_fd that incoming work or a command ended */
    int ctl_fd;                /* a control socket's readiness fd (ZMQ_FD): pd_wait_change's
                                  kicked sleeps poll it with wake_fd instead of the futex */
    int news_fd;               /* decoder (owner): a byte goes here when a watched slot's count
                                  reaches its target, instead of setting `completed` */
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
    pd_dom *dom;
    struct fid_mr *mr;
    void *desc;
    uint64_t base;
    uint64_t len;
    int dmabuf;
};

/* util.c */
int64_t pd_now_ns(void);
void pd_idle(pd_ep *ep, unsigned *empty);
void pd_idle_seen(pd_ep *ep, unsigned *empty, uint32_t kick_seen);

/* kick.c */
uint32_t pd_kick_seen(const pd_ep *ep);
void pd_sleep_ns(pd_ep *ep, int64_t ns, uint32_t seen);
int64_t pd_max_sleep_ns(const pd_ep *ep);
int pd_kicked(const pd_ep *ep);
int pd_sleep_watch(pd_ep *ep, int64_t ns);
int pd_kicked_change(const pd_ep *ep);
int64_t pd_idle_ns(const pd_ep *ep, int64_t base_ns, unsigned sleeps);
#define PD_KICKED_SPINS 4  /* empty polls before a kicked wait sleeps (a burst's stragglers) */
/* A kicked lane's sleep while its owner counts no transfer: nothing is being sent to it, and
   what will be comes with a kick, so the timeout is a safety net only. At the kicked waits'
   cap (5 ms) every idle decoder's lane woke 200 times a second for nothing, each wake-up a
   slice of a core a prefill was computing on (docs/messenger.md, "Kick words"). */
#define PD_LANE_IDLE_SLEEP_NS 100000000LL
int64_t pd_backoff_ns(int64_t base_ns, int64_t max_ns, unsigned sleeps);
void pd_seterr(char *buf, size_t len, const char *call, int ret);
void pd_record_err(pd_ep *ep, uint64_t tag, int err, int prov_errno, const char *msg);
int64_t pd_clamp_ns(int64_t ns);

/* domain.c */
void pd_domain_retain(pd_dom *dom);

/* cq.c: the context pool, shared with write.c */
struct pd_ctx *pd_ctx_get(pd_ep *ep);
void pd_ctx_put(pd_ep *ep, struct pd_ctx *c);

#endif

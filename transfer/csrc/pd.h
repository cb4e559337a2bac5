/* The binding's public C API: what transfer/fabric.py calls through cffi.

   The build (transfer/_fabric_build.py) hands cffi the text between the PD_CDEF markers
   verbatim as its `cdef`, with every `#define PD_...` turned into `#define PD_... ...` (cffi
   then takes the value from the compiler). So each declaration below exists once: C and
   Python read the same line. Keep that region plain C declarations (no other preprocessor
   lines, no inline code) so cffi can parse it. */
#ifndef PD_H
#define PD_H

#include <stddef.h>
#include <stdint.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

/* PD_CDEF_BEGIN */
typedef struct pd_dom pd_dom;   /* one fabric + domain, shared by endpoints and registrations */
typedef struct pd_ep pd_ep;     /* one RDM endpoint with its CQ, AV and counting state */
typedef struct pd_mr pd_mr;     /* one registration in a domain */

/* What the domain open found (copied from the chosen fi_info). */
struct pd_info {
    char provider[64];
    char fabric[128];
    char domain[128];
    uint64_t mr_mode;
    uint64_t caps;
    uint64_t mode;
    size_t cq_data_size;
    size_t max_msg_size;
    int has_rma_event;
    int hmem;                 /* FI_HMEM granted (asked for with want_hmem) */
    int threading;            /* enum fi_threading the domain was opened with */
    uint32_t api_version;     /* FI_VERSION passed to fi_getinfo */
    uint32_t addr_format;
};

/* One completion error (the CQ's error entry, or a progress thread's failure). */
struct pd_err {
    uint64_t tag;
    int err;
    int prov_errno;
    char msg[256];
    uint32_t count;      /* failed operations of this tag and error folded into this entry */
};

#define PD_ETIMEDOUT FI_ETIMEDOUT
#define PD_EINVAL FI_EINVAL
#define PD_ENOSYS FI_ENOSYS
#define PD_EOPNOTSUPP FI_EOPNOTSUPP
#define PD_EBADFLAGS FI_EBADFLAGS
#define PD_EBUSY FI_EBUSY
#define PD_EIO FI_EIO
#define PD_HMEM_SYSTEM FI_HMEM_SYSTEM
#define PD_HMEM_CUDA FI_HMEM_CUDA
#define PD_ACCESS_LOCAL_WRITE (FI_WRITE | FI_READ)
#define PD_ACCESS_REMOTE_WRITE (FI_REMOTE_WRITE | FI_REMOTE_READ)
#define PD_ADDR_STR FI_ADDR_STR
#define PD_MAX_ERRORS 64   /* first capacity of the error list (it grows) */

/* domain.c: getinfo, fabric and domain (step 1 of opening an endpoint) */
int pd_domain_open(pd_dom **out, const char *prov, const char *domain, const char *node,
                   const char *service, int want_remote_cntr, int want_hmem,
                   struct pd_info *info, char *errbuf, size_t errlen);
void pd_domain_release(pd_dom *dom);
int pd_offers_hmem(const char *prov, const char *domain, const char *node, const char *service);
const char *pd_strerror(int err);
/* compiled against headers with FI_MR_DMABUF / FI_OPT_CUDA_API_PERMITTED (1 or 0) */
int pd_have_dmabuf(void);
uint32_t pd_api_version(int want_hmem);
uint32_t pd_header_version(void);
uint32_t pd_library_version(void);
int pd_dmabuf_allowed(uint32_t api);
int pd_dmabuf_falls_back(int ret);
int pd_have_cuda_api_permitted(void);

/* endpoint.c: CQ, AV, endpoint on a domain (step 2), peers and settings */
int pd_ep_open(pd_ep **out, pd_dom *dom, uint32_t ctx_pool, size_t cq_size,
               char *errbuf, size_t errlen);
void pd_close(pd_ep *ep);
pd_dom *pd_ep_domain(pd_ep *ep);
int pd_getname(pd_ep *ep, void *buf, size_t *len);
int pd_has_remote_cntr(pd_ep *ep);
int pd_av_insert(pd_ep *ep, const void *name, uint64_t *fi_addr);
int pd_av_remove(pd_ep *ep, uint64_t fi_addr);
int pd_ep_reset(pd_ep *ep, const char *why, char *errbuf, size_t errlen);
void pd_set_idle(pd_ep *ep, int yield_idle, uint32_t spins_before_sleep, int64_t sleep_ns);
void pd_set_idle_backoff(pd_ep *ep, int64_t max_sleep_ns);
void pd_set_max_inflight_bytes(pd_ep *ep, uint64_t max_bytes);
void pd_set_drain(pd_ep *ep, int64_t sleep_ns);
uint64_t pd_remote_cntr(pd_ep *ep);

/* mr.c: registration (host memory, or CUDA memory through FI_HMEM) */
int pd_mr_reg(pd_ep *ep, void *addr, size_t len, uint64_t access, int iface, int device,
              uint64_t requested_key, pd_mr **out, uint64_t *key, char *errbuf, size_t errlen);
int pd_mr_uses_dmabuf(pd_mr *mr);
void pd_mr_close(pd_mr *mr);
void *pd_mr_desc(pd_mr *mr);
int pd_probe_cuda_mr(pd_ep *ep, char *errbuf, size_t errlen);

/* cuda.c: libcuda loaded at run time, only for CUDA registrations */
int pd_cuda_check_pointer(void *addr, size_t len, int device, char *errbuf, size_t errlen);
/* A dma-buf fd for device memory [addr, addr+len) (page-aligned range, *offset into it):
   0, or -FI_ENOSYS with the driver's answer in errbuf. The caller closes *fd. */
int pd_cuda_dmabuf_fd(void *addr, size_t len, int *fd, uint64_t *offset, char *errbuf,
                      size_t errlen);
/* A fenced 32-bit store enqueued on a CUDA stream (cuStreamWriteValue32): the progress word. */
int pd_cuda_stream_write_u32(uint64_t stream, uint64_t dptr, uint32_t value, char *errbuf,
                             size_t errlen);

/* cq.c: draining the CQ, slot counting, completion errors, bounded waits */
void pd_set_counters(pd_ep *ep, uint32_t *recv_counts, uint16_t *recv_gen, uint32_t *send_done,
                     uint32_t nslots);
void pd_set_targets(pd_ep *ep, const uint32_t *targets);
uint64_t pd_stale(pd_ep *ep);
uint64_t pd_remote_writes(pd_ep *ep);
uint64_t pd_inflight_bytes(pd_ep *ep);
const uint64_t *pd_inflight_word(pd_ep *ep);
const uint64_t *pd_completions_word(pd_ep *ep);
const size_t *pd_nerr_word(pd_ep *ep);
size_t pd_take_errors(pd_ep *ep, struct pd_err *out, size_t max);
int pd_poll(pd_ep *ep, size_t max_entries);
int pd_wait_recv(pd_ep *ep, uint32_t slot, uint32_t target, int64_t timeout_ns);
int pd_wait_send(pd_ep *ep, uint32_t tag, uint32_t target, int64_t timeout_ns);
int pd_wait_idle(pd_ep *ep, int64_t timeout_ns);
int pd_wait_change(pd_ep *ep, const int64_t *a, int64_t a_seen, const int64_t *b, int64_t b_seen,
                   int64_t sleep_ns, int64_t timeout_ns);
int pd_wait_idle_or_change(pd_ep *ep, const int64_t *a, int64_t a_seen, const int64_t *b,
                           int64_t b_seen, int64_t timeout_ns);

/* write.c: batched writes, spread over a peer's receive lanes */
size_t pd_iov_limit(pd_ep *ep);
/* Batched writes: groups of writes, each to one registration and peer, in one call. */
struct pd_write_group {
    const uint64_t *peers;
    const uint64_t *remote_bases;
    const uint64_t *remote_keys;
    size_t nlanes;
    pd_mr *local;
    uint64_t remote_len;
    const uint64_t *src;
    const uint64_t *dst;
    const uint64_t *len;
    size_t n;
    uint32_t per_op;  /* writes per operation (the last one may carry fewer) */
    uint32_t imm;
    uint32_t tag;
    uint32_t *kick;
};
int pd_write_groups(pd_ep *ep, const struct pd_write_group *groups, size_t ngroups,
                    int64_t timeout_ns, size_t *group, size_t *done, char *errbuf,
                    size_t errlen);

/* progress.c: receive lanes and their progress threads, the decoder's completion wait */
void pd_share_counts(pd_ep *lane, pd_ep *owner);
void pd_set_active(pd_ep *ep, int on);
int pd_progress_start(pd_ep *ep, int64_t sleep_ns);
int pd_progress_stop(pd_ep *ep, int64_t timeout_ns);
int64_t pd_progress_stalled_ns(pd_ep *ep);
int pd_wait_complete(pd_ep *ep, const int64_t *bell, int64_t bell_seen, int64_t timeout_ns);
void pd_set_news_fd(pd_ep *ep, int fd);

/* kick.c: the decoder sleeps on a shared word the prefill bumps after posting writes (shm) */
void pd_set_kick(pd_ep *ep, uint32_t *word, int64_t max_sleep_ns, int change_only);
void pd_kick(uint32_t *word);
uint64_t pd_kick_wakes(const pd_ep *ep);
/* kick.c: a CQ with a wait fd (tcp) sleeps on it, and on the engine's command pipe */
void pd_set_wake_fd(pd_ep *ep, int fd);
uint64_t pd_fd_wakes(const pd_ep *ep);
int pd_has_wait_fd(const pd_ep *ep);
/* kick.c: a prefill's wait for its engine also ends on a control message */
void pd_set_ctl_fd(pd_ep *ep, int fd);
/* PD_CDEF_END */

#endif

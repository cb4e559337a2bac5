/* Draining the completion queue: remote CQ data -> per-slot counts (the decoder), local
   completions -> per-tag counts (the sender), completion errors -> the error ring; and the
   bounded waits built on that drain. */
#include <sched.h>
#include <string.h>
#include <unistd.h>

#include "pd_internal.h"

struct pd_ctx *pd_ctx_get(pd_ep *ep) {
    if (ep->ctx_free == ep->ctx_n) return NULL;
    struct pd_ctx *c = &ep->ctx[ep->ctx_free];
    ep->ctx_free = c->next_free;
    return c;
}

void pd_ctx_put(pd_ep *ep, struct pd_ctx *c) {
    c->next_free = ep->ctx_free;
    ep->ctx_free = (uint32_t)(c - ep->ctx);
}

static int pd_is_our_ctx(pd_ep *ep, void *p) {
    return p && (struct pd_ctx *)p >= ep->ctx && (struct pd_ctx *)p < ep->ctx + ep->ctx_n;
}

void pd_set_counters(pd_ep *ep, uint32_t *recv_counts, uint16_t *recv_gen, uint32_t *send_done,
                     uint32_t nslots) {
    ep->recv_counts = recv_counts;
    ep->recv_gen = recv_gen;
    ep->send_done = send_done;
    ep->nslots = nslots;
}

void pd_set_targets(pd_ep *ep, const uint32_t *targets) {
    __atomic_store_n(&ep->recv_target, targets, __ATOMIC_RELEASE);
}

uint64_t pd_stale(pd_ep *ep) { return ep->stale; }
uint64_t pd_remote_writes(pd_ep *ep) { return ep->remote_writes; }
uint64_t pd_inflight_bytes(pd_ep *ep) { return ep->inflight_bytes; }

/* Where the in-flight and error counts live, for a reader that must not call in: every call
   through the binding releases the GIL, and a messenger thread taking it back after each
   short call, mid forward pass, made the engine thread wait for it (docs/benchmark-rounds.md,
   "Third round"). Valid while the endpoint is open; a racy read is only a hint (the next poll
   settles it). */
const uint64_t *pd_inflight_word(pd_ep *ep) { return &ep->inflight; }
const uint64_t *pd_completions_word(pd_ep *ep) { return &ep->completions; }
const size_t *pd_nerr_word(pd_ep *ep) { return &ep->nerr; }

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

/* A watched slot of `o` reached its target. With a news fd (pd_set_news_fd) the engine is told
   from this thread, whichever counted the last write (the owner's wait or a lane): the
   owner's wait then keeps polling in C instead of returning to its messenger thread, which
   took the GIL and handed the news on, one more wake-up on the way to the first token
   (docs/benchmark-rounds.md, "Seventh round"). Without one, the owner's wait returns. */
static void pd_slot_complete(pd_ep *o) {
    int fd = __atomic_load_n(&o->news_fd, __ATOMIC_ACQUIRE);
    if (fd >= 0) {
        char byte = 0;
        ssize_t w = write(fd, &byte, 1);  /* non-blocking pipe; full: news is pending anyway */
        (void)w;
    } else {
        __atomic_store_n(&o->completed, 1, __ATOMIC_RELEASE);
    }
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
        if (t && c == t[slot]) pd_slot_complete(o);
    } else
        ep->stale++;
}

static void pd_unaccount(pd_ep *ep, struct pd_ctx *c) {
    ep->completions++;
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

/* Bounded busy waits; each drives progress by draining the CQ. 0 = reached, -FI_ETIMEDOUT.
   The clock is read after every poll, empty ones included: an empty poll may have slept (up
   to the kicked cap or the backoff's longest sleep), and reading it every 64th let a decoder's
   20 ms wait for commands run 64 kicked sleeps of up to 5 ms: a command queued just before
   the wait began sat there 250-320 ms (bench/messenger_scale.py, 100 requests in flight). */
#define PD_WAIT(cond) do { \
    int64_t deadline = pd_now_ns() + timeout_ns; unsigned empty = 0; \
    for (;;) { \
        uint32_t kicked = pd_kick_seen(ep);  /* before the checks: no kick is lost */ \
        int p = pd_poll(ep, PD_CQ_BATCH); if (p < 0) return p; /* bounded: check often */ \
        if (cond) return 0; \
        if (p == 0) pd_idle_seen(ep, &empty, kicked);  /* let a peer sharing this core run */ \
        else empty = 0; \
        if (pd_now_ns() > deadline) return -FI_ETIMEDOUT; \
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

/* A sender's wait while its writes are in flight: until none is (0), *a or *b changed (1,
   another thread's progress word or command doorbell), or the timeout (-FI_ETIMEDOUT). One wait
   instead of a loop of short pd_wait_idle slices, each of which came back to Python and took
   the GIL from the engine computing the next pass; idles by pd_idle (its backoff included). */
int pd_wait_idle_or_change(pd_ep *ep, const int64_t *a, int64_t a_seen, const int64_t *b,
                           int64_t b_seen, int64_t timeout_ns) {
    const volatile int64_t *va = a, *vb = b;
    int64_t deadline = pd_now_ns() + timeout_ns;
    unsigned empty = 0;
    for (;;) {
        uint32_t kicked = pd_kick_seen(ep);  /* before the checks: no kick is lost */
        int p = pd_poll(ep, PD_CQ_BATCH);
        if (p < 0) return p;
        if (ep->inflight == 0) return 0;
        if ((va && *va != a_seen) || (vb && *vb != b_seen)) return 1;
        if (p == 0) pd_idle_seen(ep, &empty, kicked);
        else empty = 0;
        if (pd_now_ns() > deadline) return -FI_ETIMEDOUT;  /* every round: see PD_WAIT */
    }
}

/* Wait for another thread to write a new value into *a or *b (an engine's per-layer progress
   word, a command doorbell), draining the CQ meanwhile: 1 = changed, 0 = timeout, 2 = the
   control socket (pd_set_ctl_fd) may have a message. Meant for waits on COMPUTE (a prefill
   forward pass): after a few empty polls it sleeps `sleep_ns` per poll, so the waiting
   thread neither spins a core the engine needs nor holds the GIL (a Python loop calling
   poll() did both). When the changes that matter come with a kick (pd_kicked_change: the
   engine kicks when it announces layers), a change of *a without one (a pass beginning)
   does not end the wait: while write completions kept this loop polling, returning for it
   cost the engine thread's GIL 14-19 times per 2,000-token prompt. */
int pd_wait_change(pd_ep *ep, const int64_t *a, int64_t a_seen, const int64_t *b, int64_t b_seen,
                   int64_t sleep_ns, int64_t timeout_ns) {
    const volatile int64_t *va = a, *vb = b;
    int64_t deadline = pd_now_ns() + timeout_ns;
    unsigned spins = 0;
    int kicked_only = pd_kicked_change(ep);
    uint32_t start = pd_kick_seen(ep);
    for (;;) {
        uint32_t kicked = pd_kick_seen(ep);  /* before the checks: no kick is lost */
        int p = pd_poll(ep, PD_CQ_BATCH);
        if (p < 0) return p;
        if ((va && *va != a_seen && (!kicked_only || kicked != start)) || (vb && *vb != b_seen))
            return 1;
        if (pd_now_ns() > deadline) return 0;
        if (p > 0) { spins = 0; continue; }
        if (pd_kicked_change(ep) && spins >= PD_KICKED_SPINS) {
            if (ep->ctl_fd >= 0 && ep->wake_fd >= 0) {  /* kicks come as pipe bytes too */
                int64_t left = deadline - pd_now_ns();
                if (pd_sleep_watch(ep, left < ep->kick_max_sleep_ns ? (left > 0 ? left : 0)
                                                                    : ep->kick_max_sleep_ns))
                    return 2;  /* a control message may be waiting: the caller reads it */
            } else {
                pd_sleep_ns(ep, ep->kick_max_sleep_ns, kicked);  /* the change comes with a kick */
            }
        } else if (++spins > 16 && sleep_ns > 0) {  /* growing by the endpoint's backoff, if any */
            pd_sleep_ns(ep, pd_backoff_ns(pd_clamp_ns(sleep_ns), pd_max_sleep_ns(ep), spins - 16),
                        kicked);  /* a kick (a layer done, a command) ends it */
        } else {
            sched_yield();
        }
    }
}

/* Batched RMA writes with immediate data: one C call submits a transfer's pages, grouped into
   operations and spread over the receiver's lanes, with bytes in flight capped per lane. */
#include <string.h>

#include "pd_internal.h"

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

/* Submit n writes with one call, as nops operations. Each carries `imm` as remote CQ data
   and a context naming `tag`, so the sender counts local completions per tag. On -FI_EAGAIN
   (queue full) or an empty context pool, drain the CQ (that also drives manual progress) and
   retry, bounded by timeout_ns.
   Operations: each carries the next `per_op` writes (the last one what is left)
   as ONE fi_writemsg with an iov per write, one imm and one completion on
   each side. Grouping several scattered pages into one operation divides the per-operation cost
   (a command, a CQ entry, a syscall on shm/tcp) by up to the iov limit; the decoder counts
   operations, so the grouping is the caller's part of the count protocol.
   `nlanes` > 1: the peer has several receive lanes (peers[l], remote_bases[l], remote_keys[l]
   for the same remote memory); each operation goes to one of them (pd_pick_lane), and with
   max_inflight_bytes set each lane gets an equal share of it.
   `kick`: the peer's kick word (kick.c) or NULL: kicked on every retry while the queue is
   full (the peer may be asleep, and only it drains that queue) and, with `kick_first`, once
   the first operation is posted (it copies while the rest is posted); the caller kicks once
   the last one is. */
static int write_batch(pd_ep *ep, const uint64_t *peers, const uint64_t *remote_bases,
                       const uint64_t *remote_keys, size_t nlanes, pd_mr *local,
                       uint64_t remote_len, const uint64_t *src,
                       const uint64_t *dst, const uint64_t *len, size_t n,
                       uint32_t per_op, uint32_t imm, uint32_t tag,
                       int64_t timeout_ns, uint32_t *kick, int kick_first, size_t *done,
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
    if (per_op < 1 || per_op > iov_max) {
        snprintf(errbuf, errlen, "write ops: %u writes in one operation, the provider takes "
                 "1..%zu", per_op, iov_max);
        return -FI_EINVAL;
    }
    size_t nops = (n + per_op - 1) / per_op;
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
        unsigned empty = 0;
        size_t k = n - i < per_op ? n - i : per_op;
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
            if (kick) pd_kick(kick);  /* a sleeping peer must drain its queue for us */
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
            /* the clock from the first retry on, every retry: one may have slept (see PD_WAIT,
               cq.c); a batch that never waits for the queue never reads it */
            int64_t now = pd_now_ns();
            if (!deadline) deadline = now + timeout_ns;
            else if (now > deadline) {
                pd_seterr(errbuf, errlen, "fi_writedata (queue stayed full)", -FI_ETIMEDOUT);
                *done = i;
                return -FI_ETIMEDOUT;
            }
        }
        i += k;
        if (kick && kick_first && j == 0) pd_kick(kick);  /* copying can start meanwhile */
    }
    *done = n;
    return 0;
}

static int kicked_before(const struct pd_write_group *groups, size_t g) {
    for (size_t h = 0; h < g; h++)
        if (groups[h].kick == groups[g].kick) return 1;
    return 0;
}

/* Batches in one call, each its own registration, peer lanes, imm and tag: a sender whose
   step holds writes for every layer buffer of a pass made one call per buffer, and each call
   through the binding releases the GIL, which a messenger thread then took back mid forward
   pass while the engine thread waited for it (docs/benchmark-rounds.md, "Third round"). Each
   group is checked and submitted as one batch (write_batch); on an error `*group` names the group
   and `*done` its writes submitted, the groups before it were submitted whole. `timeout_ns`
   bounds the whole call. A peer's kick word is kicked once everything is posted (and on
   retries), and after its first operation too when the call carries PD_KICK_EARLY_BYTES or
   more, so a receiver copies while the rest is posted: per group, a small pass woke the same
   receive lane once per layer buffer, and an early kick before a few KiB only woke it (and
   the decoder's messenger thread) twice. */
#define PD_KICK_EARLY_BYTES (1u << 20)
int pd_write_groups(pd_ep *ep, const struct pd_write_group *groups, size_t ngroups,
                    int64_t timeout_ns, size_t *group, size_t *done, char *errbuf,
                    size_t errlen) {
    int64_t end = pd_now_ns() + timeout_ns;  /* the whole call, not each group, is bounded */
    uint64_t bytes = 0;
    for (size_t g = 0; g < ngroups && bytes < PD_KICK_EARLY_BYTES; g++)
        for (size_t i = 0; i < groups[g].n && bytes < PD_KICK_EARLY_BYTES; i++)
            bytes += groups[g].len[i];
    int early = bytes >= PD_KICK_EARLY_BYTES;
    for (size_t g = 0; g < ngroups; g++) {
        const struct pd_write_group *w = &groups[g];
        int64_t left = end - pd_now_ns();
        *group = g;
        int ret = write_batch(ep, w->peers, w->remote_bases, w->remote_keys, w->nlanes,
                              w->local, w->remote_len, w->src, w->dst, w->len, w->n,
                              w->per_op, w->imm, w->tag, left > 0 ? left : 1,
                              w->kick, early && w->kick && !kicked_before(groups, g), done,
                              errbuf, errlen);
        if (ret) {
            for (size_t h = 0; h <= g; h++)  /* what was posted must be copied all the same */
                if (groups[h].kick && !kicked_before(groups, h)) pd_kick(groups[h].kick);
            return ret;
        }
    }
    for (size_t g = 0; g < ngroups; g++)  /* each peer has something to copy */
        if (groups[g].kick && !kicked_before(groups, g)) pd_kick(groups[g].kick);
    *group = ngroups;
    *done = 0;
    return 0;
}

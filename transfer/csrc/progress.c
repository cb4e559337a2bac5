/* Receive lanes: extra endpoints of the decoder's domain whose CQ data counts into the owner's
   slot table, each drained (on shm: its copies performed) by a C progress thread of its own;
   and the owner's wait for a watched slot to complete. */
#include <sched.h>

#include "pd_internal.h"

/* Make `lane` count into `owner`'s slots (before its progress thread starts). */
void pd_share_counts(pd_ep *lane, pd_ep *owner) { lane->owner = owner; }

/* Owner: whether transfers are being counted. Its lanes' threads poll eagerly while on, and
   sleep `thread_sleep_ns` x 50 per empty poll while off (1 ms by default: an idle decoder
   costs no core, and a new transfer waits at most that long for its first copy). While on, a
   lane with a backoff (`idle_max_sleep_ns`, pd_set_idle_backoff) lets that sleep grow as its
   polls stay empty, as pd_idle does. A lane whose every writer kicks it (pd_kicked) sleeps
   until kicked: while off, PD_LANE_IDLE_SLEEP_NS at most (nothing is being sent to it); while
   on, the kicked waits' cap, since a write shm moves in rounds (SAR) advances only when it
   polls. */
void pd_set_active(pd_ep *ep, int on) { __atomic_store_n(&ep->active, on, __ATOMIC_RELEASE); }

static void *pd_progress_main(void *arg) {
    pd_ep *ep = arg;
    pd_ep *o = ep->owner ? ep->owner : ep;
    unsigned empty = 0;
    while (!__atomic_load_n(&ep->thread_stop, __ATOMIC_ACQUIRE)) {
        uint32_t kicked = pd_kick_seen(ep);
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
        unsigned spins = pd_kicked(ep) && ep->idle_spins > PD_KICKED_SPINS ? PD_KICKED_SPINS
                                                                           : ep->idle_spins;
        if (++empty <= spins && __atomic_load_n(&o->active, __ATOMIC_ACQUIRE)) {
            sched_yield();
            continue;
        }
        int active = __atomic_load_n(&o->active, __ATOMIC_ACQUIRE);
        int64_t ns = pd_kicked(ep)  /* a kick brings the next work */
            ? (active ? pd_max_sleep_ns(ep) : PD_LANE_IDLE_SLEEP_NS)
            : active
            ? pd_backoff_ns(ep->thread_sleep_ns, ep->idle_max_sleep_ns, empty - ep->idle_spins)
            : ep->thread_sleep_ns * 50;
        pd_sleep_ns(ep, ns, kicked);  /* a kick (writes posted to us) ends it */
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
    uint32_t *w = __atomic_load_n(&ep->kick, __ATOMIC_ACQUIRE);
    if (w) pd_kick(w);  /* end a kicked sleep now: its owner's other waits just poll once more */
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

/* The owner's news fd: the read end of the engine's doorbell pipe is polled by the engine;
   this is its write end (non-blocking), -1: none. It must stay open as long as the endpoint. */
void pd_set_news_fd(pd_ep *ep, int fd) { __atomic_store_n(&ep->news_fd, fd, __ATOMIC_RELEASE); }

/* The decoder's wait while transfers are being counted: drive progress (on shm this thread
   does the copies) until some slot's count reaches its target (1; not with a news fd, which
   tells the engine directly), the engine rang *bell (2), or the timeout (0). Returning only
   then keeps the Python loop out of the copy path: one return per completed request (or
   none) instead of one per short slice. */
int pd_wait_complete(pd_ep *ep, const int64_t *bell, int64_t bell_seen, int64_t timeout_ns) {
    const volatile int64_t *vb = bell;
    int64_t deadline = pd_now_ns() + timeout_ns;
    unsigned empty = 0;
    for (;;) {
        uint32_t kicked = pd_kick_seen(ep);
        int p = pd_poll(ep, PD_CQ_BATCH);
        if (p < 0) return p;
        /* consumed, not reset on entry: a lane thread may complete a slot at any moment, and
           a flag set just before this call must not be lost (a spare return is harmless) */
        if (__atomic_exchange_n(&ep->completed, 0, __ATOMIC_ACQ_REL)) return 1;
        if (vb && *vb != bell_seen) return 2;
        if (p == 0) pd_idle_seen(ep, &empty, kicked);
        else empty = 0;
        if (pd_now_ns() > deadline) return 0;  /* every round: see PD_WAIT (cq.c) */
    }
}

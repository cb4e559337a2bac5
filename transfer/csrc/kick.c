/* The kick word: an event-driven wake-up for a decoder's idle waits on one host (shm).

   libfabric's shm provider has no wait object a peer's write can signal (it flags the target's
   region in shared memory and expects the target to poll), so a decoder counting writes that
   arrive only after each prefill forward pass polled with a backoff: thousands of wake-ups a
   second per thread, each a slice of a core the prefill needs on a small box. Instead the
   decoder shares one 32-bit word (a memfd page the prefill maps) and sleeps on it with
   futex(2); the prefill bumps it and wakes the sleepers after it posts writes to that decoder
   (pd_kick). A kick that comes between the decoder's read of the word and its sleep makes the
   sleep return at once (FUTEX_WAIT compares first), so none is lost; every sleep still ends
   after its timeout, so a missed kick costs at most that long. Not private futexes: the word
   is shared between processes. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "pd_internal.h"

/* Sleep on `word` in this endpoint's idle waits (NULL: plain sleeps again). `max_sleep_ns` > 0:
   whatever those waits wait for comes with a kick, so they sleep that long at once (a
   decoder whose every writer kicks it); `change_only`: only pd_wait_change's events do (a
   prefill whose engine kicks with every command and finished layer; its writes' completions
   are not kicked, so its other waits keep their backoff). */
void pd_set_kick(pd_ep *ep, uint32_t *word, int64_t max_sleep_ns, int change_only) {
    ep->kick_max_sleep_ns = pd_clamp_ns(max_sleep_ns);
    ep->kick_change_only = change_only;
    __atomic_store_n(&ep->kick, word, __ATOMIC_RELEASE);
}

/* Prefill: writes to the decoder sharing `word` were posted: wake its sleepers. */
void pd_kick(uint32_t *word) {
    __atomic_add_fetch(word, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* The engine's command pipe (its read end, non-blocking): a sleep on the CQ's wait fd also
   ends when a byte arrives there, and takes the pending bytes (-1: none). */
void pd_set_wake_fd(pd_ep *ep, int fd) { __atomic_store_n(&ep->wake_fd, fd, __ATOMIC_RELEASE); }

/* Whether this endpoint's CQ has a wait fd (its sleeps end when bytes come). */
int pd_has_wait_fd(const pd_ep *ep) { return ep->wait_fd >= 0; }

/* Sleeps on the wait fd that work (or a command) ended early: tests read it. */
uint64_t pd_fd_wakes(const pd_ep *ep) { return __atomic_load_n(&ep->fd_wakes, __ATOMIC_RELAXED); }

/* A sleep on file descriptors: the CQ's wait fd where it has one (tcp: the provider has
   something for it, bytes on one of its sockets), the wake pipe (a command; its pending bytes
   are taken), and `ctl_fd` (-1: none), until one is readable or `ts` passed. On tcp the
   receiver's polls move the bytes, and a blind backoff sleep stalled a peer's stream for up to
   poll_backoff_s: at 1 MiB pages the messenger ran at half the raw binding's rate. fi_trywait
   first: with events already pending it refuses and the caller polls again at once.
   1: `ctl_fd` was readable. */
static int pd_sleep_fds(pd_ep *ep, const struct timespec *ts, int ctl_fd) {
    struct pollfd fds[3] = {
        { -1, POLLIN, 0 },
        { __atomic_load_n(&ep->wake_fd, __ATOMIC_ACQUIRE), POLLIN, 0 },
        { ctl_fd, POLLIN, 0 } };
    if (ep->wait_fd >= 0) {
        struct fid *cq = &ep->cq->fid;
        if (fi_trywait(ep->dom->fabric, &cq, 1) != FI_SUCCESS) return 0;  /* work pending */
        fds[0].fd = ep->wait_fd;
    }
    int n = ppoll(fds, 3, ts, NULL);  /* negative fds are ignored */
    if (n <= 0) return 0;
    __atomic_add_fetch(&ep->fd_wakes, 1, __ATOMIC_RELAXED);
    if (fds[1].revents & POLLIN) {  /* the command (or announcement) is visible by now */
        char buf[64];
        while (read(fds[1].fd, buf, sizeof(buf)) == (ssize_t)sizeof(buf)) {}
    }
    return (fds[2].revents & (POLLIN | POLLERR | POLLHUP)) != 0;
}

/* A control socket's readiness fd (a ZeroMQ socket's ZMQ_FD; -1: none). With it and a wake
   pipe set, pd_wait_change's kicked sleeps (a prefill waiting for its engine) poll both
   instead of sleeping on the futex, and return when the socket may have a message. Before,
   those sleeps had to end every few milliseconds so that the Python loop could look at the
   socket, and each return took the GIL from the engine thread in the middle of its forward
   pass. The engine's announcements then come as a byte on the wake pipe (with the kick). */
void pd_set_ctl_fd(pd_ep *ep, int fd) { __atomic_store_n(&ep->ctl_fd, fd, __ATOMIC_RELEASE); }

/* That sleep (pd_sleep_fds with the control socket): `ns` at most. 1: the socket's fd is
   readable (its owner reads the socket; ZMQ_FD is edge-triggered, so the owner checks
   ZMQ_EVENTS before it waits again). */
int pd_sleep_watch(pd_ep *ep, int64_t ns) {
    struct timespec ts = { ns / 1000000000LL, (long)(ns % 1000000000LL) };
    return pd_sleep_fds(ep, &ts, __atomic_load_n(&ep->ctl_fd, __ATOMIC_ACQUIRE));
}

/* The word's value before a poll: pass it to pd_sleep_ns after the poll found nothing. */
uint32_t pd_kick_seen(const pd_ep *ep) {
    const uint32_t *w = __atomic_load_n(&ep->kick, __ATOMIC_ACQUIRE);
    return w ? __atomic_load_n(w, __ATOMIC_ACQUIRE) : 0;
}

/* An idle wait's sleep: on the kick word (returns early when kicked after `seen` was read),
   else on the CQ's wait fd where it has one, else nanosleep. */
void pd_sleep_ns(pd_ep *ep, int64_t ns, uint32_t seen) {
    uint32_t *w = __atomic_load_n(&ep->kick, __ATOMIC_ACQUIRE);
    struct timespec ts = { ns / 1000000000LL, (long)(ns % 1000000000LL) };
    if (!w && ep->wait_fd >= 0) {
        pd_sleep_fds(ep, &ts, -1);
        return;
    }
    if (!w) {
        nanosleep(&ts, NULL);
        return;
    }
    long r = syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0);
    if (r == 0 || errno == EAGAIN)  /* woken, or kicked before it slept (not a timeout) */
        __atomic_add_fetch(&ep->kick_wakes, 1, __ATOMIC_RELAXED);
}

/* How many of this endpoint's sleeps a kick ended (or made needless). */
uint64_t pd_kick_wakes(const pd_ep *ep) { return __atomic_load_n(&ep->kick_wakes, __ATOMIC_RELAXED); }

/* Whether every writer of this endpoint kicks it (a kick word with its own cap): its idle
   waits then need no short polling sleeps at all, since new work comes with a kick. */
int pd_kicked(const pd_ep *ep) {
    return pd_kicked_change(ep) && !ep->kick_change_only;
}

/* Whether pd_wait_change's events (a progress word, a doorbell) come with a kick. */
int pd_kicked_change(const pd_ep *ep) {
    return __atomic_load_n(&ep->kick, __ATOMIC_ACQUIRE) != NULL && ep->kick_max_sleep_ns > 0;
}

/* The longest idle sleep of this endpoint's backoff: longer when kicked (a kick ends it). */
int64_t pd_max_sleep_ns(const pd_ep *ep) {
    return pd_kicked(ep) ? ep->kick_max_sleep_ns : ep->idle_max_sleep_ns;
}

/* The `sleeps`-th idle sleep from `base_ns`: the backoff (pd_backoff_ns), or, when kicked,
   the cap at once: after a burst the next work comes with a kick, and short sleeps would only
   wake the thread dozens of times per burst for nothing. */
int64_t pd_idle_ns(const pd_ep *ep, int64_t base_ns, unsigned sleeps) {
    return pd_kicked(ep) ? ep->kick_max_sleep_ns
                         : pd_backoff_ns(base_ns, ep->idle_max_sleep_ns, sleeps);
}

/* A wait/retry loop's poll found nothing to do. Busy-polling keeps latency low, but on a box
   with fewer cores than spinning threads the spinner steals the core from the thread that does
   the work (on shm the TARGET performs the copy, process_vm_readv, inside its poll, while the
   initiator with a full queue only waits): yield at once, and after `idle_spins` empty polls in
   a row sleep `idle_sleep_ns` per poll, so a long wait costs almost no CPU. With a backoff
   (`idle_max_sleep_ns`) the sleep doubles while polls stay empty: a wait that lasts a whole
   prefill (a decoder counting writes that come only after each forward pass) then wakes a few
   thousand times a second instead of tens of thousands, each wake-up a slice of the core the
   compute needs. Any poll that finds work starts over at the short sleep. */
void pd_idle(pd_ep *ep, unsigned *empty) { pd_idle_seen(ep, empty, pd_kick_seen(ep)); }

/* pd_idle for a wait that read the kick word (`kick_seen`) before its poll: the sleep
   ends early when the prefill kicked since. */
void pd_idle_seen(pd_ep *ep, unsigned *empty, uint32_t kick_seen) {
    unsigned spins = pd_kicked(ep) && ep->idle_spins > PD_KICKED_SPINS ? PD_KICKED_SPINS
                                                                       : ep->idle_spins;
    if (ep->idle_sleep_ns > 0 && ++*empty > spins) {
        pd_sleep_ns(ep, pd_idle_ns(ep, ep->idle_sleep_ns, *empty - spins), kick_seen);
    } else if (ep->yield_idle) {
        sched_yield();
    }
}

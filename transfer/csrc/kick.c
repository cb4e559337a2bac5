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

/* The word's value before a poll: pass it to pd_sleep_ns after the poll found nothing. */
uint32_t pd_kick_seen(const pd_ep *ep) {
    const uint32_t *w = __atomic_load_n(&ep->kick, __ATOMIC_ACQUIRE);
    return w ? __atomic_load_n(w, __ATOMIC_ACQUIRE) : 0;
}

/* An idle wait's sleep: on the kick word (returns early when kicked after `seen` was read),
   else nanosleep. */
void pd_sleep_ns(pd_ep *ep, int64_t ns, uint32_t seen) {
    uint32_t *w = __atomic_load_n(&ep->kick, __ATOMIC_ACQUIRE);
    struct timespec ts = { ns / 1000000000LL, (long)(ns % 1000000000LL) };
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

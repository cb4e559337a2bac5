/* Small helpers every part of the binding uses: the clock, idling, error text. */
#include <sched.h>
#include <string.h>

#include "pd_internal.h"

int64_t pd_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleep lengths are nanosleep's tv_nsec: at most just under a second. */
int64_t pd_clamp_ns(int64_t ns) { return ns < 0 ? 0 : (ns > 999999999 ? 999999999 : ns); }

/* A wait/retry loop's poll found nothing to do. Busy-polling keeps latency low, but on a box
   with fewer cores than spinning threads the spinner steals the core from the thread that does
   the work (on shm the TARGET performs the copy, process_vm_readv, inside its poll, while the
   initiator with a full queue only waits): yield at once, and after `idle_spins` empty polls in
   a row sleep `idle_sleep_ns` per poll, so a long wait costs almost no CPU. */
void pd_idle(pd_ep *ep, unsigned *empty) {
    if (ep->idle_sleep_ns > 0 && ++*empty > ep->idle_spins) {
        struct timespec ts = { 0, (long)ep->idle_sleep_ns };
        nanosleep(&ts, NULL);
    } else if (ep->yield_idle) {
        sched_yield();
    }
}

void pd_seterr(char *buf, size_t len, const char *call, int ret) {
    if (buf && len)
        snprintf(buf, len, "%s: %s (%d)", call, fi_strerror(ret < 0 ? -ret : ret), ret);
}

const char *pd_strerror(int err) { return fi_strerror(err < 0 ? -err : err); }

void pd_record_err(pd_ep *ep, uint64_t tag, int err, int prov_errno, const char *msg) {
    pthread_mutex_lock(&ep->err_lock);
    if (ep->nerr == PD_MAX_ERRORS) {
        memmove(&ep->errs[0], &ep->errs[1], sizeof(ep->errs[0]) * (PD_MAX_ERRORS - 1));
        ep->nerr--;
        ep->dropped_errs++;
    }
    struct pd_err *e = &ep->errs[ep->nerr++];
    e->tag = tag;
    e->err = err;
    e->prov_errno = prov_errno;
    snprintf(e->msg, sizeof(e->msg), "%s", msg ? msg : "");
    pthread_mutex_unlock(&ep->err_lock);
}

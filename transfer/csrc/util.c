/* Small helpers every part of the binding uses: the clock, sleep lengths, error text. They call
   nothing else of the binding (idling, which sleeps on the kick word, is in kick.c). */
#include <stdlib.h>
#include <string.h>

#include "pd_internal.h"

int64_t pd_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleep lengths are nanosleep's tv_nsec: at most just under a second. */
int64_t pd_clamp_ns(int64_t ns) { return ns < 0 ? 0 : (ns > 999999999 ? 999999999 : ns); }

/* The `sleeps`-th sleep (1-based) of an idle stretch: `base_ns`, doubled every 8 sleeps, at
   most `max_ns` (no growth when `max_ns` <= `base_ns`). */
int64_t pd_backoff_ns(int64_t base_ns, int64_t max_ns, unsigned sleeps) {
    if (max_ns <= base_ns || sleeps == 0) return base_ns;
    unsigned shift = (sleeps - 1) / 8;
    if (shift > 20) return max_ns;
    int64_t ns = base_ns << shift;
    return ns > max_ns ? max_ns : ns;
}

void pd_seterr(char *buf, size_t len, const char *call, int ret) {
    if (buf && len)
        snprintf(buf, len, "%s: %s (%d)", call, fi_strerror(ret < 0 ? -ret : ret), ret);
}

const char *pd_strerror(int err) { return fi_strerror(err < 0 ? -err : err); }

/* Errors of a tag already listed fold into its entry (one entry per (tag, error): bounded by
   the tags in use, the first message kept); a new one grows the list. Dropping one would leave
   its sender waiting forever for an operation that will never complete. */
void pd_record_err(pd_ep *ep, uint64_t tag, int err, int prov_errno, const char *msg) {
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

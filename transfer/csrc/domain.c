/* Step 1 of opening an endpoint: choose the provider's fi_info, open its fabric and domain.

   Kept apart from the endpoint (endpoint.c) so several endpoints share one domain: a decoder's
   receive lanes are endpoints of ONE domain, and a KV buffer registered there once serves all
   of them (on the domain's threading level see pd_hints). */
#include <stdlib.h>
#include <string.h>

#include "pd_internal.h"

int pd_have_dmabuf(void) {
#ifdef FI_MR_DMABUF
    return 1;
#else
    return 0;
#endif
}

int pd_have_cuda_api_permitted(void) { return PD_HAVE_CUDA_API_PERMITTED; }

/* FI_VERSION for fi_getinfo. Without FI_HMEM: 1.17, what the binding was written against.
   With FI_HMEM: the highest version both the headers and the library know, up to PD_API_MAX.
   Providers gate behaviour on it: from 1.18 they interpret FI_HMEM with
   FI_OPT_CUDA_API_PERMITTED and report FI_HMEM per domain, and EFA accepts FI_MR_DMABUF only
   from 1.20 (efa_mr_regattr_validate, since v1.21; below it -FI_EBADFLAGS, which failed every
   KV registration when the binding asked for 1.18). PD_API_MAX keeps the 1.x semantics the
   binding was tested with when the library is 2.x (2.0 changed mode bits and MR defaults). */
#define PD_API_MAX FI_VERSION(1, 22)
uint32_t pd_api_version(int want_hmem) {
    uint32_t v = FI_VERSION(1, 17);
    if (!want_hmem) return v;
    uint32_t best = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    uint32_t lib = fi_version();
    if (FI_VERSION_LT(lib, best)) best = lib;
    if (FI_VERSION_LT(PD_API_MAX, best)) best = PD_API_MAX;
    return FI_VERSION_LT(best, v) ? v : best;
}

/* The libfabric version this binding was compiled against (its headers). */
uint32_t pd_header_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
uint32_t pd_library_version(void) { return fi_version(); }

/* Whether a domain opened at API `api` may register CUDA memory as a dma-buf
   (FI_MR_DMABUF): the flag exists from 1.20, and EFA refuses it below. */
int pd_dmabuf_allowed(uint32_t api) {
#ifdef FI_MR_DMABUF
    return FI_VERSION_GE(api, FI_VERSION(1, 20));
#else
    (void)api;
    return 0;
#endif
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
    /* FI_THREAD_COMPLETION, not FI_THREAD_DOMAIN: a decoder's receive lanes are endpoints of
       one domain, each with its own CQ drained by its own thread, which is exactly what this
       level allows (access serialized per completion queue and what is bound to it). */
    h->domain_attr->threading = FI_THREAD_COMPLETION;
    h->domain_attr->av_type = FI_AV_TABLE;
    if (prov && *prov) h->fabric_attr->prov_name = strdup(prov);
    return h;
}

/* fi_getinfo for `prov`/`domain` with `extra_caps`: the matching entry (dup'd) or NULL with
   *ret set. node/service name the LOCAL address to bind (FI_SOURCE), e.g. 127.0.0.1 for tcp. */
static struct fi_info *pd_find(const char *prov, const char *domain, const char *node,
                               const char *service, uint64_t extra_caps, uint32_t version,
                               int *ret) {
    struct fi_info *list = NULL, *hints = pd_hints(prov, extra_caps), *out = NULL;
    if (!hints) { *ret = -FI_ENOMEM; return NULL; }
    int local = (node && *node) || (service && *service);
    *ret = fi_getinfo(version, (node && *node) ? node : NULL,
                      (service && *service) ? service : NULL, local ? FI_SOURCE : 0,
                      hints, &list);
    fi_freeinfo(hints);
    if (*ret == 0) {
        struct fi_info *pick = pd_pick(list, prov, domain);
        if (pick) out = fi_dupinfo(pick);
        else *ret = -FI_ENODATA;
        fi_freeinfo(list);
    }
    return out;
}

/* Whether the provider offers FI_HMEM on this domain: 1, 0, or a negative fi errno. FI_HMEM
   is a capability of the provider build; whether device memory really registers is decided by
   pd_probe_cuda_mr (a build without CUDA still lists FI_HMEM for shm: 1.17 on Debian). */
int pd_offers_hmem(const char *prov, const char *domain, const char *node, const char *service) {
    int ret;
    struct fi_info *fi = pd_find(prov, domain, node, service, FI_HMEM, pd_api_version(1), &ret);
    if (fi) { fi_freeinfo(fi); return 1; }
    return ret == -FI_ENODATA ? 0 : ret;
}

void pd_domain_retain(pd_dom *dom) { __atomic_add_fetch(&dom->refs, 1, __ATOMIC_ACQ_REL); }

void pd_domain_release(pd_dom *dom) {
    if (!dom || __atomic_sub_fetch(&dom->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
    if (dom->domain) fi_close(&dom->domain->fid);
    if (dom->fabric) fi_close(&dom->fabric->fid);
    if (dom->info) fi_freeinfo(dom->info);
    free(dom);
}

/* Open the fabric and domain of the first fi_info matching prov/domain. want_remote_cntr asks
   for FI_RMA_EVENT first (tcp/efa/verbs lack it) and falls back to CQ data only; want_hmem
   asks for FI_HMEM (device memory registration) and fails when the provider lacks it. The
   caller holds the one reference (pd_domain_release). */
int pd_domain_open(pd_dom **out, const char *prov, const char *domain, const char *node,
                   const char *service, int want_remote_cntr, int want_hmem,
                   struct pd_info *pi, char *errbuf, size_t errlen) {
    *out = NULL;
    pd_dom *dom = calloc(1, sizeof(*dom));
    if (!dom) { pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM); return -FI_ENOMEM; }
    dom->refs = 1;
    dom->want_remote_cntr = want_remote_cntr;
    uint64_t hmem = want_hmem ? FI_HMEM : 0;
    uint32_t version = pd_api_version(want_hmem);
    int ret = -FI_ENODATA;
    for (int attempt = want_remote_cntr ? 0 : 1; attempt < 2 && !dom->info; attempt++)
        dom->info = pd_find(prov, domain, node, service, hmem | (attempt == 0 ? FI_RMA_EVENT : 0),
                            version, &ret);
    if (!dom->info) {
        pd_seterr(errbuf, errlen, want_hmem ? "fi_getinfo (FI_HMEM)" : "fi_getinfo",
                  ret ? ret : -FI_ENODATA);
        pd_domain_release(dom);
        return ret ? ret : -FI_ENODATA;
    }
    struct fi_info *fi = dom->info;
    dom->api = version;
    dom->hmem = (fi->caps & FI_HMEM) != 0;
    ret = fi_fabric(fi->fabric_attr, &dom->fabric, NULL);
    if (ret) { pd_seterr(errbuf, errlen, "fi_fabric", ret); pd_domain_release(dom); return ret; }
    ret = fi_domain(dom->fabric, fi, &dom->domain, NULL);
    if (ret) { pd_seterr(errbuf, errlen, "fi_domain", ret); pd_domain_release(dom); return ret; }
    memset(pi, 0, sizeof(*pi));
    snprintf(pi->provider, sizeof(pi->provider), "%s", fi->fabric_attr->prov_name);
    snprintf(pi->fabric, sizeof(pi->fabric), "%s", fi->fabric_attr->name);
    snprintf(pi->domain, sizeof(pi->domain), "%s", fi->domain_attr->name);
    pi->mr_mode = fi->domain_attr->mr_mode;
    pi->caps = fi->caps;
    pi->mode = fi->mode;
    pi->cq_data_size = fi->domain_attr->cq_data_size;
    pi->max_msg_size = fi->ep_attr->max_msg_size;
    pi->has_rma_event = (fi->caps & FI_RMA_EVENT) != 0;
    pi->hmem = dom->hmem;
    pi->threading = (int)fi->domain_attr->threading;
    pi->api_version = version;
    pi->addr_format = fi->addr_format;
    *out = dom;
    return 0;
}

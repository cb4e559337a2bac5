/* Memory registration in a domain: host memory, or CUDA memory through FI_HMEM (with a dma-buf
   where both libfabric's headers and the CUDA driver offer one). A registration belongs to the
   domain, so every endpoint of it (a decoder's receive lanes) uses the same key; only providers
   with FI_MR_ENDPOINT bind it to one endpoint. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd_internal.h"

/* Bind to the endpoint (FI_MR_ENDPOINT) and to its remote-write counter, then enable. */
static int pd_mr_bind(pd_ep *ep, struct fid_mr *mr, uint64_t access, char *errbuf,
                      size_t errlen) {
    int ret;
    if (ep->mr_mode & FI_MR_ENDPOINT) {
        ret = fi_mr_bind(mr, &ep->ep->fid, 0);
        if (!ret) ret = fi_mr_enable(mr);
        if (ret) { pd_seterr(errbuf, errlen, "fi_mr_bind/enable", ret); return ret; }
    }
    if (ep->rcntr && (access & FI_REMOTE_WRITE) && (ep->mr_mode & FI_MR_RMA_EVENT)) {
        ret = fi_mr_bind(mr, &ep->rcntr->fid, FI_REMOTE_WRITE);
        if (!ret) ret = fi_mr_enable(mr);
        if (ret) { pd_seterr(errbuf, errlen, "fi_mr_bind(cntr)", ret); return ret; }
    }
    return 0;
}

/* Whether a refused dma-buf registration falls back to registering the address: the provider
   or its API level does not take dma-bufs this way (EFA answers -FI_EBADFLAGS to FI_MR_DMABUF
   below API 1.20), not a broken buffer. */
int pd_dmabuf_falls_back(int ret) {
    return ret == -FI_ENOSYS || ret == -FI_EOPNOTSUPP || ret == -FI_EINVAL
        || ret == -FI_EBADFLAGS;
}

#ifdef FI_MR_DMABUF
/* CUDA memory as a dma-buf (the kernel's way to share device memory with the NIC, no
   nvidia-peermem needed). 1 = registered, 0 = not possible here (caller falls back to the
   address registration), < 0 = the provider refused a valid dma-buf. */
static int pd_reg_dmabuf(pd_dom *dom, struct fi_mr_attr *attr, void *addr, size_t len,
                         struct fid_mr **mr) {
    int fd = -1;
    uint64_t off = 0;
    char why[200];
    if (!pd_dmabuf_allowed(dom->api)) return 0;
    if (pd_cuda_dmabuf_fd(addr, len, &fd, &off, why, sizeof(why))) return 0;
    struct fi_mr_dmabuf dmabuf = {
        .fd = fd, .offset = off, .len = len, .base_addr = (char *)addr - off,
    };
    struct fi_mr_attr a = *attr;
    a.dmabuf = &dmabuf;
    int ret = fi_mr_regattr(dom->domain, &a, FI_MR_DMABUF | FI_HMEM_DEVICE_ONLY, mr);
    close(fd);  /* the registration holds its own reference to the buffer */
    if (pd_dmabuf_falls_back(ret)) return 0;
    return ret ? ret : 1;
}
#endif

/* Register [addr, addr+len) in ep's domain. iface FI_HMEM_CUDA: the pointer is checked first
   (pd_cuda_check_pointer), then registered as device memory of `device` only
   (FI_HMEM_DEVICE_ONLY: the provider never treats it as host memory). */
int pd_mr_reg(pd_ep *ep, void *addr, size_t len, uint64_t access, int iface, int device,
              uint64_t requested_key, pd_mr **out, uint64_t *key, char *errbuf, size_t errlen) {
    *out = NULL;
    int cuda = iface == FI_HMEM_CUDA;
    if (iface != FI_HMEM_SYSTEM && !cuda) {
        snprintf(errbuf, errlen, "memory interface %d: only host and CUDA memory", iface);
        return -FI_EINVAL;
    }
    if (cuda) {
        int ret = pd_cuda_check_pointer(addr, len, device, errbuf, errlen);
        if (ret) return ret;
    }
    pd_mr *m = calloc(1, sizeof(*m));
    if (!m) { pd_seterr(errbuf, errlen, "calloc", -FI_ENOMEM); return -FI_ENOMEM; }
    struct iovec iov = { .iov_base = addr, .iov_len = len };
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = (enum fi_hmem_iface)iface;
    if (cuda) attr.device.cuda = device;
    int ret = 0, done = 0;
#ifdef FI_MR_DMABUF
    if (cuda) {
        ret = pd_reg_dmabuf(ep->dom, &attr, addr, len, &m->mr);
        done = ret != 0;
        m->dmabuf = ret == 1;
        if (ret == 1) ret = 0;
    }
#endif
    if (!done)
        ret = fi_mr_regattr(ep->dom->domain, &attr, cuda ? FI_HMEM_DEVICE_ONLY : 0, &m->mr);
    if (ret) {
        pd_seterr(errbuf, errlen, cuda ? "fi_mr_regattr(FI_HMEM_CUDA)" : "fi_mr_regattr", ret);
        free(m);
        return ret;
    }
    ret = pd_mr_bind(ep, m->mr, access, errbuf, errlen);
    if (ret) { fi_close(&m->mr->fid); free(m); return ret; }
    *key = fi_mr_key(m->mr);
    if (*key == FI_KEY_NOTAVAIL) {
        pd_seterr(errbuf, errlen, "fi_mr_key (raw keys unsupported)", -FI_ENOSYS);
        fi_close(&m->mr->fid); free(m); return -FI_ENOSYS;
    }
    m->desc = fi_mr_desc(m->mr);
    m->base = (uint64_t)(uintptr_t)addr;
    m->len = len;
    pd_domain_retain(ep->dom);
    m->dom = ep->dom;
    *out = m;
    return 0;
}

int pd_mr_uses_dmabuf(pd_mr *m) { return m->dmabuf; }

void *pd_mr_desc(pd_mr *m) { return m->desc; }

void pd_mr_close(pd_mr *m) {
    if (!m) return;
    if (m->mr) fi_close(&m->mr->fid);
    pd_domain_release(m->dom);
    free(m);
}

/* Whether this libfabric can register CUDA memory at all, decided without CUDA: a CUDA
   registration of a host page. A library built without CUDA (Debian's) or whose CUDA support
   did not initialize answers -FI_ENOSYS before looking at the memory; any other answer (even
   an error about the page not being device memory) means the CUDA path exists. 0 = it does,
   else the negative errno with the provider's answer in errbuf. */
int pd_probe_cuda_mr(pd_ep *ep, char *errbuf, size_t errlen) {
    static char page[4096] __attribute__((aligned(4096)));
    struct iovec iov = { .iov_base = page, .iov_len = sizeof(page) };
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_REMOTE_WRITE;
    attr.requested_key = 0xfffffff0u;
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = 0;
    struct fid_mr *mr = NULL;
    int ret = fi_mr_regattr(ep->dom->domain, &attr, 0, &mr);
    if (mr) fi_close(&mr->fid);
    if (ret == -FI_ENOSYS) {
        pd_seterr(errbuf, errlen, "fi_mr_regattr(FI_HMEM_CUDA)", ret);
        return ret;
    }
    return 0;
}

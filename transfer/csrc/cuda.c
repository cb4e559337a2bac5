/* The CUDA driver, loaded at run time (dlopen) only when CUDA memory is registered: the binding
   links no CUDA library, so hosts without one (validate/plan/render, CPU tests, the staged
   path on CPU) never load it.

   Declared here, not taken from cuda.h: a handful of stable driver-API entry points and
   enum values (CUDA 11.x/12.x ABI), so building the binding needs no CUDA toolkit. */
#include <dlfcn.h>
#include <string.h>
#include <unistd.h>

#include "pd_internal.h"

typedef int cu_result;                       /* CUresult; 0 = CUDA_SUCCESS */
typedef unsigned long long cu_ptr;           /* CUdeviceptr */
typedef unsigned long long cu_alloc_handle;  /* CUmemGenericAllocationHandle */

enum {
    PD_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    PD_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
    PD_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    PD_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    PD_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
    PD_CU_MEMORYTYPE_DEVICE = 2,
    PD_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
};

static struct {
    int loaded;                 /* 1 ok, -1 failed (reason in `why`) */
    char why[200];
    cu_result (*init)(unsigned int);
    cu_result (*pointer_get_attribute)(void *, int, cu_ptr);
    cu_result (*retain_allocation_handle)(cu_alloc_handle *, void *);
    cu_result (*release)(cu_alloc_handle);
    cu_result (*get_handle_for_address_range)(void *, cu_ptr, size_t, int, unsigned long long);
    cu_result (*get_error_string)(cu_result, const char **);
    /* cuStreamWriteValue32(_v2): a 32-bit store ordered after the stream's earlier work and
       preceded by a system-scope fence (CU_STREAM_WRITE_VALUE_DEFAULT) */
    cu_result (*stream_write_value32)(void *, cu_ptr, unsigned int, unsigned int);
} pd_cu;

static pthread_once_t pd_cu_once = PTHREAD_ONCE_INIT;

static void pd_cu_load(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(pd_cu.why, sizeof(pd_cu.why), "cannot load the CUDA driver: %s", dlerror());
        pd_cu.loaded = -1;
        return;
    }
    /* dlsym returns void *; POSIX guarantees it converts to a function pointer */
    *(void **)&pd_cu.init = dlsym(h, "cuInit");
    *(void **)&pd_cu.pointer_get_attribute = dlsym(h, "cuPointerGetAttribute");
    *(void **)&pd_cu.retain_allocation_handle = dlsym(h, "cuMemRetainAllocationHandle");
    *(void **)&pd_cu.release = dlsym(h, "cuMemRelease");
    *(void **)&pd_cu.get_handle_for_address_range = dlsym(h, "cuMemGetHandleForAddressRange");
    *(void **)&pd_cu.get_error_string = dlsym(h, "cuGetErrorString");
    *(void **)&pd_cu.stream_write_value32 = dlsym(h, "cuStreamWriteValue32_v2");
    if (!pd_cu.stream_write_value32)
        *(void **)&pd_cu.stream_write_value32 = dlsym(h, "cuStreamWriteValue32");
    if (!pd_cu.init || !pd_cu.pointer_get_attribute) {
        snprintf(pd_cu.why, sizeof(pd_cu.why), "libcuda.so.1 lacks cuInit/cuPointerGetAttribute");
        pd_cu.loaded = -1;
        return;
    }
    cu_result r = pd_cu.init(0);
    if (r) {
        snprintf(pd_cu.why, sizeof(pd_cu.why), "cuInit failed (CUresult %d)", r);
        pd_cu.loaded = -1;
        return;
    }
    pd_cu.loaded = 1;
}

static const char *pd_cu_err(cu_result r) {
    const char *s = NULL;
    if (pd_cu.get_error_string) pd_cu.get_error_string(r, &s);
    return s ? s : "unknown CUresult";
}

/* -FI_ENOSYS with the reason when the driver cannot be used. */
static int pd_cu_ready(char *errbuf, size_t errlen) {
    pthread_once(&pd_cu_once, pd_cu_load);
    if (pd_cu.loaded == 1) return 0;
    snprintf(errbuf, errlen, "%s", pd_cu.why);
    return -FI_ENOSYS;
}

/* Refuse, with the reason in errbuf (-FI_EINVAL), a range that a CUDA registration would get
   wrong: not device memory, another GPU's, managed memory, memory mapped through CUDA's
   virtual memory management (cuMemCreate/cuMemMap: PyTorch's expandable segments) which
   fi_mr_regattr's peer-memory path cannot pin, or a range running past its allocation. */
int pd_cuda_check_pointer(void *addr, size_t len, int device, char *errbuf, size_t errlen) {
    int ret = pd_cu_ready(errbuf, errlen);
    if (ret) return ret;
    cu_ptr p = (cu_ptr)(uintptr_t)addr;
    unsigned int type = 0;
    int ordinal = -1, managed = 0;
    cu_result r = pd_cu.pointer_get_attribute(&type, PD_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p);
    if (r || type != PD_CU_MEMORYTYPE_DEVICE) {
        snprintf(errbuf, errlen, "address %p is not CUDA device memory (%s)", addr,
                 r ? pd_cu_err(r) : "host memory");
        return -FI_EINVAL;
    }
    r = pd_cu.pointer_get_attribute(&managed, PD_CU_POINTER_ATTRIBUTE_IS_MANAGED, p);
    if (!r && managed) {
        snprintf(errbuf, errlen, "address %p is CUDA managed (unified) memory; register "
                 "memory from cudaMalloc", addr);
        return -FI_EINVAL;
    }
    r = pd_cu.pointer_get_attribute(&ordinal, PD_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
    if (r || ordinal != device) {
        snprintf(errbuf, errlen, "address %p is memory of GPU %d, not of GPU %d (the rank's "
                 "device)", addr, r ? -1 : ordinal, device);
        return -FI_EINVAL;
    }
    if (pd_cu.retain_allocation_handle && pd_cu.release) {
        cu_alloc_handle h = 0;
        if (pd_cu.retain_allocation_handle(&h, addr) == 0) {
            pd_cu.release(h);
            snprintf(errbuf, errlen, "address %p is CUDA virtual-memory-managed memory "
                     "(cuMemCreate/cuMemMap, e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
                     "True), which cannot be registered for RDMA; allocate the KV pool with "
                     "cudaMalloc (expandable_segments:False)", addr);
            return -FI_EINVAL;
        }
    }
    cu_ptr start = 0;
    size_t size = 0;
    if (pd_cu.pointer_get_attribute(&start, PD_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p) == 0
        && pd_cu.pointer_get_attribute(&size, PD_CU_POINTER_ATTRIBUTE_RANGE_SIZE, p) == 0
        && p + len > start + size) {
        snprintf(errbuf, errlen, "range %p + %zu runs past its CUDA allocation (%zu bytes from "
                 "0x%llx); register each allocation on its own", addr, len, size, start);
        return -FI_EINVAL;
    }
    return 0;
}

/* A dma-buf file descriptor for [addr, addr+len) (cuMemGetHandleForAddressRange wants a range
   aligned to the host page size: *offset is addr's distance from the aligned start). The
   caller closes *fd. -FI_ENOSYS when the driver lacks it (CUDA < 11.7 or no dma-buf support). */
int pd_cuda_dmabuf_fd(void *addr, size_t len, int *fd, uint64_t *offset, char *errbuf,
                      size_t errlen) {
    int ret = pd_cu_ready(errbuf, errlen);
    if (ret) return ret;
    if (!pd_cu.get_handle_for_address_range) {
        snprintf(errbuf, errlen, "the CUDA driver lacks cuMemGetHandleForAddressRange");
        return -FI_ENOSYS;
    }
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)addr, base = a & ~(page - 1);
    uintptr_t end = (a + len + page - 1) & ~(page - 1);
    cu_result r = pd_cu.get_handle_for_address_range(fd, (cu_ptr)base, end - base,
                                                     PD_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    if (r) {
        snprintf(errbuf, errlen, "cuMemGetHandleForAddressRange: %s", pd_cu_err(r));
        return -FI_ENOSYS;
    }
    *offset = (uint64_t)(a - base);
    return 0;
}

/* Enqueue on `stream` (a CUstream, 0 = the legacy default) the store of `value` into the 32-bit
   word at device address `dptr`, after everything the stream enqueued before it and behind a
   system-scope memory fence: a host thread that sees the value also sees every byte the
   stream's earlier kernels wrote to host-mapped memory (the prefill's progress word and the KV
   it announces; two ordinary kernels give no such order to a host reader). Captured into a
   CUDA graph like any stream work. 0, or a negative errno with the driver's answer. */
int pd_cuda_stream_write_u32(uint64_t stream, uint64_t dptr, uint32_t value, char *errbuf,
                             size_t errlen) {
    int ret = pd_cu_ready(errbuf, errlen);
    if (ret) return ret;
    if (!pd_cu.stream_write_value32) {
        snprintf(errbuf, errlen, "the CUDA driver lacks cuStreamWriteValue32");
        return -FI_ENOSYS;
    }
    cu_result r = pd_cu.stream_write_value32((void *)(uintptr_t)stream, (cu_ptr)dptr, value, 0);
    if (r) {
        snprintf(errbuf, errlen, "cuStreamWriteValue32: %s", pd_cu_err(r));
        return -FI_EIO;
    }
    return 0;
}

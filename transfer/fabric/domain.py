"""One fabric and domain as Python sees it, and the questions asked of a domain before any
endpoint exists: which providers work here, what the binding was built against, whether a
pointer is registrable CUDA memory."""

from __future__ import annotations

import os

from .errors import FabricError, GpuMemoryError
from .native import ERRBUF, c_str, check, ffi, lib


def available_providers() -> list[str]:
    """Names of providers that offer RDM endpoints with RMA writes here (e.g. shm, tcp;ofi_rxm)."""
    found: list[str] = []
    for prov in ("shm", "tcp;ofi_rxm", "efa", "verbs;ofi_rxm", "sockets", "udp;ofi_rxd"):
        info = ffi.new("struct pd_info *")
        out = ffi.new("pd_dom **")
        err = ffi.new("char[]", ERRBUF)
        if lib.pd_domain_open(out, prov.encode(), ffi.NULL, ffi.NULL, ffi.NULL, 0, 0, info,
                               err, ERRBUF) == 0:
            lib.pd_domain_release(out[0])
            found.append(prov)
    return found


class Domain:
    """One libfabric fabric + domain as Python sees it: the fi_info the domain was opened with,
    and the counter of requested MR keys, which must be unique per DOMAIN (shared by lanes).

    The C domain is reference counted: every endpoint and registration on it holds one, so it
    closes after the last of them; `handle` is only used to open the first endpoint."""

    def __init__(self, provider: str, domain: str | None, node: str | None,
                 service: str | None, remote_counter: bool, hmem: bool) -> None:
        self.provider_arg = provider
        self.args = (domain, node, service)
        self.context = (f"provider={provider!r} domain={domain!r} node={node!r} "
                        f"service={service!r}; see `fi_info -p '{provider}'`")
        self.info = ffi.new("struct pd_info *")
        self.next_key = 1
        self._offers_hmem: bool | None = True if hmem else None
        self._cuda_mr: tuple[bool, str] | None = None
        out = ffi.new("pd_dom **")
        err = ffi.new("char[]", ERRBUF)
        ret = lib.pd_domain_open(out, provider.encode(), c_str(domain), c_str(node), c_str(service),
                                  int(remote_counter), int(hmem), self.info, err, ERRBUF)
        if ret and hmem:
            why = ffi.string(err).decode(errors="replace")
            raise GpuMemoryError("open endpoint", ret, f"transfer.gpu_memory=direct: provider "
                                 f"{provider!r} does not offer FI_HMEM (registration of GPU "
                                 f"memory) here ({why}); use transfer.gpu_memory=staged",
                                 self.context)
        check(ret, "open endpoint", self.context, err)
        self.handle = out[0]

    def offers_hmem(self) -> bool:
        """Asked for the domain this one IS (its name), not the one requested (maybe None)."""
        if self._offers_hmem is None:
            _, node, service = self.args
            ret = lib.pd_offers_hmem(self.provider_arg.encode(), self.info.domain, c_str(node),
                                      c_str(service))
            self._offers_hmem = ret == 1
        return self._offers_hmem



def build_features() -> dict[str, bool]:
    """What the binding was compiled against: `dmabuf` (headers with FI_MR_DMABUF, libfabric
    >= 1.20: CUDA memory is registered as a dma-buf where the driver offers one) and
    `cuda_api_permitted` (FI_OPT_CUDA_API_PERMITTED, >= 1.18: set to false on EFA)."""
    return {"dmabuf": bool(lib.pd_have_dmabuf()),
            "cuda_api_permitted": bool(lib.pd_have_cuda_api_permitted())}



def check_cuda_pointer(addr: int, length: int, device: int) -> None:
    """GpuMemoryError unless [addr, addr+length) is registrable memory of CUDA device `device`
    (device memory, that GPU's, one cudaMalloc allocation, not VMM/expandable segments). Loads
    the CUDA driver (libcuda.so.1) on first use; `register(iface="cuda")` runs the same check."""
    err = ffi.new("char[]", ERRBUF)
    ret = lib.pd_cuda_check_pointer(ffi.cast("void *", addr), length, device, err, ERRBUF)
    if ret:
        raise GpuMemoryError("check CUDA pointer", ret, "transfer.gpu_memory=direct: " +
                             ffi.string(err).decode(errors="replace"),
                             f"addr={addr:#x} length={length} device={device}")


def cuda_dmabuf_support(addr: int, length: int) -> tuple[bool, str]:
    """Whether the CUDA driver hands out a dma-buf for device memory [addr, addr+length)
    (cuMemGetHandleForAddressRange; the open kernel modules do): (True, "") or (False, the
    driver's answer). Where it does, a libfabric registration asks with FI_MR_DMABUF (mr.c)."""
    err = ffi.new("char[]", ERRBUF)
    fd, offset = ffi.new("int *", -1), ffi.new("uint64_t *")
    ret = lib.pd_cuda_dmabuf_fd(ffi.cast("void *", addr), length, fd, offset, err, ERRBUF)
    if ret:
        return False, ffi.string(err).decode(errors="replace")
    os.close(fd[0])
    return True, ""


def cuda_stream_write_u32(stream: int, dptr: int, value: int) -> None:
    """Enqueue on CUDA stream `stream` a fenced store of `value` into the 32-bit word at device
    address `dptr` (cuStreamWriteValue32; captured into CUDA graphs). A host reader that sees
    the value sees everything the stream wrote before it. FabricError naming the driver's
    answer where it cannot."""
    err = ffi.new("char[]", ERRBUF)
    ret = lib.pd_cuda_stream_write_u32(stream, dptr, value, err, ERRBUF)
    if ret:
        raise FabricError("progress word store", ret, ffi.string(err).decode(
            errors="replace"), f"stream={stream:#x} dptr={dptr:#x}")

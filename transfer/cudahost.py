"""Host memory the GPU addresses directly (CUDA "mapped" pinned memory), through libcuda.

Why: the reference engine's KV pages and its prefill progress word stay in host memory that the
messenger registers with the fabric as it does on a CPU (no FI_HMEM, no staged copies), while
the GPU reads and writes the same bytes through a device pointer: FlashInfer's decode reads the
pages the messenger wrote, and a kernel at the end of each layer writes the progress word the
messenger thread polls. The driver is loaded at run time with ctypes (`libcuda.so.1`); nothing
here is imported on a machine without a GPU, and `transfer/` stays CUDA-free at import.

`register_mapped(addr, nbytes)` page-locks a range with CU_MEMHOSTREGISTER_DEVICEMAP and returns
its device pointer; `device_alias(host_tensor)` is a CUDA torch tensor over the same memory
(zero-copy, through `__cuda_array_interface__`). The caller keeps the host memory alive as long
as the alias is used and calls `unregister` before freeing it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712

_lock = threading.Lock()
_lib: Any = None


class CudaHostError(RuntimeError):
    """A driver call failed; the message names the call and the driver's reason."""


def libcuda() -> Any:
    """The CUDA driver library (loaded once; CudaHostError where there is none)."""
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaHostError(f"cluster.device=cuda: no CUDA driver on this node "
                                    f"(libcuda.so.1: {exc})") from None
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                                 ctypes.c_uint]
            lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                         ctypes.c_void_p, ctypes.c_uint]
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _lib = lib
    return _lib


def _check(ret: int, call: str) -> None:
    if ret:
        msg = ctypes.c_char_p()
        libcuda().cuGetErrorString(ret, ctypes.byref(msg))
        reason = msg.value.decode() if msg.value else f"error {ret}"
        raise CudaHostError(f"{call}: {reason}")


def _ensure_context() -> None:
    """The driver calls need the device's primary context current on this thread; torch's
    runtime makes it so on its first CUDA call."""
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")


def register_mapped(addr: int, nbytes: int) -> int:
    """Page-lock [addr, addr+nbytes) for every context and map it into the device's address
    space; returns the device pointer (with unified addressing, usually `addr` itself)."""
    _ensure_context()
    lib = libcuda()
    ret = lib.cuMemHostRegister_v2(ctypes.c_void_p(addr), nbytes,
                                   CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)
    if ret != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        _check(ret, f"cuMemHostRegister({nbytes} B)")
    dptr = ctypes.c_uint64()
    _check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(addr), 0),
           "cuMemHostGetDevicePointer")
    return int(dptr.value)


def unregister(addr: int) -> None:
    _check(libcuda().cuMemHostUnregister(ctypes.c_void_p(addr)), "cuMemHostUnregister")


class _DeviceBytes:
    """A device byte range as torch's `as_tensor` reads it (CUDA array interface v3)."""

    def __init__(self, dptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (dptr, False), "version": 3, "strides": None}


def device_alias(host: Any) -> Any:
    """A CUDA tensor of `host`'s dtype and shape over `host`'s memory (contiguous CPU tensor),
    which it registers as mapped pinned memory."""
    import torch

    if host.device.type != "cpu" or not host.is_contiguous():
        raise ValueError("device_alias: expected a contiguous CPU tensor")
    nbytes = host.numel() * host.element_size()
    dptr = register_mapped(host.data_ptr(), nbytes)
    raw = torch.as_tensor(_DeviceBytes(dptr, nbytes), device="cuda")
    return raw.view(host.dtype).view(host.shape)

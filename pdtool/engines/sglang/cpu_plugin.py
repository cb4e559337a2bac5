"""The `sglang.srt.plugins` entry point `pdtool-cpu`: SGLang's own transfer backends on its CPU
engine, so that `transfer.backend=mooncake|nixl` serve where pdtool's backend does.

It acts only in a process where SGLang's CPU engine is on (`SGLANG_USE_CPU_ENGINE=1`, set by
`cpu.environment`), and only once SGLang asks for a backend's classes (an AROUND hook on
`disaggregation.utils.get_kv_class`): nothing is imported before. Two things in SGLang 0.5.23
assume a GPU whatever the device (paths under `sglang/srt/disaggregation/`):

* mooncake's sender says `supports_host_tensor_indices = True` (`mooncake/conn.py:3312`), so
  the prefill's `_send_kv_chunk` copies the page ids into pinned memory and records a
  `torch.cuda.Event` (`prefill.py:1746`), which fails without a driver. On CPU the ids are
  already host memory: the answer is False there, as pdtool's own sender answers for host pools.
* nixl labels every KV region "VRAM" (`nixl/conn.py:206,225,862,865,979,2023` and its
  defaults), which UCX without CUDA refuses. The NIXL agent's four descriptor calls get "DRAM"
  for "VRAM" instead: on the CPU engine every pool is host memory.

And one in its DeepSeek model (MLA): `AttentionBackendRegistry` has no handler for
`torch_native`, the CPU's backend, and falls back to triton's (`models/deepseek_common/
attention_backend_handler.py:55`), which sends a prefill down the MHA path, whose shapes
torch_native's extend does not take (the server failed its first prefill: "Expected size for
first two dimensions of batch2 tensor to be: [4, 32] but got: [4, 48]"; that path also relies
on `save_kv_cache=False`, which torch_native ignores). Under `torch_native` every batch takes
the absorbed MLA path, which writes the latent through the backend as decode reads it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
MLA_HANDLER = ("sglang.srt.models.deepseek_common.attention_backend_handler."
               "AttentionBackendRegistry.get_handler")
#: nixl_agent methods that take a memory type (NIXL 1.5.1's python API)
NIXL_MEM_TYPE_CALLS = ("register_memory", "prep_xfer_dlist", "get_xfer_descs", "get_reg_descs")


def _host_memory(fn: Any) -> Any:
    """`fn` (a nixl_agent method with a `mem_type` parameter) with "VRAM" read as "DRAM"."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        if bound.arguments.get("mem_type") == "VRAM":
            bound.arguments["mem_type"] = "DRAM"
        return fn(*bound.args, **bound.kwargs)

    wrapper.pdtool_host_memory = True  # type: ignore[attr-defined]
    return wrapper


def _nixl_on_host() -> None:
    from nixl._api import nixl_agent

    for name in NIXL_MEM_TYPE_CALLS:
        fn = getattr(nixl_agent, name)
        if not getattr(fn, "pdtool_host_memory", False):
            setattr(nixl_agent, name, _host_memory(fn))


def get_kv_class_hook(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """AROUND get_kv_class: SGLang's class, made to run on the CPU engine."""
    cls = original(transfer_backend, class_type)
    from sglang.srt.utils.common import is_cpu

    if cls is None or not is_cpu():
        return cls
    backend = getattr(transfer_backend, "value", transfer_backend)
    if backend == "mooncake" and getattr(cls, "supports_host_tensor_indices", False):
        cls.supports_host_tensor_indices = False
        logger.info("pdtool-cpu: %s sends host page ids as they are (CPU engine)",
                    cls.__name__)
    elif backend == "nixl":
        _nixl_on_host()
    return cls


def _absorbed_mla(attn: Any, forward_batch: Any) -> Any:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )

    return _dispatch_mla_subtype(attn, forward_batch)


def mla_handler_hook(original: Any, registry: Any, backend_name: str) -> Any:
    """AROUND AttentionBackendRegistry.get_handler: the absorbed MLA path for torch_native
    (which has no handler of its own), SGLang's answer for every other backend."""
    if backend_name == "torch_native" and backend_name not in registry._handlers:
        return _absorbed_mla
    return original(registry, backend_name)


def register() -> None:
    """Entry point (`sglang.srt.plugins`): idempotent; SGLang applies the hook afterwards."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":  # as utils/common.py is_cpu()
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in ((GET_KV_CLASS, get_kv_class_hook), (MLA_HANDLER, mla_handler_hook)):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, HookType.AROUND)

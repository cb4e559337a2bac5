"""The two `sgl_kernel` CPU ops SGLang 0.5.23 calls when it serves on CPU, in plain torch/numpy.

SGLang imports `sgl_kernel` at module level on its CPU path
(`kernels/ops/kvcache/cache_move.py:9`, `srt/mem_cache/allocation.py:45`), and PyPI has no CPU
build of it. pdtool puts this folder first on the `PYTHONPATH` of the SGLang processes it starts
on `cluster.device=cpu` (never elsewhere: on a GPU node the real package is used). Any other
name is a function that raises, naming the op, so a path that would need a real kernel fails
loudly instead of computing something else.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, width: int) -> None:
    """`req_to_token[req, start:end] = out_cache_loc[...]`, one request after the other (the
    triton kernel `assign_req_to_token_pool` of allocation.py, which this replaces)."""
    del width  # the row width is req_to_token's own
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                               end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[at:at + n]
        at += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every buffer (base address, row bytes), copy rows `src_loc` onto rows `tgt_loc`
    (`copy_all_layer_kv_cache_tiled` of cache_move.py). The source rows are read in full
    before any is written, so an overlapping move is safe, as the kernel's is."""
    if not len(tgt_loc):
        return
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        ptr = ctypes.cast(ctypes.c_void_p(base), ctypes.POINTER(ctypes.c_uint8))
        view = np.ctypeslib.as_array(ptr, shape=(rows, int(stride)))
        view[tgt] = view[src]


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: this CPU op is not part of pdtool's stand-in for sgl_kernel "
            "(pdtool/engines/sglang/shim); SGLang took a path pdtool has not run on CPU")

    missing.__name__ = name
    return missing

"""`transfer.gpu_memory`: whether the chosen path can move KV held in GPU memory.

The rule itself is `transfer.gpu_memory.gpu_memory_problem` (shared with the workers, which
decide `auto` from the node's probe); here it becomes a finding naming the key. The reference
engine keeps its KV in host memory, so only `auto` means anything there.
"""

from __future__ import annotations

from pdtool.adapters import adapter
from pdtool.rules.finding import Finding, error
from pdtool.schema import Config
from transfer.gpu_memory import KEY, gpu_memory_problem


def check_gpu_memory(cfg: Config) -> list[Finding]:
    mode = cfg.transfer.gpu_memory
    if not adapter(cfg).kv_on_gpu:
        if mode == "auto":
            return []
        return [error(KEY, f"{KEY}={mode}: the {cfg.engine.kind} engine keeps its KV in host "
                           "memory, there is no GPU memory to register or stage",
                      f"leave {KEY}=auto (or use engine=sglang)")]
    backend = cfg.transfer.backend
    if backend != "pdtool" and mode != "auto":
        return [error(KEY, f"{KEY}={mode}: transfer.backend={backend} is SGLang's own backend, "
                           "which registers the GPU memory itself",
                      f"leave {KEY}=auto with transfer.backend={backend}, or use "
                      "transfer.backend=pdtool")]
    problem = gpu_memory_problem(mode, cfg.transfer.provider)
    if problem is None:
        return []
    return [error(KEY, problem, f"use {KEY}=staged (or auto)")]


ALL = (check_gpu_memory,)

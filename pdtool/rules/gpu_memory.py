"""`transfer.gpu_memory`: whether the chosen path can move KV held in GPU memory.

The rule itself is `transfer.gpu_memory.gpu_memory_problem` (shared with the workers, which
decide `auto` from the node's probe); here it becomes a finding naming the key. The reference
engine keeps its KV in host memory, so only `auto` means anything there.
"""

from __future__ import annotations

from pdtool.rules.finding import Finding, error
from pdtool.schema import Config
from transfer.gpu_memory import KEY, choose_gpu_memory, gpu_memory_problem

#: why the SGLang backend refuses the staged path (transfer/staging.py is not wired into it)
NO_STAGED_SGLANG = ("the SGLang backend registers SGLang's GPU pools directly and has no "
                    "staged path yet (transfer/staging.py is not wired into it)")


def check_gpu_memory(cfg: Config) -> list[Finding]:
    mode = cfg.transfer.gpu_memory
    if cfg.engine.kind == "reference":
        if mode == "auto":
            return []
        return [error(KEY, f"{KEY}={mode}: the reference engine keeps its KV in host memory, "
                           "there is no GPU memory to register or stage",
                      f"leave {KEY}=auto (or use engine=sglang)")]
    backend = cfg.transfer.backend
    if backend != "pdtool" and mode != "auto":
        return [error(KEY, f"{KEY}={mode}: transfer.backend={backend} is SGLang's own backend, "
                           "which registers the GPU memory itself",
                      f"leave {KEY}=auto with transfer.backend={backend}, or use "
                      "transfer.backend=pdtool")]
    problem = gpu_memory_problem(mode, cfg.transfer.provider)
    if problem is not None:
        return [error(KEY, problem, f"use {KEY}=staged (or auto)")]
    return []


def check_sglang_staged(cfg: Config) -> list[Finding]:
    """Once the provider fits the NICs (stage 3): pdtool's SGLang backend on GPUs cannot take
    the staged path, so a mode that resolves to it is refused before anything starts."""
    if cfg.engine.kind != "sglang" or cfg.transfer.backend != "pdtool":
        return []
    mode = cfg.transfer.gpu_memory
    if cfg.cluster.device == "cuda" and \
            choose_gpu_memory(mode, cfg.transfer.provider).path == "staged":
        return [error(KEY, f"{KEY}={mode} with {cfg.transfer.provider} means staged: "
                           f"{NO_STAGED_SGLANG}",
                      f"use a provider whose libfabric registers CUDA memory (efa, "
                      f"verbs;ofi_rxm) with {KEY}=auto or direct, or transfer.backend=mooncake")]
    return []


ALL = (check_gpu_memory,)
PLACED = (check_sglang_staged,)

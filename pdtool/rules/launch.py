"""Launcher settings that must agree with the placement: what a Slurm job asks for.

The job asks `launcher.gpus_per_node` GPUs per node (device=cuda) and every step sees all of
them, so the plan's GPU ids are CUDA ordinals: fewer GPUs than the highest id a node uses
would leave a rank without its device. A job that does not take whole nodes
(`launcher.exclusive=false`) gets only the memory it asks for, so it must ask
(`launcher.mem`); Slurm's own size syntax is checked here so sbatch does not refuse it later.
The KV dtypes an SGLang launch line can carry are checked here too.
"""

from __future__ import annotations

import re

from pdtool.launch.sglang import SGLANG_KV_DTYPES
from pdtool.plan import placements
from pdtool.rules.finding import Finding, error
from pdtool.schema import Config

_MEM = re.compile(r"^[0-9]+[KMGT]?$")


def check_slurm_gpus(cfg: Config) -> list[Finding]:
    """launcher.gpus_per_node covers every GPU id the plan uses on a node."""
    lc = cfg.launcher
    if lc.kind != "slurm" or cfg.cluster.device != "cuda":
        return []
    used = max((gpu + 1 for ranks in placements(cfg).values() for _, _, gpu in ranks),
               default=0)
    if lc.gpus_per_node < used:
        return [error(
            "launcher.gpus_per_node",
            f"the job would ask {lc.gpus_per_node} GPU(s) per node, but the plan places ranks "
            f"on GPUs 0..{used - 1} of a node",
            f"set launcher.gpus_per_node={used} (or more; cluster.gpus_per_node="
            f"{cfg.cluster.gpus_per_node})",
        )]
    if lc.gpus_per_node > cfg.cluster.gpus_per_node:
        return [error(
            "launcher.gpus_per_node",
            f"{lc.gpus_per_node} GPUs per node asked, the cluster's nodes have "
            f"{cfg.cluster.gpus_per_node}: Slurm would never start the job",
            f"set launcher.gpus_per_node to at most {cfg.cluster.gpus_per_node}",
        )]
    return []


def check_slurm_memory(cfg: Config) -> list[Finding]:
    """launcher.mem in Slurm's syntax, and present when the nodes are shared."""
    lc = cfg.launcher
    if lc.kind != "slurm":
        return []
    if lc.mem and not _MEM.match(lc.mem):
        return [error("launcher.mem", f"{lc.mem!r} is not a Slurm memory size",
                      "write a number with an optional K, M, G or T suffix, e.g. 480G")]
    if not lc.exclusive and not lc.mem:
        return [error(
            "launcher.mem",
            "launcher.exclusive=false: the job shares its nodes and gets only the memory it "
            "asks for, which is none here",
            "set launcher.mem to what the processes of one node need (e.g. 480G), or "
            "launcher.exclusive=true for whole nodes",
        )]
    return []


#: KV dtypes an SGLang line can carry: `auto` (the model's) or one --kv-cache-dtype renders
SGLANG_CACHE_DTYPES = ("auto", *SGLANG_KV_DTYPES)


def check_sglang_kv_dtype(cfg: Config) -> list[Finding]:
    """engine=sglang: only KV dtypes SGLang's --kv-cache-dtype has (no fp16/fp32 cache)."""
    if cfg.engine.kind != "sglang":
        return []
    out = []
    for r in ("prefill", "decode"):
        dt = getattr(cfg, r).kv_dtype
        if dt not in SGLANG_CACHE_DTYPES:
            out.append(error(f"{r}.kv_dtype",
                             f"SGLang 0.5.23 has no {dt} KV cache (--kv-cache-dtype takes "
                             f"{', '.join(SGLANG_CACHE_DTYPES)} here)",
                             f"set {r}.kv_dtype=auto (the model's dtype) or bf16"))
    return out


ALL = (check_slurm_gpus, check_slurm_memory, check_sglang_kv_dtype)

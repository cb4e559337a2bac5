"""GPU memory fit per rank: weights (sharded as the parallelism says) + a usable KV budget.

The arithmetic lives in `pdtool.memory` (the plan shows the same numbers); this module turns
it into findings. Weights that leave no KV room are an error; a KV budget smaller than one
chunk is an error; one that cannot hold a single full-context request is a warning. With
engine=sglang on GPUs, a mem_fraction that leaves less free than SGLang itself would keep
(activations, CUDA graphs, parallel slack, DeepEP buffers: `pdtool.memory.sglang_headroom`) is
a warning with the figures, and no fix suggests raising mem_fraction past that point.
"""

from __future__ import annotations

from pdtool.adapters import adapter
from pdtool.memory import GIB, Headroom, deployment_memory, human_bytes
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import ROLES, Config, attn_tp, role

#: the largest mem_fraction a fix may suggest where no engine reserve is modelled
MAX_FRACTION = 0.95


def check_headroom(cfg: Config, r: str, h: Headroom) -> list[Finding]:
    rc, gpu = role(cfg, r), cfg.cluster.gpu_memory_gb
    top = h.max_fraction(gpu)
    if rc.mem_fraction <= top:
        return []
    parts = [f"activations {h.activations_mb / 1024:.1f}", f"CUDA graphs {h.graphs_mb / 1024:.1f}",
             f"parallel slack {h.parallel_mb / 1024:.1f}"]
    parts += [f"DeepEP buffers {h.deepep_mb / 1024:.1f}"] if h.deepep_mb else []
    floor = (f", at least {h.floor_mb / 1024:.0f} GiB on a GPU this large"
             if h.floor_mb else "")
    return [warning(
        f"{r}.mem_fraction",
        f"{rc.mem_fraction} of {gpu:g} GiB leaves {gpu * (1 - rc.mem_fraction):.1f} GiB outside "
        f"weights and KV; SGLang 0.5.23 keeps {h.total_mb / 1024:.1f} GiB there when it sizes "
        f"itself ({', '.join(parts)} GiB{floor}): expect out-of-memory at CUDA graph capture "
        f"or on a full batch",
        f"set {r}.mem_fraction={top} or lower")]


def check_memory(cfg: Config) -> list[Finding]:
    out: list[Finding] = []
    m, cl = cfg.model, cfg.cluster
    for r, mem in zip(ROLES, deployment_memory(cfg), strict=True):
        rc = role(cfg, r)
        avail = cl.gpu_memory_gb * rc.mem_fraction
        headroom = adapter(cfg).headroom(cfg, r)
        top = headroom.max_fraction(cl.gpu_memory_gb) if headroom else MAX_FRACTION
        # raising the fraction helps only while weights + this need fit under the top
        can_raise = mem.weights_gb + mem.kv_bytes_per_token / GIB * (
            rc.chunked_prefill_size if r == "prefill" else rc.page_size) < cl.gpu_memory_gb * top
        raise_it = f", or raise {r}.mem_fraction (up to {top})" if can_raise else ""
        if headroom:
            out += check_headroom(cfg, r, headroom)
        if mem.kv_budget_gb <= 0:
            split = (
                f"attention/dense {mem.dense_weights_gb:.1f} GiB over attention TP {attn_tp(rc)}"
            )
            if m.expert_params_b > 0:
                split += f" + experts {mem.expert_weights_gb:.1f} GiB over {r}.tp={rc.tp}"
            out.append(
                error(
                    f"{r}.mem_fraction",
                    f"weights need {mem.weights_gb:.1f} GiB per GPU ({split}); "
                    f"{r}.mem_fraction={rc.mem_fraction} x cluster.gpu_memory_gb="
                    f"{cl.gpu_memory_gb:g} = {avail:.1f} GiB leaves no room for the KV cache",
                    f"shard over more GPUs ({r}.tp) or use GPUs with more memory "
                    f"(cluster=...){raise_it}",
                )
            )
            continue
        need = rc.chunked_prefill_size if r == "prefill" else rc.page_size
        per_tok = human_bytes(mem.kv_bytes_per_token)
        if mem.kv_tokens < need:
            out.append(
                error(
                    f"{r}.mem_fraction",
                    f"the KV budget of {mem.kv_budget_gb:.2f} GiB per GPU holds "
                    f"{mem.kv_tokens} tokens at {per_tok}/token, fewer than one "
                    + ("prefill chunk" if r == "prefill" else "page")
                    + f" ({need} tokens)",
                    f"shard over more GPUs ({r}.tp){raise_it}",
                )
            )
        elif mem.kv_tokens < m.context_length:
            out.append(
                warning(
                    f"{r}.mem_fraction",
                    f"the KV budget of {mem.kv_budget_gb:.2f} GiB per GPU holds "
                    f"{mem.kv_tokens} tokens at {per_tok}/token, less than one request at "
                    f"model.context_length={m.context_length}",
                    f"lower model.context_length to what you serve, shard over more GPUs "
                    f"({r}.tp){raise_it}",
                )
            )
    return out


ALL = (check_memory,)

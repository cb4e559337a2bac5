"""GPU memory fit per rank: weights (sharded as the parallelism says) + a usable KV budget.

The arithmetic lives in `pdtool.memory` (the plan shows the same numbers); this module turns
it into findings. Weights that leave no KV room are an error; a KV budget smaller than one
chunk is an error; one that cannot hold a single full-context request is a warning.
"""

from __future__ import annotations

from pdtool.memory import deployment_memory, human_bytes
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import ROLES, Config, attn_tp, role


def check_memory(cfg: Config) -> list[Finding]:
    out: list[Finding] = []
    m, cl = cfg.model, cfg.cluster
    for r, mem in zip(ROLES, deployment_memory(cfg), strict=True):
        rc = role(cfg, r)
        avail = cl.gpu_memory_gb * rc.mem_fraction
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
                    f"shard over more GPUs ({r}.tp), use GPUs with more memory (cluster=...), "
                    f"or raise {r}.mem_fraction",
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
                    f"raise {r}.mem_fraction or shard over more GPUs ({r}.tp)",
                )
            )
        elif mem.kv_tokens < m.context_length:
            out.append(
                warning(
                    f"{r}.mem_fraction",
                    f"the KV budget of {mem.kv_budget_gb:.2f} GiB per GPU holds "
                    f"{mem.kv_tokens} tokens at {per_tok}/token, less than one request at "
                    f"model.context_length={m.context_length}",
                    f"raise {r}.mem_fraction, shard over more GPUs ({r}.tp), or lower "
                    "model.context_length to what you serve",
                )
            )
    return out


ALL = (check_memory,)

"""GPU memory fit: weights per rank + the KV budget left over, and KV bytes per token/page.

Weights: a MoE model's routed experts are sharded over every GPU of the instance's TP group
(SGLang shards experts over `--tp` even with DP attention); everything else (attention,
dense/shared MLPs, embeddings) is sharded over the attention TP group and, with DP attention,
replicated in each of the `dp` groups. `mem_fraction` is SGLang's `--mem-fraction-static`:
the share of GPU memory for weights + KV pool, so KV budget = memory x fraction - weights.

Pure arithmetic on the typed config, no torch; the one engine fact here is an engine's own
KV cap (`EngineAdapter.kv_token_cap`), so the plan shows what it allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdtool.adapters import adapter
from pdtool.schema import (
    DTYPE_BYTES,
    ROLES,
    ClusterConfig,
    Config,
    ModelConfig,
    RoleConfig,
    attn_tp,
    dims,
    kv_dtype,
    kv_head_width,
    kv_heads,
    kv_parts,
    role,
)

GIB = 1024**3


@dataclass(frozen=True)
class RoleMemory:
    """Memory of one GPU rank of a role (all ranks of a role are alike)."""

    role: str
    gpu_memory_gb: float
    mem_fraction: float
    dense_weights_gb: float  # attention/dense/embeddings share on this rank
    expert_weights_gb: float  # routed-expert share on this rank
    weights_gb: float
    kv_budget_gb: float  # may be negative: weights do not fit
    kv_dtype: str
    kv_heads_per_rank: int
    kv_bytes_per_token: int  # on this rank, all layers
    kv_bytes_per_page: int  # on this rank, one page of all layers
    kv_bytes_per_token_model: int  # whole model (all heads, all layers), before sharding
    kv_tokens: int  # tokens the KV cache holds (0 if it does not fit)
    kv_cap_tokens: int = 0  # the engine's own ceiling on kv_tokens (0: the budget decides)

    @property
    def capped(self) -> bool:
        """The engine's ceiling, not the budget, sets kv_tokens."""
        return 0 < self.kv_cap_tokens == self.kv_tokens

    @property
    def kv_pages(self) -> int:
        """Whole pages the KV tokens fill: what a reference rank allocates."""
        if not self.kv_bytes_per_page:
            return 0
        return self.kv_tokens * self.kv_bytes_per_token // self.kv_bytes_per_page


def kv_heads_per_rank(model: ModelConfig, rc: RoleConfig) -> int:
    """KV heads one attention rank stores (replicated heads count once per rank)."""
    return dims(rc, model).heads_per_rank


def kv_bytes_per_token(model: ModelConfig, rc: RoleConfig, *, per_rank: bool = True) -> int:
    """KV-cache bytes for one token over all layers, on one rank (or for the whole model)."""
    heads = kv_heads_per_rank(model, rc) if per_rank else kv_heads(model)
    width = kv_head_width(model) * kv_parts(model)
    return model.num_layers * heads * width * DTYPE_BYTES[kv_dtype(model, rc)]


def weights_bytes_per_rank(model: ModelConfig, rc: RoleConfig) -> tuple[float, float]:
    """(dense, expert) weight bytes held by one rank."""
    b = DTYPE_BYTES[model.dtype]
    experts = max(model.expert_params_b, 0.0) * 1e9 * b
    dense = max(model.num_params_b - model.expert_params_b, 0.0) * 1e9 * b
    return dense / max(attn_tp(rc), 1), experts / max(rc.tp, 1)


def role_memory(
    role: str, model: ModelConfig, cluster: ClusterConfig, rc: RoleConfig,
    kv_cap_tokens: int = 0,
) -> RoleMemory:
    dense, experts = weights_bytes_per_rank(model, rc)
    weights = dense + experts
    budget = cluster.gpu_memory_gb * GIB * rc.mem_fraction - weights
    per_tok = kv_bytes_per_token(model, rc)
    tokens = int(budget // per_tok) if budget > 0 and per_tok > 0 else 0
    return RoleMemory(
        role=role,
        gpu_memory_gb=cluster.gpu_memory_gb,
        mem_fraction=rc.mem_fraction,
        dense_weights_gb=round(dense / GIB, 3),
        expert_weights_gb=round(experts / GIB, 3),
        weights_gb=round(weights / GIB, 3),
        kv_budget_gb=round(budget / GIB, 3),
        kv_dtype=kv_dtype(model, rc),
        kv_heads_per_rank=kv_heads_per_rank(model, rc),
        kv_bytes_per_token=per_tok,
        kv_bytes_per_page=per_tok * rc.page_size,
        kv_bytes_per_token_model=kv_bytes_per_token(model, rc, per_rank=False),
        kv_tokens=min(tokens, kv_cap_tokens) if kv_cap_tokens else tokens,
        kv_cap_tokens=kv_cap_tokens,
    )


def deployment_memory(cfg: Config) -> tuple[RoleMemory, ...]:
    """Both roles' memory as their engine runs it (plan, validate and the engine read this):
    an engine may cap a rank's KV whatever its budget (the reference engine's MAX_KV_PAGES)."""
    out = []
    for r in ROLES:
        rc = role(cfg, r)
        out.append(role_memory(r, cfg.model, cfg.cluster, rc, adapter(cfg).kv_token_cap(rc)))
    return tuple(out)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- what SGLang keeps outside --mem-fraction-static ----------------------------------------
#
# SGLang 0.5.23 picks --mem-fraction-static itself when none is given
# (`srt/arg_groups/memory_hook.py`): it reserves activations, CUDA graph buffers, parallel
# slack and DeepEP buffers, and keeps the rest for weights and KV. pdtool always passes the
# role's mem_fraction, so that reserve is what a fraction must leave free; the constants below
# are SGLang's own (MiB), read from that file.

#: decode CUDA graph batch size SGLang picks by GPU memory (MiB, below) and TP: (< 4, >= 4)
_GRAPH_MAX_BS = ((20 * 1024, (8, 8)), (35 * 1024, (48, 160)), (60 * 1024, (32, 160)),
                 (160 * 1024, (256, 512)))
_GRAPH_MAX_BS_LARGEST = 512  # B200, MI300
_RESERVE_BASE_MB = 512  # attention metadata and activation slack
_ACTIVATION_MB_PER_TOKEN = 1.5
_MIN_ACTIVATION_TOKENS = 2048
_GRAPH_MB_PER_SEQ = 2
_DP_ATTENTION_GRAPH_MB_PER_SEQ = 3  # x dp; 1.5 more above a batch of 300
_LARGE_GPU_MB, _LARGE_GPU_FLOOR_MB = 60 * 1024, 10 * 1024
_DEEPEP_MB = 2 * 1024  # DeepEP all-to-all buffers in the decode graph


@dataclass(frozen=True)
class Headroom:
    """Memory SGLang 0.5.23 would keep free on one GPU of a role (MiB), by what needs it."""

    activations_mb: float
    graphs_mb: float
    parallel_mb: float
    deepep_mb: float
    floor_mb: float  # the least SGLang keeps on a large GPU, whatever the sum

    @property
    def total_mb(self) -> float:
        parts = _RESERVE_BASE_MB + self.activations_mb + self.graphs_mb + self.parallel_mb
        return max(parts, self.floor_mb) + self.deepep_mb

    def max_fraction(self, gpu_memory_gb: float) -> float:
        """The largest mem_fraction that leaves this reserve free (SGLang's rounding)."""
        gpu_mb = gpu_memory_gb * 1024
        return round((gpu_mb - self.total_mb) / gpu_mb, 3)


def uses_deepep(args: list[str]) -> bool:
    """`--moe-a2a-backend deepep` among SGLang launch arguments."""
    args = [str(a) for a in args]
    return any(a == "--moe-a2a-backend=deepep"
               or (a == "--moe-a2a-backend" and args[i + 1:i + 2] == ["deepep"])
               for i, a in enumerate(args))


def sglang_headroom(cfg: Config, name: str) -> Headroom:
    """What SGLang 0.5.23 reserves outside weights and KV on one GPU of role `name`."""
    rc = role(cfg, name)
    gpu_mb = cfg.cluster.gpu_memory_gb * 1024
    max_bs = next((bs[rc.tp >= 4] for limit, bs in _GRAPH_MAX_BS if gpu_mb < limit),
                  _GRAPH_MAX_BS_LARGEST)
    if rc.max_running_requests:
        max_bs = min(max_bs, rc.max_running_requests)
    if name == "decode":
        tokens = max(rc.max_running_requests or max_bs, _MIN_ACTIVATION_TOKENS)
        graphs = max_bs * _GRAPH_MB_PER_SEQ
        if rc.dp_attention and rc.dp > 1:
            graphs += max_bs * rc.dp * _DP_ATTENTION_GRAPH_MB_PER_SEQ
            graphs += max_bs * rc.dp * 1.5 if max_bs > 300 else 0
    else:  # prefill: no decode graphs (SGLang's prefill graphs are off by default)
        tokens, graphs = max(rc.chunked_prefill_size, _MIN_ACTIVATION_TOKENS), 0
    deepep = name == "decode" and uses_deepep([*cfg.engine.extra_args, *rc.extra_args])
    return Headroom(
        activations_mb=tokens * _ACTIVATION_MB_PER_TOKEN,
        graphs_mb=float(graphs),
        parallel_mb=rc.tp / 8 * 1024,
        deepep_mb=_DEEPEP_MB if deepep else 0.0,
        floor_mb=_LARGE_GPU_FLOOR_MB if gpu_mb > _LARGE_GPU_MB else 0.0,
    )

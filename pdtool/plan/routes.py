"""The KV transfer of a deployment: shard specs, the engine's pools, routes and write counts.

Every figure comes from `transfer.routes` (who sends which heads), `transfer.geometry` (the
engine's pages and metadata buffers, and `expected_writes`) and `transfer.parallel` (degrees),
the code the messenger and the SGLang backend run, so the plan shows what a decoder waits for.

The engine decides the pages, as its adapter (`pdtool.adapters`) says: pdtool's messenger
(reference engine) keeps one fused K/V buffer per layer in `transfer.layout` and stops one
token short; SGLang 0.5.23 keeps its own NHD pools (separate K and V, or MLA's latent)
whatever `transfer.layout` says, sends every prompt token, and writes one row of each of its
`MetadataBuffers` per request.
"""

from __future__ import annotations

from pdtool.adapters import adapter
from pdtool.plan.records import (
    LAYOUT_FROM_CONFIG,
    LAYOUT_FROM_SGLANG,
    RoutePlan,
    ShardPlan,
    SlicePlan,
    TransferPlan,
)
from pdtool.schema import Config, kv_dtype, kv_head_width, role, role_dims
from transfer import geometry as G
from transfer import routes as R
from transfer.gpu_memory import choose_gpu_memory


def shard_spec(cfg: Config, rname: str) -> R.ShardSpec:
    """The transfer.routes ShardSpec of a role (DP replicas without DP attention are TP-wide)."""
    d = role_dims(cfg, rname)
    return R.ShardSpec(num_kv_heads=d.kv_heads, tp=d.tp, dp=d.attn_dp)


def kv_pool(cfg: Config) -> G.PagePool:
    """The pages the transfer really writes: SGLang's own pools, or the messenger's."""
    return adapter(cfg).kv_pool(cfg)


def aux_buffers(cfg: Config) -> tuple[G.AuxBuffer, ...]:
    """The metadata buffers a request writes once, after its last chunk (one write each)."""
    return adapter(cfg).aux_buffers(cfg)


def layout_source(cfg: Config) -> str:
    """Where the plan's page layout comes from (shown beside it by `pdtool plan`)."""
    return LAYOUT_FROM_SGLANG if adapter(cfg).own_pools else LAYOUT_FROM_CONFIG


def sglang_draft(cfg: Config) -> G.KVGroup | None:
    """The speculative draft model's KV buffers pdtool's SGLang backend sends beside the
    target's (`model.draft_layers`, `SGLangAdapter.draft_group`). None without a draft KV pool;
    RouteError where the backend could not slice it."""
    return adapter(cfg).draft_group(cfg, shard_spec(cfg, "prefill"), shard_spec(cfg, "decode"))


def draft_writes(cfg: Config, tokens: int, dst_rank: int) -> int:
    """What decode attention rank `dst_rank` counts of the draft's KV for a `tokens` prompt
    (0 without one): geometry's `expected_writes` of its buffers and slices."""
    group = sglang_draft(cfg)
    if group is None:
        return 0
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    pool, page = kv_pool(cfg), cfg.decode.page_size
    dsrc, ddst = group.specs(src.attn_tp, dst.attn_tp)
    return G.expected_writes(G.sglang_group_slices(group, src.attn_tp, dst.attn_tp, dst_rank),
                             dsrc, ddst, layout=pool, page_size=page,
                             num_pages=pool.pages_for(tokens, page), num_layers=1,
                             buffers_per_layer=group.count)


def draft_summary(cfg: Config) -> str:
    """One line on the draft's KV in the counts (empty without one)."""
    group = sglang_draft(cfg)
    if group is None:
        return ""
    how = "whole pages from one prefill rank" if group.whole else \
        "head slices like the target's"
    return (f"draft KV (model.draft_layers={cfg.model.draft_layers}): {group.count} more "
            f"buffers after the target's, {how}; counted in writes/request below, taking "
            f"the draft's KV heads to be the target's")


def pages_per_request(cfg: Config, tokens: int) -> int:
    return kv_pool(cfg).pages_for(tokens, cfg.decode.page_size)


def request_writes(cfg: Config, tokens: int, slices: list[R.Slice], src: R.ShardSpec,
                   dst: R.ShardSpec, pool: G.PagePool | None = None) -> int:
    """`geometry.expected_writes` of one decode rank's `slices` for a `tokens` prompt, in the
    engine's pages (or in `pool`'s, to show what another layout would cost)."""
    pool = pool or kv_pool(cfg)
    page = cfg.decode.page_size
    return G.expected_writes(slices, src, dst, layout=pool, page_size=page,
                             num_pages=pool.pages_for(tokens, page),
                             num_layers=cfg.model.num_layers,
                             buffers_per_layer=pool.buffers_per_layer,
                             aux_writes=len(aux_buffers(cfg)))


def equal_sharding_writes(cfg: Config, tokens: int, pool: G.PagePool | None = None) -> int:
    """What a decode rank would count were both sides sharded alike (one write per page and
    layer buffer): the baseline the NHD warnings compare with."""
    dst = shard_spec(cfg, "decode")
    return request_writes(cfg, tokens, R.routes_for(dst, dst, 0), dst, dst, pool)


def route_plans(cfg: Config, tokens: int) -> tuple[RoutePlan, ...]:
    """Routes for every decode attention rank, from transfer.routes (raises RouteError).

    Counted in the engine's real pages (`kv_pool`), as its messenger/backend counts them.
    """
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    pool, page = kv_pool(cfg), cfg.decode.page_size
    out = []
    for d in range(dst.attn_tp):
        slices = R.routes_for(src, dst, d)
        cands = R.candidate_sources(src, dst, d)
        sl = tuple(
            SlicePlan(
                src_candidates=tuple(c),
                src_rank=s.src_rank,
                head_lo=s.head_lo,
                num_heads=s.num_heads,
                src_head_off=s.src_head_off,
                dst_head_off=s.dst_head_off,
                writes_per_page=G.writes_per_page(s, src, dst, pool, page),
            )
            for s, c in zip(slices, cands, strict=True)
        )
        out.append(
            RoutePlan(
                dst_rank=d,
                slices=sl,
                writes_per_page=sum(s.writes_per_page for s in sl),
                writes_per_request=request_writes(cfg, tokens, slices, src, dst, pool)
                + draft_writes(cfg, tokens, d),
            )
        )
    return tuple(out)


def route_summary(cfg: Config) -> str:
    """One line describing the source/destination mapping (replica sets, reconstruction...)."""
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    parts = []
    if src.dp > 1 or dst.dp > 1:
        parts.append(
            f"DP attention: a request lives in one of {src.dp} prefill and one of {dst.dp} "
            "decode attention groups; routes below are within that pair of groups"
        )
    if src.replicated:
        per = src.dims.replication
        what = "the MLA latent" if cfg.model.attention == "mla" else "each KV head"
        parts.append(f"{what} is replicated on {per} prefill ranks: any of {per} may send")
    elif src.attn_tp > dst.attn_tp:
        k = src.attn_tp // max(dst.attn_tp, 1)
        parts.append(f"each decode rank reconstructs its pages from {k} prefill ranks")
    elif src.attn_tp < dst.attn_tp:
        parts.append("each decode rank takes its head slice from one prefill rank")
    else:
        parts.append("rank i sends to rank i (equal sharding)")
    return "; ".join(parts)


def gpu_memory_path(cfg: Config) -> str:
    """How KV in GPU memory reaches the fabric, as the host can tell (the worker decides `auto`
    from the node's probe); the reference engine's KV is in host memory."""
    if cfg.mode == "aggregated":
        return "not used (mode=aggregated: no KV transfer)"
    if not adapter(cfg).kv_on_gpu:
        return f"host memory (the {cfg.engine.kind} engine's KV is not on a GPU)"
    if cfg.cluster.device == "cpu":
        return "host memory (SGLang's CPU engine keeps its KV pools in RAM)"
    if cfg.transfer.backend != "pdtool":
        return (f"SGLang's {cfg.transfer.backend} backend registers the GPU memory itself "
                f"(transfer.gpu_memory is pdtool's backend's)")
    return choose_gpu_memory(cfg.transfer.gpu_memory, cfg.transfer.provider).line()


def _shard_plan(spec: R.ShardSpec) -> ShardPlan:
    return ShardPlan(
        num_kv_heads=spec.num_kv_heads,
        tp=spec.tp,
        dp=spec.dp,
        attn_tp=spec.attn_tp,
        heads_per_rank=spec.heads_per_rank,
        replicated=spec.replicated,
    )


def transfer_plan(cfg: Config, tokens: int) -> TransferPlan:
    tr, model = cfg.transfer, cfg.model
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    pool = kv_pool(cfg)
    return TransferPlan(
        provider=tr.provider,
        layout=pool.layout,
        layout_source=layout_source(cfg),
        timeout_s=tr.timeout_s,
        connect_timeout_s=tr.connect_timeout_s,
        peer_timeout_s=tr.peer_timeout_s,
        heartbeat_s=tr.heartbeat_s,
        lanes=tr.lanes,
        gpu_memory=tr.gpu_memory,
        backend=tr.backend,
        gpu_memory_path=gpu_memory_path(cfg),
        aux_writes=len(aux_buffers(cfg)),
        page_size=cfg.decode.page_size,
        kv_dtype=kv_dtype(model, role(cfg, "decode")),
        kv_parts=pool.parts,
        head_width=kv_head_width(model),
        buffers_per_layer=pool.buffers_per_layer,
        prefill=_shard_plan(src),
        decode=_shard_plan(dst),
        tokens=tokens,
        pages_per_request=pages_per_request(cfg, tokens),
        routes=route_plans(cfg, tokens),
        summary=route_summary(cfg),
        draft=draft_summary(cfg),
        preflight_mib=tr.preflight_mib,
        preflight_min_gbps=tr.preflight_min_gbps,
        nic_gbps={n.name: n.gbps for n in cfg.cluster.nics},
    )

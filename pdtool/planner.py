"""The plan: a validated config resolved into pure data (frozen dataclasses, JSON-serialisable).

It is the contract between `validate`/`plan` and everything downstream (render, launch, the
worker entry): which process runs where (node index within the job's allocation, local GPU,
NIC, NUMA node, CPU list, fabric environment), which ports it binds, how the router pairs
prefill and decode instances, and how KV pages travel (routes from `transfer.routes`, the same
code the messenger runs, so the plan and the messenger always agree on the writes to count).
Write counts follow the pages the engine really has (`page_layout`): SGLang keeps its own NHD
pools whatever `transfer.layout` says.

Placement:
* `launcher.kind == local`: one machine; every instance on node 0, GPUs (CPU worker slots)
  handed out in order, prefill first.
* otherwise (Slurm): prefill instances on the first node group, decode on the next. An instance
  spanning several nodes takes them whole; single-node instances are packed
  `gpus_per_node // gpus_per_instance` to a node.
Ports: instance i of a role binds `<role>.<x>_port + i` on its first node; the router runs on
node 0 at `router.port`.

`build_plan` expects a config that passed `pdtool.rules.validate` without errors; on anything
else it may raise `PlanError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pdtool.memory import RoleMemory, role_memory
from pdtool.schema import (
    ROLES,
    ClusterConfig,
    Config,
    NicConfig,
    RoleConfig,
    attn_tp,
    gpus_per_instance,
    kv_dtype,
    kv_head_width,
    kv_heads,
    kv_parts,
    role,
)
from transfer import routes as R

PLAN_VERSION = 1
DEFAULT_TOKENS = 4096

#: TransferPlan.layout_source: the page layout is `transfer.layout`, or SGLang's own KV pools.
LAYOUT_FROM_CONFIG = "transfer.layout"
LAYOUT_FROM_SGLANG = "sglang pools"

#: NIC kinds each libfabric provider can drive.
PROVIDER_NIC_KINDS: dict[str, tuple[str, ...]] = {
    "efa": ("efa",),
    "verbs;ofi_rxm": ("connectx",),
    "tcp;ofi_rxm": ("tcp",),
    "shm": ("shm",),
}


class PlanError(ValueError):
    """The config cannot be planned (run the validator: it explains why)."""


# --- plan records --------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlan:
    """One worker process (one GPU): where it runs and what it talks through."""

    role: str  # prefill | decode
    instance: int  # instance index within the role
    rank: int  # rank within the instance, 0..gpus-1 (SGLang's TP rank across nodes)
    dp_rank: int  # attention DP group (replica) this rank belongs to
    tp_rank: int  # attention TP rank inside its DP group (the `rank` of transfer.routes)
    node: int  # node index within the job's allocation (0-based)
    node_rank: int  # node index within the instance (--node-rank)
    gpu: int  # local GPU id on that node
    nics: tuple[str, ...]  # libfabric domains (NICs) this rank sends/receives KV through
    nic_kind: str  # efa | connectx | tcp | shm ("" when none is reachable)
    nic_affinity: str  # switch (same PCIe switch) | host | numa | remote | none
    numa: int  # the GPU's NUMA node (bind memory here)
    cpus: str  # CPU list for this rank ("0-23,96-119"), a share of its NUMA node
    env: dict[str, str] = field(default_factory=dict)  # fabric environment for this rank


@dataclass(frozen=True)
class InstancePlan:
    """One engine instance (one SGLang server / reference-engine group)."""

    role: str
    index: int
    name: str  # "prefill-0"
    tp: int
    dp: int
    dp_attention: bool
    attn_tp: int
    gpus: int
    nodes: tuple[int, ...]  # allocation node indexes, first is the head node
    http_port: int
    bootstrap_port: int | None  # prefill only
    dist_init_port: int  # on nodes[0]
    page_size: int
    kv_dtype: str
    kv_layout: str
    chunked_prefill_size: int
    mem_fraction: float
    ranks: tuple[RankPlan, ...]

    @property
    def head_node(self) -> int:
        return self.nodes[0]


@dataclass(frozen=True)
class RouterTarget:
    instance: str
    node: int
    http_port: int
    bootstrap_port: int | None


@dataclass(frozen=True)
class RouterPlan:
    node: int
    port: int
    policy: str
    prefill: tuple[RouterTarget, ...]
    decode: tuple[RouterTarget, ...]


@dataclass(frozen=True)
class SlicePlan:
    """A head run one decode attention rank receives; any of `src_candidates` may send it."""

    src_candidates: tuple[int, ...]  # prefill attention ranks holding these heads
    src_rank: int  # the deterministic choice (first candidate); messengers may draw at random
    head_lo: int
    num_heads: int
    src_head_off: int
    dst_head_off: int
    writes_per_page: int  # per page and layer buffer, in the effective layout (page_layout)


@dataclass(frozen=True)
class RoutePlan:
    """Everything decode attention rank `dst_rank` receives for one request."""

    dst_rank: int
    slices: tuple[SlicePlan, ...]
    writes_per_page: int  # sum over slices, per page and layer buffer
    writes_per_request: int  # `tokens` prompt tokens: pages x layers x buffers x per_page + aux


@dataclass(frozen=True)
class ShardPlan:
    """How one side shards its KV cache (transfer.routes.ShardSpec, plus derived facts)."""

    num_kv_heads: int
    tp: int
    dp: int
    attn_tp: int
    heads_per_rank: int
    replicated: bool


@dataclass(frozen=True)
class TransferPlan:
    provider: str
    layout: str  # the page layout written (page_layout), not always transfer.layout
    completion: str
    backend_name: str
    timeout_s: float
    connect_timeout_s: float
    aux_writes: int
    page_size: int
    kv_dtype: str
    kv_parts: int  # per head in a page: 2 K and V fused; 1 MLA latent or K/V in own buffers
    head_width: int  # elements per head and part
    buffers_per_layer: int  # 1: fused K/V (or MLA latent); 2: separate K and V (SGLang)
    prefill: ShardPlan
    decode: ShardPlan
    tokens: int  # prompt length the write counts below are for
    pages_per_request: int  # pages prefill sends (it stops one token short)
    routes: tuple[RoutePlan, ...]  # one per decode attention rank (same in every DP group)
    summary: str  # one line: how sources map to destinations
    peer_timeout_s: float = 5.0  # messenger liveness (transfer.peer_timeout_s)
    heartbeat_s: float = 0.5
    lanes: int = 0  # decoder receive lanes (transfer.lanes; 0: the messenger's default)
    layout_source: str = LAYOUT_FROM_CONFIG  # where `layout` comes from (page_layout)


@dataclass(frozen=True)
class ModelSummary:
    name: str
    path: str
    attention: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    num_params_b: float
    num_experts: int
    seed: int


@dataclass(frozen=True)
class ClusterSummary:
    name: str
    device: str
    gpu_type: str
    gpus_per_node: int
    gpu_memory_gb: float
    nodes_available: int


@dataclass(frozen=True)
class Plan:
    version: int
    recipe: str
    description: str
    launcher: str
    engine: str
    nodes: int  # nodes the deployment occupies (the Slurm allocation size)
    model: ModelSummary
    cluster: ClusterSummary
    instances: tuple[InstancePlan, ...]
    router: RouterPlan
    transfer: TransferPlan
    memory: tuple[RoleMemory, ...]
    mode: str = "disaggregated"  # config `mode`: aggregated instances run whole requests

    def role_instances(self, role_name: str) -> tuple[InstancePlan, ...]:
        return tuple(i for i in self.instances if i.role == role_name)

    def all_ranks(self) -> tuple[RankPlan, ...]:
        return tuple(r for i in self.instances for r in i.ranks)


# --- placement -----------------------------------------------------------------------------


def expand_cpus(spec: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]. Raises ValueError on bad syntax."""
    out: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            a, b = int(lo), int(hi)
            if a > b or a < 0:
                raise ValueError(f"bad CPU range {part!r}")
            out.extend(range(a, b + 1))
        else:
            v = int(part)
            if v < 0:
                raise ValueError(f"bad CPU id {part!r}")
            out.append(v)
    return out


def compress_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    runs: list[str] = []
    s = sorted(set(cpus))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        runs.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(runs)


def gpu_numa(cluster: ClusterConfig, gpu: int) -> int:
    return cluster.gpu_numa[gpu] if 0 <= gpu < len(cluster.gpu_numa) else 0


def rank_cpus(cluster: ClusterConfig, gpu: int) -> str:
    """This GPU's share of its NUMA node's CPUs.

    Each comma-separated block of the NUMA node's list (e.g. the cores "0-47" and their
    hyperthread siblings "96-143") is split evenly between the node's GPUs, so a rank gets whole
    cores with their siblings. With fewer CPUs than GPUs, every rank gets the whole list.
    """
    numa = gpu_numa(cluster, gpu)
    if not 0 <= numa < len(cluster.numa_cpus):
        return ""
    spec = cluster.numa_cpus[numa]
    blocks = [expand_cpus(b) for b in spec.split(",") if b.strip()]
    peers = [g for g in range(cluster.gpus_per_node) if gpu_numa(cluster, g) == numa]
    n = len(peers)
    if n <= 1 or gpu not in peers or any(len(b) < n for b in blocks):
        return compress_cpus([c for b in blocks for c in b])
    k = peers.index(gpu)
    mine: list[int] = []
    for b in blocks:
        per = len(b) // n
        mine.extend(b[k * per : (k + 1) * per])
    return compress_cpus(mine)


def choose_nics(
    cluster: ClusterConfig, provider: str, gpu: int
) -> tuple[tuple[str, ...], str, str]:
    """(NIC names, kind, affinity) for a GPU: same PCIe switch > host NIC > same NUMA > any.

    Affinity `none` (no names) when no NIC of a kind the provider drives exists.
    """
    kinds = PROVIDER_NIC_KINDS.get(provider, ())
    cands: list[NicConfig] = [n for n in cluster.nics if n.kind in kinds]
    if not cands:
        if provider == "shm":  # shared memory needs no NIC: every node has it
            return ("shm",), "shm", "host"
        return (), "", "none"
    switch = [n for n in cands if gpu in n.gpus]
    if switch:
        return tuple(n.name for n in switch), switch[0].kind, "switch"
    host = [n for n in cands if not n.gpus]
    if host:
        return (host[0].name,), host[0].kind, "host"
    numa = gpu_numa(cluster, gpu)
    near = [n for n in cands if n.numa == numa]
    pool, aff = (near, "numa") if near else (cands, "remote")
    pick = pool[gpu % len(pool)]
    return (pick.name,), pick.kind, aff


def fabric_env(provider: str, nics: tuple[str, ...], kind: str) -> dict[str, str]:
    """Environment a worker needs so libfabric (and the messenger) use the chosen NICs.

    `PDTOOL_FI_*` are for the messenger (provider string and domain list); the `FI_*`
    variables restrict libfabric itself. FI_PROVIDER is only set for single providers: layered
    ones (`tcp;ofi_rxm`) are selected by the messenger's fi_getinfo hints.
    """
    env = {"PDTOOL_FI_PROVIDER": provider, "PDTOOL_FI_DOMAINS": ",".join(nics)}
    if provider == "efa":
        env["FI_PROVIDER"] = "efa"
        env["FI_EFA_IFACE"] = ",".join(nics)
    elif provider == "shm":
        env["FI_PROVIDER"] = "shm"
    elif provider == "tcp;ofi_rxm" and kind == "tcp":
        env["FI_TCP_IFACE"] = nics[0] if nics else ""
    elif provider == "verbs;ofi_rxm" and nics:
        env["FI_VERBS_DEVICE_NAME"] = nics[0]  # libfabric takes one device (name or prefix)
    return env


def instance_nodes(cluster: ClusterConfig, rc: RoleConfig) -> tuple[int, int]:
    """(nodes one instance spans, instances packed per node) for a role."""
    gpus = gpus_per_instance(rc)
    if rc.nodes > 1 or gpus > cluster.gpus_per_node:
        return rc.nodes, 1
    return 1, max(1, cluster.gpus_per_node // max(gpus, 1))


def role_node_count(cluster: ClusterConfig, rc: RoleConfig) -> int:
    """Nodes a role's instances occupy on a multi-node (Slurm) placement."""
    span, per_node = instance_nodes(cluster, rc)
    if span > 1:
        return span * rc.instances
    return math.ceil(rc.instances / per_node)


def placements(cfg: Config) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    """(role, instance) -> [(node, node_rank, gpu) per rank], following the module rules."""
    cl = cfg.cluster
    out: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    if cfg.launcher.kind == "local":
        gpu = 0
        for rname in ROLES:
            rc = role(cfg, rname)
            for i in range(rc.instances):
                n = gpus_per_instance(rc)
                out[(rname, i)] = [(0, 0, gpu + r) for r in range(n)]
                gpu += n
        return out
    node = 0
    for rname in ROLES:
        rc = role(cfg, rname)
        n = gpus_per_instance(rc)
        span, per_node = instance_nodes(cl, rc)
        if span > 1:
            per = n // span
            for i in range(rc.instances):
                first = node + i * span
                out[(rname, i)] = [(first + r // per, r // per, r % per) for r in range(n)]
        else:
            for i in range(rc.instances):
                nd, slot = node + i // per_node, i % per_node
                out[(rname, i)] = [(nd, 0, slot * n + r) for r in range(n)]
        node += role_node_count(cl, rc)
    return out


def shard_spec(cfg: Config, rname: str) -> R.ShardSpec:
    """The transfer.routes ShardSpec of a role (DP replicas without DP attention are TP-wide)."""
    rc = role(cfg, rname)
    return R.ShardSpec(
        num_kv_heads=kv_heads(cfg.model),
        tp=rc.tp,
        dp=rc.dp if rc.dp_attention else 1,
    )


def page_layout(cfg: Config) -> tuple[str, int]:
    """(page layout, buffers per layer) of the KV pages the transfer really writes.

    pdtool's messenger and reference engine keep one buffer per layer (K and V fused per head)
    in `transfer.layout`. SGLang 0.5.23 keeps its own pools, NHD with separate K and V buffers
    (MLA: one latent buffer), whatever `transfer.layout` says; counting writes with the config
    value would show the wrong number.
    """
    if cfg.engine.kind == "sglang":
        return "NHD", kv_parts(cfg.model)  # one buffer per K/V part: K and V, or the latent
    return cfg.transfer.layout, 1


def layout_source(cfg: Config) -> str:
    """Where `page_layout(cfg)` takes the layout from (shown beside it by `pdtool plan`)."""
    return LAYOUT_FROM_SGLANG if cfg.engine.kind == "sglang" else LAYOUT_FROM_CONFIG


# --- building the plan ---------------------------------------------------------------------


def _instances(cfg: Config) -> tuple[InstancePlan, ...]:
    cl, tr = cfg.cluster, cfg.transfer
    places = placements(cfg)
    # SGLang's own pools, not the role's kv_layout (which only the reference engine follows)
    pools = page_layout(cfg)[0] if layout_source(cfg) == LAYOUT_FROM_SGLANG else None
    out: list[InstancePlan] = []
    for rname in ROLES:
        rc = role(cfg, rname)
        width = attn_tp(rc)
        for i in range(rc.instances):
            ranks = []
            for r, (node, node_rank, gpu) in enumerate(places[(rname, i)]):
                nics, kind, aff = choose_nics(cl, tr.provider, gpu)
                ranks.append(
                    RankPlan(
                        role=rname,
                        instance=i,
                        rank=r,
                        dp_rank=r // width,
                        tp_rank=r % width,
                        node=node,
                        node_rank=node_rank,
                        gpu=gpu,
                        nics=nics,
                        nic_kind=kind,
                        nic_affinity=aff,
                        numa=gpu_numa(cl, gpu),
                        cpus=rank_cpus(cl, gpu),
                        env=fabric_env(tr.provider, nics, kind),
                    )
                )
            nodes = tuple(dict.fromkeys(r.node for r in ranks))
            out.append(
                InstancePlan(
                    role=rname,
                    index=i,
                    name=f"{rname}-{i}",
                    tp=rc.tp,
                    dp=rc.dp,
                    dp_attention=rc.dp_attention,
                    attn_tp=width,
                    gpus=gpus_per_instance(rc),
                    nodes=nodes,
                    http_port=rc.http_port + i,
                    bootstrap_port=rc.bootstrap_port + i if rname == "prefill" else None,
                    dist_init_port=rc.dist_init_port + i,
                    page_size=rc.page_size,
                    kv_dtype=kv_dtype(cfg.model, rc),
                    kv_layout=pools or rc.kv_layout,
                    chunked_prefill_size=rc.chunked_prefill_size,
                    mem_fraction=rc.mem_fraction,
                    ranks=tuple(ranks),
                )
            )
    return tuple(out)


def _shard_plan(spec: R.ShardSpec) -> ShardPlan:
    return ShardPlan(
        num_kv_heads=spec.num_kv_heads,
        tp=spec.tp,
        dp=spec.dp,
        attn_tp=spec.attn_tp,
        heads_per_rank=spec.heads_per_rank,
        replicated=spec.replicated,
    )


def route_plans(cfg: Config, tokens: int) -> tuple[RoutePlan, ...]:
    """Routes for every decode attention rank, from transfer.routes (raises RouteError).

    Counted in the engine's real pages (`page_layout`), as its messenger/backend counts them.
    """
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    (layout, buffers), page = page_layout(cfg), cfg.decode.page_size
    pages = R.pages_for(tokens, page)
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
                writes_per_page=R.writes_per_page(s, src, dst, layout, page),
            )
            for s, c in zip(slices, cands, strict=True)
        )
        out.append(
            RoutePlan(
                dst_rank=d,
                slices=sl,
                writes_per_page=sum(s.writes_per_page for s in sl),
                writes_per_request=R.expected_writes(
                    slices,
                    src,
                    dst,
                    layout=layout,
                    page_size=page,
                    num_pages=pages,
                    num_layers=cfg.model.num_layers,
                    buffers_per_layer=buffers,
                    aux_writes=cfg.transfer.aux_writes,
                ),
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
        per = src.attn_tp // src.num_kv_heads
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


def _transfer(cfg: Config, tokens: int) -> TransferPlan:
    tr, model = cfg.transfer, cfg.model
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    layout, buffers = page_layout(cfg)
    return TransferPlan(
        provider=tr.provider,
        layout=layout,
        layout_source=layout_source(cfg),
        completion=tr.completion,
        backend_name=tr.backend_name,
        timeout_s=tr.timeout_s,
        connect_timeout_s=tr.connect_timeout_s,
        peer_timeout_s=tr.peer_timeout_s,
        heartbeat_s=tr.heartbeat_s,
        lanes=tr.lanes,
        aux_writes=tr.aux_writes,
        page_size=cfg.decode.page_size,
        kv_dtype=kv_dtype(model, cfg.decode),
        kv_parts=kv_parts(model) // buffers,  # K and V in their own buffers: one part each
        head_width=kv_head_width(model),
        buffers_per_layer=buffers,
        prefill=_shard_plan(src),
        decode=_shard_plan(dst),
        tokens=tokens,
        pages_per_request=R.pages_for(tokens, cfg.decode.page_size),
        routes=route_plans(cfg, tokens),
        summary=route_summary(cfg),
    )


def _router(cfg: Config, instances: tuple[InstancePlan, ...]) -> RouterPlan:
    def targets(rname: str) -> tuple[RouterTarget, ...]:
        return tuple(
            RouterTarget(i.name, i.head_node, i.http_port, i.bootstrap_port)
            for i in instances
            if i.role == rname
        )

    return RouterPlan(
        node=0,
        port=cfg.router.port,
        policy=cfg.router.policy,
        prefill=targets("prefill"),
        decode=targets("decode"),
    )


def build_plan(cfg: Config, tokens: int = DEFAULT_TOKENS) -> Plan:
    """The plan of a validated config. Raises PlanError if it cannot be planned."""
    try:
        instances = _instances(cfg)
        transfer = _transfer(cfg, tokens)
    except (R.RouteError, ValueError, IndexError, ZeroDivisionError, KeyError) as e:
        raise PlanError(f"config cannot be planned ({e}); run `pdtool validate`") from e
    m = cfg.model
    nodes = 1 + max((r.node for i in instances for r in i.ranks), default=0)
    return Plan(
        version=PLAN_VERSION,
        recipe=cfg.recipe,
        description=cfg.description,
        launcher=cfg.launcher.kind,
        engine=cfg.engine.kind,
        mode=cfg.mode,
        nodes=nodes,
        model=ModelSummary(
            name=m.name,
            path=m.path,
            attention=m.attention,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_q_heads=m.num_q_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            kv_lora_rank=m.kv_lora_rank,
            qk_rope_head_dim=m.qk_rope_head_dim,
            intermediate_size=m.intermediate_size,
            vocab_size=m.vocab_size,
            dtype=m.dtype,
            num_params_b=m.num_params_b,
            num_experts=m.num_experts,
            seed=m.seed,
        ),
        cluster=ClusterSummary(
            name=cfg.cluster.name,
            device=cfg.cluster.device,
            gpu_type=cfg.cluster.gpu_type,
            gpus_per_node=cfg.cluster.gpus_per_node,
            gpu_memory_gb=cfg.cluster.gpu_memory_gb,
            nodes_available=cfg.cluster.nodes,
        ),
        instances=instances,
        router=_router(cfg, instances),
        transfer=transfer,
        memory=tuple(role_memory(r, m, cfg.cluster, role(cfg, r)) for r in ROLES),
    )


# --- serialisation -------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain dicts/lists/scalars (what `pdtool plan --json` prints)."""
    return _plain(plan)


def to_json(plan: Plan, indent: int | None = 2) -> str:
    return json.dumps(plan_to_dict(plan), indent=indent, sort_keys=False)


def _build(cls: type, data: Any) -> Any:
    """Rebuild a dataclass tree from `plan_to_dict` output (tuples restored)."""
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name])
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    import types
    import typing

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value)
    if origin is tuple:
        inner = args[0] if args else Any
        return tuple(_convert(inner, v) for v in value)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(non_none[0], value) if non_none else value
    return value


def plan_from_dict(data: dict[str, Any]) -> Plan:
    """Inverse of `plan_to_dict` (the worker entry loads the plan saved beside a job)."""
    if data.get("version") != PLAN_VERSION:
        raise PlanError(f"plan version {data.get('version')!r}, this pdtool reads {PLAN_VERSION}")
    return _build(Plan, data)


def from_json(text: str) -> Plan:
    return plan_from_dict(json.loads(text))

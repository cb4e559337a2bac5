"""The plan's records: frozen dataclasses, JSON-serialisable, and their JSON round trip.

The plan is the contract between `validate`/`plan` and everything downstream (render, launch,
the worker entry). `plan_to_dict` is exactly what `pdtool plan --json` prints.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from pdtool.memory import RoleMemory
from transfer import timers

PLAN_VERSION = 1
DEFAULT_TOKENS = 4096

#: TransferPlan.layout_source: the page layout is `transfer.layout`, or SGLang's own KV pools.
LAYOUT_FROM_CONFIG = "transfer.layout"
LAYOUT_FROM_SGLANG = "sglang pools"


class PlanError(ValueError):
    """The config cannot be planned (run the validator: it explains why)."""


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
    mem_fraction: float  # what the engine is told (EngineAdapter.engine_mem_fraction)
    max_running_requests: int  # 0: the engine's default
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
    metrics_port: int | None = None  # sglang-router's Prometheus exporter (pdtool.ports)
    request_timeout_s: float = 1800.0  # router.request_timeout_s

    @property
    def targets(self) -> tuple[RouterTarget, ...]:
        """Every instance behind the router, prefill first (mode=aggregated: all take whole
        requests)."""
        return (*self.prefill, *self.decode)


@dataclass(frozen=True)
class SlicePlan:
    """A head run one decode attention rank receives; any of `src_candidates` may send it."""

    src_candidates: tuple[int, ...]  # prefill attention ranks holding these heads
    src_rank: int  # the deterministic choice (first candidate); messengers may draw at random
    head_lo: int
    num_heads: int
    src_head_off: int
    dst_head_off: int
    writes_per_page: int  # per page and layer buffer, in the engine's pages (routes.kv_pool)


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
    layout: str  # the page layout written (routes.kv_pool), not always transfer.layout
    timeout_s: float
    connect_timeout_s: float
    aux_writes: int  # metadata buffers written once per request (the engine's, geometry)
    page_size: int
    kv_dtype: str
    kv_parts: int  # per head in a page: 2 K and V fused; 1 MLA latent or K/V in own buffers
    head_width: int  # elements per head and part
    buffers_per_layer: int  # 1: fused K/V (or MLA latent); 2: separate K and V (SGLang)
    prefill: ShardPlan
    decode: ShardPlan
    tokens: int  # prompt length the write counts below are for
    pages_per_request: int  # pages prefill sends (messenger: one token short; SGLang: all)
    routes: tuple[RoutePlan, ...]  # one per decode attention rank (same in every DP group)
    summary: str  # one line: how sources map to destinations
    peer_timeout_s: float = timers.PEER_TIMEOUT_S  # messenger liveness (transfer.peer_timeout_s)
    heartbeat_s: float = timers.HEARTBEAT_S
    lanes: int = 0  # decoder receive lanes (transfer.lanes; 0: the messenger's default)
    layout_source: str = LAYOUT_FROM_CONFIG  # where `layout` comes from (routes.kv_pool)
    gpu_memory: str = "auto"  # transfer.gpu_memory: auto | direct | staged
    gpu_memory_path: str = ""  # what that means here (transfer.gpu_memory.choose_gpu_memory)
    backend: str = "pdtool"  # transfer.backend: SGLang's own (mooncake, nixl) register GPU
    # memory themselves, so transfer.gpu_memory is pdtool's backend's only
    draft: str = ""  # the speculative draft's own KV in the counts (routes.draft_summary)
    # the fabric check of preflight runs (pdtool.fabric_check): MiB per NIC pair (0: none),
    # its floor in Gbit/s (-1: a quarter of the slower link) and each NIC's link speed
    preflight_mib: int = 0
    preflight_min_gbps: float = -1.0
    nic_gbps: dict[str, float] = field(default_factory=dict)


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
    context_length: int  # prompt + new tokens one request may span
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
    engine_version: str = ""  # engine.version: the SGLang release the worker checks at start

    @property
    def aggregated(self) -> bool:
        """mode=aggregated: every instance prefills and decodes its own requests, no KV moves."""
        return self.mode == "aggregated"

    def role_instances(self, role_name: str) -> tuple[InstancePlan, ...]:
        return tuple(i for i in self.instances if i.role == role_name)

    def all_ranks(self) -> tuple[RankPlan, ...]:
        return tuple(r for i in self.instances for r in i.ranks)


# --- JSON ----------------------------------------------------------------------------------


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

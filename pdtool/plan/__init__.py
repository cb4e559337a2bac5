"""The plan: a validated config resolved into pure data (frozen dataclasses, JSON-serialisable).

It is the contract between `validate`/`plan` and everything downstream (render, launch, the
worker entry). The package, one idea a module:

    records    the plan's dataclasses and their JSON round trip (what `plan --json` prints)
    placement  node/GPU per rank, CPU lists, NIC choice and the NIC's libfabric environment
    routes     shard specs, the engine's KV pools and metadata buffers, routes, write counts
    build      build_plan: the config resolved into a Plan

The names below are the public surface; the validate rules use them and nothing deeper.
"""

from pdtool.plan.build import build_plan
from pdtool.plan.placement import (
    PROVIDER_NIC_KINDS,
    choose_nics,
    compress_cpus,
    cpu_share,
    expand_cpus,
    gpu_numa,
    nic_env,
    placements,
    rank_cpus,
)
from pdtool.plan.records import (
    DEFAULT_TOKENS,
    LAYOUT_FROM_CONFIG,
    LAYOUT_FROM_SGLANG,
    PLAN_VERSION,
    ClusterSummary,
    InstancePlan,
    ModelSummary,
    Plan,
    PlanError,
    RankPlan,
    RoutePlan,
    RouterPlan,
    RouterTarget,
    ShardPlan,
    SlicePlan,
    TransferPlan,
    from_json,
    plan_from_dict,
    plan_to_dict,
    to_json,
)
from pdtool.plan.routes import (
    aux_buffers,
    equal_sharding_writes,
    kv_pool,
    layout_source,
    pages_per_request,
    request_writes,
    route_plans,
    route_summary,
    sglang_draft,
    shard_spec,
)

__all__ = [
    "DEFAULT_TOKENS", "LAYOUT_FROM_CONFIG", "LAYOUT_FROM_SGLANG", "PLAN_VERSION",
    "PROVIDER_NIC_KINDS", "ClusterSummary", "InstancePlan",
    "ModelSummary", "Plan", "PlanError", "RankPlan", "RoutePlan", "RouterPlan", "RouterTarget",
    "ShardPlan", "SlicePlan", "TransferPlan", "aux_buffers", "build_plan", "choose_nics",
    "compress_cpus", "cpu_share", "equal_sharding_writes", "expand_cpus", "from_json",
    "gpu_numa", "kv_pool",
    "layout_source", "nic_env", "pages_per_request", "placements", "plan_from_dict",
    "plan_to_dict", "rank_cpus", "request_writes", "route_plans", "route_summary",
    "sglang_draft", "shard_spec", "to_json",
]

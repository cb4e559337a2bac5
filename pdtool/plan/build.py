"""`build_plan`: a validated config resolved into the plan (pure data, `pdtool.plan.records`).

Which process runs where (`placement`), which ports it binds, how the router pairs prefill and
decode instances, and how KV pages travel (`routes`). Ports: instance i of a role binds
`<role>.<x>_port + i` on its first node; the router runs on node 0 at `router.port`.

`build_plan` expects a config that passed `pdtool.rules.validate` without errors; on anything
else it may raise `PlanError`.
"""

from __future__ import annotations

from pdtool.adapters import adapter
from pdtool.memory import deployment_memory
from pdtool.plan.placement import choose_nics, gpu_numa, nic_env, placements, rank_cpus
from pdtool.plan.records import (
    DEFAULT_TOKENS,
    LAYOUT_FROM_SGLANG,
    PLAN_VERSION,
    ClusterSummary,
    InstancePlan,
    ModelSummary,
    Plan,
    PlanError,
    RankPlan,
    RouterPlan,
    RouterTarget,
)
from pdtool.plan.routes import kv_pool, layout_source, transfer_plan
from pdtool.ports import dist_stride, has_bootstrap, http_stride, router_metrics_port
from pdtool.schema import ROLES, Config, kv_dtype, role, role_dims
from transfer import routes as R


def _instances(cfg: Config) -> tuple[InstancePlan, ...]:
    cl, tr = cfg.cluster, cfg.transfer
    places = placements(cfg)
    # SGLang's own pools, not the role's kv_layout (which only the reference engine follows)
    pools = kv_pool(cfg).layout if layout_source(cfg) == LAYOUT_FROM_SGLANG else None
    out: list[InstancePlan] = []
    for rname in ROLES:
        rc = role(cfg, rname)
        dims = role_dims(cfg, rname)
        width = dims.attn_tp
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
                        env={**nic_env(tr.provider, nics, kind), **adapter(cfg).worker_env(cfg)},
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
                    gpus=dims.gpus,
                    nodes=nodes,
                    # packed instances' derived ports must not meet (pdtool.ports)
                    http_port=rc.http_port + i * http_stride(cfg, rname),
                    bootstrap_port=rc.bootstrap_port + i if has_bootstrap(cfg, rname) else None,
                    dist_init_port=rc.dist_init_port + i * dist_stride(cfg, rname),
                    page_size=rc.page_size,
                    kv_dtype=kv_dtype(cfg.model, rc),
                    kv_layout=pools or rc.kv_layout,
                    chunked_prefill_size=rc.chunked_prefill_size,
                    mem_fraction=adapter(cfg).engine_mem_fraction(cfg, rc),
                    max_running_requests=rc.max_running_requests,
                    ranks=tuple(ranks),
                )
            )
    return tuple(out)


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
        metrics_port=router_metrics_port(cfg),
        request_timeout_s=cfg.router.request_timeout_s,
    )


def build_plan(cfg: Config, tokens: int = DEFAULT_TOKENS) -> Plan:
    """The plan of a validated config. Raises PlanError if it cannot be planned."""
    try:
        instances = _instances(cfg)
        transfer = transfer_plan(cfg, tokens)
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
        engine_version=cfg.engine.version,
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
            context_length=m.context_length,
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
        memory=deployment_memory(cfg),
    )

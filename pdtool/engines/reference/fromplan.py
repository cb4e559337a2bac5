"""From the plan to a RankSpec: what `pdtool.worker` hands the reference engine.

The plan (pdtool.plan) says where every rank runs, its ports, page size and chunk size, the
model and the transfer settings; `spec_from_context` turns one worker's share of it into the
engine's plain `RankSpec`. Anything the reference engine cannot run (a vocabulary that is not
byte-level, DP attention, a KV dtype without a CPU kernel) is a `SpecError` naming the key.
"""

from __future__ import annotations

import os
from typing import Any

from pdtool.reference_limits import (
    MAX_KV_PAGES,
    TORCH_KV_DTYPES,
    device_problems,
    instance_problems,
    model_problems,
)
from transfer import workerenv

from .spec import LinkSpec, RankSpec

ALLOW_FAULTS_ENV = workerenv.REFERENCE_ALLOW_FAULTS.name
#: test hook beside it: "LAYER,INDEX" damages that received page of every request a decode
#: rank takes (`engine.Faults.page`), as a faulty NIC would: what `pdtool bench --verify` catches
CORRUPT_PAGE_ENV = workerenv.REFERENCE_CORRUPT_PAGE.name


def _corrupt_page() -> list[int] | None:
    raw = os.environ.get(CORRUPT_PAGE_ENV, "").strip()
    if not raw:
        return None
    try:
        layer, index = (int(x) for x in raw.split(","))
    except ValueError:
        raise SpecError(f"{CORRUPT_PAGE_ENV}={raw!r}: expected LAYER,INDEX") from None
    return [layer, index]


class SpecError(ValueError):
    """The plan asks for something the reference engine cannot run; names the key."""


def _raise_first(problems: list[tuple[str, str]]) -> None:
    if problems:
        key, msg = problems[0]
        raise SpecError(f"{key}: {msg}")


def model_fields(model: Any, kv_dtype: str, role: str = "prefill") -> dict[str, Any]:
    """`models.model_config` fields from the plan's model summary: a checkpoint folder
    (`model.path`), or the built-in model's TinyConfig (MLA: nope and v dims = head_dim)."""
    from pdtool.arch import is_local

    _raise_first(model_problems(model, kv_dtype, role))
    if is_local(model.path):
        return {"path": model.path, "kv_dtype": TORCH_KV_DTYPES[kv_dtype]}
    mla = model.attention == "mla"
    fields = {
        "attention": "mla" if mla else "gqa",
        "num_layers": model.num_layers,
        "hidden": model.hidden_size,
        "num_q_heads": model.num_q_heads,
        "num_kv_heads": model.num_q_heads if model.attention == "mha" else model.num_kv_heads,
        "head_dim": model.head_dim,
        "qk_nope_dim": model.head_dim,
        "v_head_dim": model.head_dim,
        "intermediate": model.intermediate_size,
        "seed": model.seed,
        "kv_dtype": TORCH_KV_DTYPES[kv_dtype],
    }
    if mla:
        fields.update(kv_lora_rank=model.kv_lora_rank, qk_rope_dim=model.qk_rope_head_dim)
    return fields


def check_instance(model: Any, fields: dict[str, Any], inst: Any, role: str) -> None:
    """What would otherwise fail inside the engine, as a SpecError naming the key."""
    from .models import model_config

    _raise_first(instance_problems(model, inst, role))
    try:
        model_config(fields).check_tp(inst.tp)
    except ValueError as exc:
        raise SpecError(f"{role}.tp: {exc}") from None


def _hosts() -> list[str] | None:
    """Allocation node addresses if the launcher exported them (`PDTOOL_HOSTS`, spaces)."""
    raw = os.environ.get("PDTOOL_HOSTS", "").split()
    return raw or None


def _host_of(node: int, default: str) -> str:
    hosts = _hosts()
    return hosts[node] if hosts and node < len(hosts) else default


def _secret_hex() -> str:
    from transfer.wire import read_secret

    path = os.environ.get("PDTOOL_SECRET_FILE")
    if not path:
        raise SpecError("PDTOOL_SECRET_FILE is not set: the rendered job script exports it")
    return read_secret(path).hex()


def pair_of(plan: Any, decode_index: int) -> int:
    """The prefill instance a decode instance sends its prompts to: decode instances are dealt
    round-robin over prefill instances (1 prefill : N decode shares one prefill)."""
    return decode_index % len(plan.role_instances("prefill"))


def spec_from_context(ctx: Any) -> RankSpec:
    """RankSpec of a worker (`pdtool.worker.WorkerContext`): plan + role + instance + rank."""
    from pdtool.arch import is_local

    plan = ctx.plan
    if ctx.role == "router":
        # aggregated: every instance serves whole requests, the prefill ones too
        targets = plan.router.targets if plan.aggregated else plan.router.decode
        urls = [f"http://{_host_of(t.node, ctx.host)}:{t.http_port}/health" for t in targets]
        return RankSpec(role="front", host=ctx.host, http_port=plan.router.port,
                        secret_hex=_secret_hex(), decoders=urls, model_name=plan.model.name,
                        tokenizer=plan.model.path if is_local(plan.model.path) else "",
                        request_timeout_s=plan.router.request_timeout_s)
    inst = ctx.instance
    fields = model_fields(plan.model, inst.kv_dtype, ctx.role)
    check_instance(plan.model, fields, inst, ctx.role)
    _raise_first(device_problems(plan.model, inst.kv_dtype, inst, ctx.role, plan.cluster.device))
    rank = ctx.ranks[0]
    pages = MAX_KV_PAGES  # the plan's memory holds the same cap (pdtool.memory)
    for mem in plan.memory:
        if mem.role == ctx.role and mem.kv_tokens > 0:
            pages = max(1, mem.kv_pages)
    return RankSpec(
        role="aggregated" if plan.aggregated else ctx.role, instance=inst.index, tp=inst.tp,
        rank=rank.rank, host=ctx.host,
        leader_host=_host_of(inst.nodes[0], ctx.host), dist_port=inst.dist_init_port,
        http_port=inst.http_port, page_size=inst.page_size, layout=inst.kv_layout,
        # each rank on its plan GPU: bare "cuda" put every rank of the node on GPU 0
        device=f"cuda:{rank.gpu}" if plan.cluster.device == "cuda" else plan.cluster.device,
        num_pages=pages,
        chunk=inst.chunked_prefill_size, max_running=inst.max_running_requests,
        model=fields, secret_hex=_secret_hex(), context=plan.model.context_length,
        link=link_spec(plan, inst, rank, ctx.host),
        peer=pair_of(plan, inst.index) if ctx.role == "decode" else 0,
        # test hook, off unless the deployment's env sets it (launcher.env.decode.*)
        allow_faults=os.environ.get(ALLOW_FAULTS_ENV) == "1",
        corrupt_page=_corrupt_page() if os.environ.get(ALLOW_FAULTS_ENV) == "1" else None,
    )


def link_spec(plan: Any, inst: Any, rank: Any, host: str) -> LinkSpec:
    """What the messenger adapter needs from the plan. A prefill instance's lead binds its
    control socket on the instance's bootstrap port, the planned and port-checked listener
    decode ranks reach it at (SGLang's prefill serves its bootstrap there); the other ranks take
    a free port. Decode ranks read every rank's control address at start-up from each prefill
    lead's /health (see link.py). The libfabric domain is the NIC the plan chose for this rank's
    GPU, as the worker exported it (transfer.workerenv)."""
    t = plan.transfer
    return LinkSpec(
        prefill_tp=t.prefill.attn_tp, decode_tp=t.decode.attn_tp,
        prefill=[f"http://{_host_of(i.nodes[0], host)}:{i.http_port}/health"
                 for i in plan.role_instances("prefill")],
        provider=t.provider, domain=workerenv.domain_for(rank.gpu), timeout_s=t.timeout_s,
        connect_timeout_s=t.connect_timeout_s, peer_timeout_s=t.peer_timeout_s,
        heartbeat_s=t.heartbeat_s, lanes=t.lanes,
        control_port=(inst.bootstrap_port or 0) if rank.rank == 0 else 0)

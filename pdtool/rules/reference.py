"""What pdtool's reference CPU engine can run, for validate (only for `engine.kind=reference`:
`pdtool.rules.ENGINE_STAGES`): its front's one routing policy, no version of its own, the
models and shapes it computes, the device it runs on, and no draft model.

The model and device checks live in `pdtool.reference_limits` (torch-free; rules import no
engine code, tests/test_layers.py) and also guard the engine's workers at start-up; here they
become findings, so `validate` rejects a deployment the engine would refuse before anything is
launched.
"""

from __future__ import annotations

from pdtool.reference_limits import device_problems, instance_problems, model_problems
from pdtool.rules.finding import Finding, error, warning
from pdtool.rules.sglang import draft_layers_unread
from pdtool.rules.values import ROUTER_POLICIES
from pdtool.schema import ROLES, Config, kv_dtype, role


def check_reference_limits(cfg: Config) -> list[Finding]:
    problems: dict[str, str] = {}  # one finding per key (the model is checked once per role)
    for name in ROLES:
        rc = role(cfg, name)
        for key, msg in model_problems(cfg.model, kv_dtype(cfg.model, rc), name):
            problems.setdefault(key, msg)
        for key, msg in instance_problems(cfg.model, rc, name):
            problems.setdefault(key, msg)
    fix = "change it, or use engine=sglang for this model"
    out = [error(key, f"engine=reference: {msg}", fix) for key, msg in problems.items()]
    for key, argv in (("engine.extra_args", cfg.engine.extra_args),
                      *((f"{name}.extra_args", role(cfg, name).extra_args) for name in ROLES)):
        if argv:
            out.append(error(key, f"engine=reference: {list(argv)} would be read by nothing "
                             "(extra_args are appended to SGLang's launch lines; the reference "
                             "engine takes its settings from the config keys)",
                             f"drop {key}, or use engine=sglang"))
    return out


#: The reference engine's front (pdtool.engines.reference.front) sends each request to the live
#: decode instance with the fewest in flight, ties taken in round-robin order: that is its one
#: policy, so the others are refused rather than accepted and ignored.
REFERENCE_ROUTER_POLICIES = ("round_robin",)


def check_reference_router(cfg: Config) -> list[Finding]:
    policy = cfg.router.policy
    if policy not in ROUTER_POLICIES or policy in REFERENCE_ROUTER_POLICIES:
        return []  # an unknown policy is refused by rules.values
    return [error("router.policy", f"{policy!r}: the reference engine's front "
                  "routes round_robin only (to the live decode instance with the fewest "
                  "requests in flight, ties in round-robin order)",
                  "set router.policy=round_robin, or use engine=sglang (sglang-router)")]


def check_reference_version(cfg: Config) -> list[Finding]:
    """The reference engine is part of pdtool and has no version of its own."""
    v = cfg.engine.version
    if v:
        return [error("engine.version", f"{v!r}: the reference engine is part of pdtool and has "
                      "no version of its own", "leave engine.version empty with engine=reference")]
    return []


def check_reference_device(cfg: Config) -> list[Finding]:
    """The reference engine runs on CPUs, and on cuda only as a check of the KV path, with the
    HND pages, dtypes and head dims FlashInfer reads (reference_limits.device_problems)."""
    dev = cfg.cluster.device
    if dev != "cpu":
        out = [
            warning(
                "engine.kind",
                f"the reference engine on cluster={cfg.cluster.name} (device={dev}) puts its "
                "weights on one GPU per rank with FlashInfer decode attention over host-mapped "
                "KV pages: a check of the KV path (not yet run on a GPU), not a serving engine",
                "use engine=sglang to serve on GPU clusters",
            )
        ]
        fixes = {"kv_layout": "set transfer.layout=HND", "kv_dtype": "set {r}.kv_dtype=fp16",
                 "head_dim": "use a model whose head_dim FlashInfer's decode is built for, or "
                             "cluster.device=cpu"}
        seen: set[str] = set()
        for r in ROLES:
            rc = role(cfg, r)
            for key, msg in device_problems(cfg.model, kv_dtype(cfg.model, rc), rc, r, dev):
                if key not in seen:
                    seen.add(key)
                    out.append(error(key, f"the reference engine on {dev}: {msg}",
                                     fixes[key.split(".")[-1]].format(r=r)))
        return out
    return []


VALUES = (check_reference_router, check_reference_version)
SHAPES = (check_reference_limits, check_reference_device)
PLACED = (draft_layers_unread,)

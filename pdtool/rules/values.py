"""Value rules: ranges and choices of single settings, checked before anything is derived.

OmegaConf already rejected wrong types and unknown keys at compose time; these catch values
of the right type that make no sense (tp=0, attention=foo, a CPU list that does not parse).
The later rules assume these passed, so `validate` stops after this stage on any error.
"""

from __future__ import annotations

import re

from pdtool.adapters import ADAPTERS
from pdtool.plan import expand_cpus
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import (
    ATTENTION_KINDS,
    DEVICES,
    ENGINES,
    KV_DTYPE_CHOICES,
    LAUNCHERS,
    LAYOUTS,
    MAX_LANES,
    MODES,
    NIC_KINDS,
    PROVIDERS,
    ROLES,
    WEIGHT_DTYPES,
    Config,
    dims,
    role,
)
from transfer.gpu_memory import GPU_MEMORY_MODES

ROUTER_POLICIES = ("round_robin", "random", "cache_aware", "power_of_two")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$|^(infinite|UNLIMITED)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


#: launcher.restart: restart a failed instance (bounded, with back-off), or end the deployment
RESTART_POLICIES = ("on-failure", "never")
GPU_DIRECTIVES = ("gpus-per-node", "gres", "none")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> list[Finding]:
    if value in choices:
        return []
    opts = " | ".join(choices)
    return [error(key, f"{value!r} is not one of {opts}", f"set {key} to one of: {opts}")]


def _at_least(key: str, value: float, low: float, what: str = "") -> list[Finding]:
    if value >= low:
        return []
    extra = f" ({what})" if what else ""
    return [error(key, f"must be >= {low:g}{extra}, got {value}", f"set {key}={low:g} or more")]


def check_model(cfg: Config) -> list[Finding]:
    m = cfg.model
    out = _choice("model.attention", m.attention, ATTENTION_KINDS)
    out += _choice("model.dtype", m.dtype, WEIGHT_DTYPES)
    for name in (
        "num_layers",
        "hidden_size",
        "num_q_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "context_length",
    ):
        out += _at_least(f"model.{name}", getattr(m, name), 1)
    for name in (
        "kv_lora_rank",
        "qk_rope_head_dim",
        "num_experts",
        "moe_intermediate_size",
        "draft_layers",
        "experts_per_token",
    ):
        out += _at_least(f"model.{name}", getattr(m, name), 0)
    if 0 < m.num_experts < m.experts_per_token:  # a dense model (0 experts) ignores it
        out.append(error("model.experts_per_token",
                         f"{m.experts_per_token} routed experts per token, but the model has "
                         f"model.num_experts={m.num_experts}",
                         "set model.experts_per_token to the router's top-k (0 for a dense "
                         "model)"))
    if m.num_params_b <= 0:
        out.append(
            error(
                "model.num_params_b",
                f"must be > 0 (billions of parameters), got {m.num_params_b}",
                "set model.num_params_b to the model's parameter count in billions",
            )
        )
    if not 0 <= m.expert_params_b <= max(m.num_params_b, 0):
        out.append(
            error(
                "model.expert_params_b",
                f"routed-expert parameters {m.expert_params_b}B must lie in "
                f"[0, model.num_params_b={m.num_params_b}B]",
                "set model.expert_params_b to the billions of parameters in routed experts",
            )
        )
    if m.num_experts > 0 and m.expert_params_b == 0:
        out.append(
            warning(
                "model.expert_params_b",
                f"a MoE model (model.num_experts={m.num_experts}) with expert_params_b=0: "
                "memory fit treats every weight as attention/dense (sharded over attention TP)",
                "set model.expert_params_b to the routed experts' parameter count in billions",
            )
        )
    if out:
        return out
    if m.attention == "mla":
        if m.kv_lora_rank < 1 or m.qk_rope_head_dim < 1:
            out.append(
                error(
                    "model.kv_lora_rank",
                    "MLA caches kv_lora_rank + qk_rope_head_dim values per token; got "
                    f"kv_lora_rank={m.kv_lora_rank}, qk_rope_head_dim={m.qk_rope_head_dim}",
                    "set model.kv_lora_rank and model.qk_rope_head_dim (DeepSeek-V3/R1: 512, 64)",
                )
            )
        if m.num_kv_heads != 1:
            out.append(
                error(
                    "model.num_kv_heads",
                    f"MLA caches one latent head per token, got num_kv_heads={m.num_kv_heads}",
                    "set model.num_kv_heads=1",
                )
            )
    elif m.attention == "mha" and m.num_kv_heads != m.num_q_heads:
        out.append(
            error(
                "model.num_kv_heads",
                f"MHA has one KV head per query head: num_kv_heads={m.num_kv_heads} != "
                f"num_q_heads={m.num_q_heads}",
                f"set model.num_kv_heads={m.num_q_heads}, or model.attention=gqa",
            )
        )
    elif m.attention == "gqa" and m.num_q_heads % m.num_kv_heads:
        out.append(
            error(
                "model.num_kv_heads",
                f"GQA groups query heads evenly: num_q_heads={m.num_q_heads} is not a "
                f"multiple of num_kv_heads={m.num_kv_heads}",
                "set model.num_kv_heads to a divisor of model.num_q_heads",
            )
        )
    return out


def check_cluster(cfg: Config) -> list[Finding]:
    c = cfg.cluster
    out = _choice("cluster.device", c.device, DEVICES)
    out += _at_least("cluster.nodes", c.nodes, 1)
    out += _at_least("cluster.gpus_per_node", c.gpus_per_node, 1)
    if c.gpu_memory_gb <= 0:
        out.append(
            error(
                "cluster.gpu_memory_gb",
                f"must be > 0, got {c.gpu_memory_gb}",
                "set the GPU memory in GiB",
            )
        )
    if not c.numa_cpus:
        out.append(
            error(
                "cluster.numa_cpus",
                "no NUMA node listed",
                'list each NUMA node\'s CPUs, e.g. cluster.numa_cpus=["0-47,96-143"]',
            )
        )
    for i, spec in enumerate(c.numa_cpus):
        try:
            if not expand_cpus(spec):
                raise ValueError("empty")
        except ValueError:
            out.append(
                error(
                    f"cluster.numa_cpus.{i}",
                    f"{spec!r} is not a CPU list",
                    'write CPU lists like "0-47,96-143"',
                )
            )
    if c.gpus_per_node >= 1 and len(c.gpu_numa) != c.gpus_per_node:
        out.append(
            error(
                "cluster.gpu_numa",
                f"lists {len(c.gpu_numa)} GPUs, cluster.gpus_per_node={c.gpus_per_node}",
                "give the NUMA node of every GPU (nvidia-smi topo -m shows it)",
            )
        )
    for g, n in enumerate(c.gpu_numa):
        if not 0 <= n < max(len(c.numa_cpus), 1):
            out.append(
                error(
                    f"cluster.gpu_numa.{g}",
                    f"GPU {g} is on NUMA node {n}, but cluster.numa_cpus lists "
                    f"{len(c.numa_cpus)} node(s)",
                    "fix the NUMA node or add its CPU list to cluster.numa_cpus",
                )
            )
    seen: set[str] = set()
    for i, nic in enumerate(c.nics):
        k = f"cluster.nics.{i}"
        out += _choice(f"{k}.kind", nic.kind, NIC_KINDS)
        if not nic.name:
            out.append(error(f"{k}.name", "NIC has no name", "set its libfabric domain name"))
        elif nic.name in seen:
            out.append(error(f"{k}.name", f"NIC {nic.name!r} listed twice", "remove one"))
        seen.add(nic.name)
        if not 0 <= nic.numa < max(len(c.numa_cpus), 1):
            out.append(
                error(
                    f"{k}.numa",
                    f"NIC {nic.name} on NUMA node {nic.numa}, but only "
                    f"{len(c.numa_cpus)} NUMA node(s) are listed",
                    "fix the NUMA node of the NIC",
                )
            )
        bad = [g for g in nic.gpus if not 0 <= g < c.gpus_per_node]
        if bad:
            out.append(
                error(
                    f"{k}.gpus",
                    f"NIC {nic.name} lists GPUs {bad} outside 0..{c.gpus_per_node - 1}",
                    "list local GPU ids of the NIC's PCIe switch",
                )
            )
    return out


def check_roles(cfg: Config) -> list[Finding]:
    out: list[Finding] = []
    for r in ROLES:
        rc = role(cfg, r)
        for name in ("tp", "dp", "nodes", "instances", "page_size", "chunked_prefill_size"):
            out += _at_least(f"{r}.{name}", getattr(rc, name), 1)
        out += _at_least(f"{r}.max_running_requests", rc.max_running_requests, 0)
        out += _choice(f"{r}.kv_dtype", rc.kv_dtype, KV_DTYPE_CHOICES)
        out += _choice(f"{r}.kv_layout", rc.kv_layout, LAYOUTS)
        if not 0 < rc.mem_fraction <= 1:
            out.append(
                error(
                    f"{r}.mem_fraction",
                    f"share of GPU memory for weights + KV must be in (0, 1], got "
                    f"{rc.mem_fraction}",
                    f"set {r}.mem_fraction=0.85 (SGLang's usual static fraction)",
                )
            )
        if rc.tp >= 1 and rc.dp >= 1:  # DP attention groups must divide the TP group
            out += [error(f"{r}.{p.field}", p.message, p.fix)
                    for p in dims(rc).degree_problems()]
    return out


#: the fabric check's landing buffer is host memory on every decode rank
MAX_PREFLIGHT_MIB = 4096


def check_transfer(cfg: Config) -> list[Finding]:
    t = cfg.transfer
    out = _choice("transfer.provider", t.provider, PROVIDERS)
    out += _choice("transfer.layout", t.layout, LAYOUTS)
    out += _choice("transfer.gpu_memory", t.gpu_memory, GPU_MEMORY_MODES)
    if not 0 <= t.lanes <= MAX_LANES:
        out.append(error("transfer.lanes", f"receive lanes per decode rank must be 0 (automatic) "
                         f"to {MAX_LANES}, got {t.lanes}",
                         "set transfer.lanes=0 (2 on shm, 1 on network providers)"))
    for name in ("timeout_s", "connect_timeout_s", "peer_timeout_s", "heartbeat_s"):
        v = getattr(t, name)
        if v <= 0:
            out.append(error(f"transfer.{name}", f"must be > 0, got {v}", f"set transfer.{name}"))
    if not 0 <= t.preflight_mib <= MAX_PREFLIGHT_MIB:
        out.append(error("transfer.preflight_mib", f"MiB written per NIC pair by the fabric "
                         f"check must be 0 (none) to {MAX_PREFLIGHT_MIB}, got {t.preflight_mib}",
                         "set transfer.preflight_mib=256 (a few hundred MiB runs at link speed)"))
    if t.preflight_min_gbps < 0 and t.preflight_min_gbps != -1:
        out.append(error("transfer.preflight_min_gbps", f"must be -1 (a quarter of the link "
                         f"speed), 0 (report only) or a floor in Gbit/s, got "
                         f"{t.preflight_min_gbps}", "set transfer.preflight_min_gbps=-1"))
    if 0 < t.peer_timeout_s <= t.heartbeat_s:
        out.append(error("transfer.peer_timeout_s",
                         f"{t.peer_timeout_s} s is not longer than transfer.heartbeat_s "
                         f"({t.heartbeat_s} s): every peer would look dead",
                         "set transfer.peer_timeout_s to several heartbeats (default 5.0)"))
    return out


def check_launcher(cfg: Config) -> list[Finding]:
    lc = cfg.launcher
    out = _choice("launcher.kind", lc.kind, LAUNCHERS)
    if not lc.job_name.strip():
        out.append(error("launcher.job_name", "empty job name", "set launcher.job_name=pdtool"))
    if not lc.output_dir.strip():
        out.append(error("launcher.output_dir", "empty output folder", "set launcher.output_dir"))
    if lc.kind == "slurm" and not _SLURM_TIME.match(lc.time):
        out.append(
            error(
                "launcher.time",
                f"{lc.time!r} is not a Slurm time limit",
                'use MM, HH:MM:SS or D-HH:MM:SS, e.g. launcher.time="04:00:00"',
            )
        )
    for i, line in enumerate(lc.sbatch_extra):
        if not line.startswith("-"):
            out.append(
                error(
                    f"launcher.sbatch_extra.{i}",
                    f"{line!r} is not an sbatch option",
                    "write the option without '#SBATCH', e.g. --constraint=h200",
                )
            )
    if lc.container_image and lc.venv:
        out.append(
            error(
                "launcher.venv",
                "both launcher.container_image and launcher.venv are set",
                "use the container or the virtualenv, not both",
            )
        )
    for i, m in enumerate(lc.container_mounts):
        if ":" not in m:
            out.append(
                error(
                    f"launcher.container_mounts.{i}",
                    f"{m!r} is not SRC:DST[:FLAGS]",
                    "write mounts as /host/path:/container/path[:ro]",
                )
            )
    if lc.container_mounts and not lc.container_image:
        out.append(error("launcher.container_mounts",
                         f"{len(lc.container_mounts)} mount(s) but no launcher.container_image: "
                         f"mounts go into the container, and without one nothing reads them",
                         "set launcher.container_image, or drop launcher.container_mounts"))
    for scope in ("all", "prefill", "decode", "router"):
        for name in getattr(lc.env, scope):
            if not _ENV_NAME.match(name):
                out.append(
                    error(
                        f"launcher.env.{scope}.{name}",
                        f"{name!r} is not a valid environment variable name",
                        "use letters, digits and _ (not starting with a digit)",
                    )
                )
    out += _at_least("launcher.health_timeout_s", lc.health_timeout_s, 1)
    out += _choice("launcher.restart", lc.restart, RESTART_POLICIES)
    out += _choice("launcher.gpu_directive", lc.gpu_directive, GPU_DIRECTIVES)
    out += _at_least("launcher.max_restarts", lc.max_restarts, 0)
    out += _at_least("launcher.restart_backoff_s", lc.restart_backoff_s, 0)
    out += _at_least("launcher.stop_grace_s", lc.stop_grace_s, 1)
    out += _at_least("launcher.watchdog_s", lc.watchdog_s, 0, "0: off")
    out += _at_least("launcher.probe_timeout_s", lc.probe_timeout_s, 1, "whole seconds for "
                     "sglang-router's health checks")
    return out


def check_engine_router(cfg: Config) -> list[Finding]:
    out = _choice("engine.kind", cfg.engine.kind, ENGINES)
    out += _choice("router.policy", cfg.router.policy, ROUTER_POLICIES)
    out += _at_least("router.request_timeout_s", cfg.router.request_timeout_s, 1)
    out += _choice("mode", cfg.mode, MODES)
    if cfg.mode == "aggregated":  # said, not refused: the twin keeps its original's keys
        out.append(warning(
            "transfer",
            "mode=aggregated: no KV moves between instances, so nothing reads transfer.* or "
            "prefill.bootstrap_port; they are still checked as the disaggregated deployment "
            "this one mirrors (the baseline of `pdtool bench --compare aggregated`)",
            "nothing to change for a comparison; with mode=disaggregated they apply"))
    return out


def check_builtin_checkpoint(cfg: Config) -> list[Finding]:
    """`model.path=builtin:NAME`: a checkpoint pdtool builds (pdtool.checkpoints), for an
    engine that loads checkpoint folders (SGLang); the reference engine would ignore it."""
    from pdtool.checkpoints import BUILTIN, BUILTIN_PREFIX, builtin_name

    name = builtin_name(cfg.model.path)
    if name is None:
        return []
    if name not in BUILTIN:
        return [error("model.path", f"{cfg.model.path!r} is not a builtin checkpoint",
                      "use one of " + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN))]
    engine = ADAPTERS.get(cfg.engine.kind)  # an unknown one is refused by check_engine_router
    if engine is not None and not engine.loads_checkpoints:
        return [error("model.path", f"{cfg.model.path!r}: only engine=sglang loads it; the "
                      f"{cfg.engine.kind} engine would build its own random model instead",
                      "use engine=sglang, or model=tiny for the reference engine")]
    return []


ALL = (check_model, check_cluster, check_roles, check_transfer, check_launcher, check_engine_router,
       check_builtin_checkpoint)

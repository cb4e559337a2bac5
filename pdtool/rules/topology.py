"""Node/instance arithmetic, placement limits of the launcher, and NIC reachability.

* GPUs per instance (`tp`, or `tp * dp` without DP attention) must fit the nodes it spans: a
  multi-node instance uses whole nodes; a single-node instance fits in one node. GPUs left idle
  by packing are reported (never dropped silently).
* Slurm: the node groups of both roles must fit `cluster.nodes`. Local: one machine.
* Every GPU rank needs a NIC its provider can drive, preferably on its PCIe switch, at least on
  its NUMA node; `shm` only works when prefill and decode share a node.
"""

from __future__ import annotations

import math

from pdtool.plan import PROVIDER_NIC_KINDS, choose_nics, placements
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import ROLES, Config, role, role_dims


def check_instance_fit(cfg: Config) -> list[Finding]:
    """An instance's GPUs fill whole nodes or fit in one (`ParallelDims.node_problems`)."""
    out: list[Finding] = []
    for r in ROLES:
        d = role_dims(cfg, r)
        out += [error(d.key(p.field), p.message, p.fix) for p in d.node_problems()]
    return out


def check_idle_gpus(cfg: Config) -> list[Finding]:
    """Packing single-node instances can leave GPUs idle; say how many and where.

    Not for the local launcher (one machine, slots handed out in order) nor for CPU "GPUs"
    (worker slots cost nothing when unused).
    """
    if cfg.launcher.kind == "local" or cfg.cluster.device == "cpu":
        return []
    out: list[Finding] = []
    gpn = cfg.cluster.gpus_per_node
    for r in ROLES:
        rc, d = role(cfg, r), role_dims(cfg, r)
        g = d.gpus
        span, per_node = d.node_span()
        if span > 1:
            continue
        if gpn % g:
            out.append(
                warning(
                    f"{r}.tp",
                    f"{per_node} instance(s) of {g} GPUs fill {per_node * g} of a node's "
                    f"{gpn} GPUs: {gpn - per_node * g} idle on every {r} node",
                    f"choose {d.gpus_text().split('=')[0]} so that it divides {gpn}",
                )
            )
        rest = rc.instances % per_node
        if rest:
            idle = (per_node - rest) * g
            n = per_node * math.ceil(rc.instances / per_node)
            out.append(
                warning(
                    f"{r}.instances",
                    f"{r}.instances={rc.instances} x {g} GPUs packs {per_node} per node: "
                    f"{idle} GPUs idle on the last {r} node",
                    f"set {r}.instances={n} to use them",
                )
            )
    return out


def check_node_budget(cfg: Config) -> list[Finding]:
    lc, cl = cfg.launcher, cfg.cluster
    if lc.kind == "local":
        out = []
        for r in ROLES:
            if role(cfg, r).nodes > 1:
                out.append(
                    error(
                        f"{r}.nodes",
                        f"launcher=local runs everything on this machine; {r}.nodes="
                        f"{role(cfg, r).nodes}",
                        f"set {r}.nodes=1 or use launcher=slurm",
                    )
                )
        total = sum(role_dims(cfg, r).gpus * role(cfg, r).instances for r in ROLES)
        if not out and total > cl.gpus_per_node:
            parts = " + ".join(
                f"{role(cfg, r).instances} x {role_dims(cfg, r).gpus} ({r})" for r in ROLES
            )
            out.append(
                error(
                    "launcher.kind",
                    f"launcher=local puts every worker on one machine: {parts} = {total} "
                    f"workers > cluster.gpus_per_node={cl.gpus_per_node}",
                    "use fewer/smaller instances, or launcher=slurm for several nodes",
                )
            )
        return out
    need = {r: role_dims(cfg, r).node_count(role(cfg, r).instances) for r in ROLES}
    total = sum(need.values())
    if total <= cl.nodes:
        return []
    return [
        error(
            "cluster.nodes",
            f"the deployment needs {need['prefill']} prefill + {need['decode']} decode = "
            f"{total} nodes, cluster.nodes={cl.nodes}",
            f"set cluster.nodes={total} (if the partition has them) or use fewer instances",
        )
    ]


def check_provider(cfg: Config) -> list[Finding]:
    """The provider must have NICs it can drive; shm needs prefill and decode on one node."""
    prov, cl = cfg.transfer.provider, cfg.cluster
    out: list[Finding] = []
    kinds = PROVIDER_NIC_KINDS[prov]
    if prov != "shm" and not any(n.kind in kinds for n in cl.nics):
        have = sorted({n.kind for n in cl.nics}) or ["none"]
        better = [p for p, ks in PROVIDER_NIC_KINDS.items() if set(ks) & set(have)]
        out.append(
            error(
                "transfer.provider",
                f"provider {prov!r} drives NICs of kind {'/'.join(kinds)}; cluster="
                f"{cl.name} has NIC kinds {', '.join(have)}",
                f"set transfer.provider to one of {', '.join(better) or 'a supported provider'}"
                " or add the NICs to cluster.nics",
            )
        )
    if prov == "shm":
        places = placements(cfg)
        nodes = {
            r: {n for (rr, _), ps in places.items() if rr == r for n, _, _ in ps} for r in ROLES
        }
        if nodes["prefill"] != nodes["decode"] or len(nodes["prefill"]) > 1:
            out.append(
                error(
                    "transfer.provider",
                    "shm moves pages within one machine, but prefill runs on nodes "
                    f"{sorted(nodes['prefill'])} and decode on {sorted(nodes['decode'])}",
                    "use a network provider (transfer=efa, transfer=verbs or transfer=tcp), "
                    "or launcher=local",
                )
            )
    return out


def check_nic_reach(cfg: Config) -> list[Finding]:
    """Every GPU rank has a NIC; warn when the best one is off its switch or its NUMA node."""
    cl, prov = cfg.cluster, cfg.transfer.provider
    used = sorted({gpu for ps in placements(cfg).values() for _, _, gpu in ps})
    out: list[Finding] = []
    for gpu in used:
        nics, _, aff = choose_nics(cl, prov, gpu)
        if aff == "none":
            continue  # check_provider already names the missing NIC kind
        numa = cl.gpu_numa[gpu] if gpu < len(cl.gpu_numa) else 0
        if aff == "numa":
            out.append(
                warning(
                    "cluster.nics",
                    f"GPU {gpu} has no {prov} NIC on its PCIe switch; it uses {nics[0]} on "
                    f"the same NUMA node {numa}",
                    f"list GPU {gpu} in the `gpus` of the NIC on its switch (nvidia-smi topo -m)",
                )
            )
        elif aff == "remote":
            out.append(
                warning(
                    "cluster.nics",
                    f"GPU {gpu} (NUMA node {numa}) has no {prov} NIC on its NUMA node; KV "
                    f"traffic crosses the socket link to {nics[0]}",
                    f"add a NIC on NUMA node {numa} to cluster.nics, or fix the NUMA fields",
                )
            )
    for i, nic in enumerate(cl.nics):
        far = [g for g in nic.gpus if g < len(cl.gpu_numa) and cl.gpu_numa[g] != nic.numa]
        if far:
            out.append(
                warning(
                    f"cluster.nics.{i}.numa",
                    f"NIC {nic.name} is on NUMA node {nic.numa} but serves GPUs {far} of "
                    "another NUMA node",
                    "check the preset against `nvidia-smi topo -m`",
                )
            )
    return out


ARITHMETIC = (check_instance_fit, check_node_budget)
"""Rules that must pass before a placement exists."""

PLACED = (check_idle_gpus, check_provider, check_nic_reach)
"""Rules that inspect the placement."""

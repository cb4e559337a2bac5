"""Placement: which node and GPU each rank gets, its CPU share, and the NIC it talks through.

* `launcher.kind == local`: one machine; every instance on node 0, GPUs (CPU worker slots)
  handed out in order, prefill first.
* otherwise (Slurm): prefill instances on the first node group, decode on the next. An instance
  spanning several nodes takes them whole; single-node instances are packed
  `gpus_per_node // gpus_per_instance` to a node (`transfer.parallel.ParallelDims.node_span`).

NICs: same PCIe switch > host NIC > same NUMA node > any (`choose_nics`); `nic_env` is the
libfabric environment of a rank for the NICs chosen.
"""

from __future__ import annotations

from pdtool.schema import ROLES, ClusterConfig, Config, NicConfig, role, role_dims

#: NIC kinds each libfabric provider can drive.
PROVIDER_NIC_KINDS: dict[str, tuple[str, ...]] = {
    "efa": ("efa",),
    "verbs;ofi_rxm": ("connectx",),
    "tcp;ofi_rxm": ("tcp",),
    "shm": ("shm",),
}


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
    """This GPU's share of its NUMA node's CPUs, as the cluster preset lists them
    (`cpu_share`). On an exclusive Slurm node the worker takes the same share of the node's
    own list instead (pdtool.nodecheck.cpus_from_node): this one is the plan's forecast."""
    numa = gpu_numa(cluster, gpu)
    if not 0 <= numa < len(cluster.numa_cpus):
        return ""
    blocks = [expand_cpus(b) for b in cluster.numa_cpus[numa].split(",") if b.strip()]
    peers = [g for g in range(cluster.gpus_per_node) if gpu_numa(cluster, g) == numa]
    return compress_cpus(cpu_share(blocks, len(peers), peers.index(gpu) if gpu in peers else -1))


def cpu_share(blocks: list[list[int]], peers: int, k: int) -> list[int]:
    """Share `k` of `peers` of a NUMA node's CPUs.

    Each block of the node's list (e.g. the cores "0-47" and their hyperthread siblings
    "96-143") is split evenly between the node's GPUs, so a rank gets whole cores with their
    siblings. With fewer CPUs than GPUs (or `k` not a peer), every rank gets the whole list.
    """
    if peers <= 1 or not 0 <= k < peers or any(len(b) < peers for b in blocks):
        return [c for b in blocks for c in b]
    mine: list[int] = []
    for b in blocks:
        per = len(b) // peers
        mine.extend(b[k * per : (k + 1) * per])
    return mine


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


def nic_env(provider: str, nics: tuple[str, ...], kind: str) -> dict[str, str]:
    """Environment a rank needs so libfabric (and the messenger) use the NICs chosen for it.

    `PDTOOL_FI_PROVIDER` (transfer.workerenv) is for pdtool's SGLang backend; the NICs reach
    the engines through the worker (`workerenv.worker_env`, from the rank's `nics`). The `FI_*`
    variables restrict libfabric itself. FI_PROVIDER is only set for single providers: layered
    ones (`tcp;ofi_rxm`) are selected by the messenger's fi_getinfo hints.
    """
    from transfer.workerenv import FI_PROVIDER

    env = {FI_PROVIDER.name: provider}
    if provider == "efa":
        env["FI_PROVIDER"] = "efa"
        env["FI_EFA_IFACE"] = ",".join(nics)
    elif provider == "shm":
        env["FI_PROVIDER"] = "shm"
    # tcp and verbs take ONE interface/device: set only for a single NIC, since with several
    # it would hide the others from pdtool's SGLang backend, which opens an endpoint on each
    # (transfer/sglang/rails.py; the reference engine opens the first by its domain name)
    elif provider == "tcp;ofi_rxm" and kind == "tcp" and len(nics) <= 1:
        env["FI_TCP_IFACE"] = nics[0] if nics else ""
    elif provider == "verbs;ofi_rxm" and len(nics) == 1:
        env["FI_VERBS_DEVICE_NAME"] = nics[0]  # libfabric takes one device (name or prefix)
    return env


def placements(cfg: Config) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    """(role, instance) -> [(node, node_rank, gpu) per rank], following the module rules."""
    out: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    if cfg.launcher.kind == "local":
        gpu = 0
        for rname in ROLES:
            rc = role(cfg, rname)
            for i in range(rc.instances):
                n = role_dims(cfg, rname).gpus
                out[(rname, i)] = [(0, 0, gpu + r) for r in range(n)]
                gpu += n
        return out
    node = 0
    for rname in ROLES:
        rc = role(cfg, rname)
        dims = role_dims(cfg, rname)
        n = dims.gpus
        span, per_node = dims.node_span()
        if span > 1:
            per = n // span
            for i in range(rc.instances):
                first = node + i * span
                out[(rname, i)] = [(first + r // per, r // per, r % per) for r in range(n)]
        else:
            for i in range(rc.instances):
                nd, slot = node + i // per_node, i % per_node
                out[(rname, i)] = [(nd, 0, slot * n + r) for r in range(n)]
        node += dims.node_count(rc.instances)
    return out

"""Does this node match the plan? Checked by every worker before its engine starts.

A preset describes a node; a job runs on a real one. A NIC that is not there (or is down)
used to fall back to the provider's default domain, CPUs the step does not own failed in
`numactl` or were silently ignored, and a missing GPU surfaced as a CUDA error minutes into
loading weights. Each problem here names the preset key to change; `pdtool discover` writes
one from the node. Read through `pdtool.discover`'s sysfs readers (`root`: "/" on the node).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pdtool.discover import gpus_from_smi, query_gpus, read_nics
from pdtool.plan import compress_cpus, cpu_share, expand_cpus

_FIX = "set it from the node (`pdtool discover`)"


def cpu_problems(ranks: Iterable[Any], allowed: set[int]) -> list[str]:
    out = []
    for r in ranks:
        missing = [c for c in expand_cpus(r.cpus or "") if c not in allowed]
        if missing:
            out.append(f"rank {r.rank}: CPUs {compress_cpus(missing)} of its plan list "
                       f"{r.cpus} are not this process's (it may use "
                       f"{compress_cpus(sorted(allowed))}): cluster.numa_cpus describes another "
                       f"node; {_FIX}")
    return out


def nic_problems(ranks: Iterable[Any], root: Path) -> list[str]:
    out = []
    rdma = {n.name: n for n in read_nics(root)}
    net = root / "sys/class/net"
    for r in ranks:
        for name in r.nics:
            if r.nic_kind in ("efa", "connectx"):
                nic = rdma.get(name)
                if nic is None:
                    have = ", ".join(f"{n.name} ({n.state})" for n in rdma.values()) or "none"
                    out.append(f"rank {r.rank}: NIC {name} ({r.nic_kind}) is not on this node "
                               f"(its RDMA devices: {have}): cluster.nics; {_FIX}")
                elif nic.state != "ACTIVE":
                    out.append(f"rank {r.rank}: NIC {name} is {nic.state}, not ACTIVE: take it "
                               f"out of cluster.nics or bring the port up")
            elif r.nic_kind == "tcp" and net.is_dir() and not (net / name).exists():
                have = ", ".join(sorted(p.name for p in net.iterdir()))
                out.append(f"rank {r.rank}: interface {name} is not on this node (its "
                           f"interfaces: {have}): cluster.nics; {_FIX}")
    return out


def numa_problems(ranks: Iterable[Any], root: Path) -> list[str]:
    base = root / "sys/devices/system/node"
    if not base.is_dir():
        return []
    have = sorted(int(d.name[4:]) for d in base.glob("node[0-9]*"))
    return [f"rank {r.rank}: NUMA node {r.numa} is not on this node (it has {have}): "
            f"cluster.gpu_numa; {_FIX}" for r in ranks if r.numa not in have]


def gpu_problems(ranks: list[Any], root: Path, smi_text: str | None = None) -> list[str]:
    """device=cuda: the GPUs the ranks address are visible, on the NUMA nodes the plan says."""
    need = max((r.gpu for r in ranks), default=-1) + 1
    if need == 0:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = gpus_from_smi(smi_text) if smi_text is not None else query_gpus()[0]
    count = len([g for g in visible.split(",") if g.strip()]) if visible is not None \
        else len(gpus)
    if count < need:
        return [f"this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                f"{visible if visible is not None else 'unset'}), the plan addresses GPU "
                f"{need - 1}: cluster.gpus_per_node / launcher.gpus_per_node ask for more than "
                f"the node gives this job"]
    out = []
    if visible is None:  # physical ids: their NUMA nodes can be read
        devices = root / "sys/bus/pci/devices"
        by_index = {g.index: g for g in gpus}
        for r in ranks:
            g = by_index.get(r.gpu)
            numa_file = devices / g.bdf / "numa_node" if g else None
            if numa_file is not None and numa_file.exists():
                numa = max(int(numa_file.read_text().strip() or 0), 0)
                if numa != r.numa:
                    out.append(f"rank {r.rank}: GPU {r.gpu} is on NUMA node {numa}, the plan "
                               f"says {r.numa}: cluster.gpu_numa; {_FIX}")
    return out


def cpus_from_node(plan: Any, ranks: list[Any], root: Path = Path("/"),
                   allowed: set[int] | None = None) -> tuple[list[int], list[str]]:
    """The CPUs these ranks take on this node, read from the node rather than the preset:
    each rank's share (`cpu_share`, as the plan shares the preset's lists) of the CPUs of its
    NUMA node (sysfs) that this process may use, the share counted among the plan's ranks on
    that NUMA node of this allocation node. Without sysfs NUMA nodes, the plan's lists within
    the allowed set. Returns (CPUs, problems)."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    here = sorted({(r.numa, r.gpu) for i in plan.instances for r in i.ranks
                   if r.node == ranks[0].node})
    base = root / "sys/devices/system/node"
    cpus: set[int] = set()
    problems = []
    for r in ranks:
        listed = base / f"node{r.numa}" / "cpulist"
        if not listed.exists():
            cpus.update(c for c in expand_cpus(r.cpus or "") if c in allowed)
            continue
        blocks = [[c for c in expand_cpus(b) if c in allowed]
                  for b in listed.read_text().strip().split(",") if b.strip()]
        blocks = [b for b in blocks if b]
        if not blocks:
            problems.append(f"rank {r.rank}: NUMA node {r.numa} has no CPU this process may "
                            f"use (it may use {compress_cpus(sorted(allowed))}): "
                            f"cluster.gpu_numa; {_FIX}")
            continue
        peers = [g for numa, g in here if numa == r.numa]
        cpus.update(cpu_share(blocks, len(peers), peers.index(r.gpu)))
    return sorted(cpus), problems


def node_problems(ranks: list[Any], device: str, root: Path = Path("/"),
                  allowed: set[int] | None = None, check_plan_cpus: bool = True) -> list[str]:
    """Every way this node differs from what the plan says of these ranks (the plan's CPU
    lists are not compared when the worker takes its CPUs from the node)."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    out = cpu_problems(ranks, allowed) if check_plan_cpus else []
    out += nic_problems(ranks, root) + numa_problems(ranks, root)
    if device == "cuda":
        out += gpu_problems(ranks, root)
    return out

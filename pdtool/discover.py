"""`pdtool discover`: a cluster preset read from the node it runs on, instead of written by hand.

A hand-written preset is where a first run on a new site goes wrong: a NIC that is down, a
storage port taken for a compute NIC, CPUs the job does not have. This reads the node:

* GPUs from `nvidia-smi --query-gpu` (index, name, memory, PCI bus id); none (no driver, no
  GPU) makes a CPU preset of worker slots, like `cluster=local`;
* each GPU's NUMA node and PCIe path from sysfs (`/sys/bus/pci/devices/<bdf>`);
* RDMA NICs from `/sys/class/infiniband`: driver (efa, mlx5 -> connectx), port state, rate and
  link layer, NUMA node, PCIe path. A NIC is a GPU's when their PCIe paths meet below the host
  bridge (nvidia-smi's PIX/PXB: no host bridge between them); NICs near no GPU (storage and
  management ports) and ports that are not ACTIVE are left out, each named in a comment;
* CPUs per NUMA node from `/sys/devices/system/node`, cut to the CPUs this process may use
  (a Slurm step's allowed set), with SMT and `SLURM_CPUS_ON_NODE` noted;
* what can register GPU memory for RDMA (`nvidia_peermem` loaded, the kernel's dma-buf) and the
  libfabric providers `fi_info -l` lists, as comments that say which `transfer.*` applies.

`root` is the filesystem the facts are read from ("/" on the node; a folder of recorded sysfs
files in the tests). The preset composes as `cluster=NAME` once its folder is on Hydra's
search path (`hydra.searchpath=[file://DIR]`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pdtool.plan import compress_cpus, expand_cpus

#: worker slots and memory per slot of a preset for a machine without GPUs (cluster=local's)
CPU_SLOTS, CPU_SLOT_GB = 8, 2
_NIC_KINDS = {"efa": "efa", "mlx5_core": "connectx"}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int
    bdf: str  # sysfs form: 0000:53:00.0


@dataclass(frozen=True)
class Nic:
    name: str
    kind: str  # efa | connectx | "" (a driver pdtool does not drive)
    driver: str
    state: str  # ACTIVE, DOWN, ...
    gbps: int
    link_layer: str
    numa: int
    path: tuple[str, ...]  # PCIe path from the host bridge


@dataclass
class Node:
    """Everything read from one node."""

    gpus: list[Gpu]
    gpu_numa: list[int]
    gpu_paths: list[tuple[str, ...]]
    nics: list[Nic]
    numa_cpus: dict[int, str]
    notes: list[str] = field(default_factory=list)


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def gpus_from_smi(text: str) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader,
    nounits`. Bus ids come as 00000000:53:00.0; sysfs names them 0000:53:00.0."""
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        domain, rest = parts[3].split(":", 1)
        out.append(Gpu(int(parts[0]), parts[1], int(float(parts[2])),
                       f"{int(domain, 16):04x}:{rest}".lower()))
    return sorted(out, key=lambda g: g.index)


def query_gpus() -> tuple[list[Gpu], str]:
    """The node's GPUs through nvidia-smi, and a note when there are none or it failed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi on PATH: no NVIDIA GPUs (a CPU preset of worker slots)"
    res = subprocess.run([smi, "--query-gpu=index,name,memory.total,pci.bus_id",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=60, check=False)
    if res.returncode != 0:
        return [], f"nvidia-smi failed ({res.stderr.strip()[:200]}): a CPU preset"
    return gpus_from_smi(res.stdout), ""


def pci_path(device: Path) -> tuple[str, ...]:
    """The PCIe path of a sysfs device folder, from its host bridge (pci0000:00) down."""
    parts = Path(os.path.realpath(device)).parts
    start = next((i for i in range(1, len(parts))
                  if parts[i - 1] == "devices" and parts[i].startswith("pci")), None)
    return tuple(parts[start:]) if start is not None else ()


def _numa(device: Path) -> int:
    return max(int(_read(device / "numa_node", "0") or 0), 0)


def _gbps(rate: str) -> int:
    """`400 Gb/sec (4X NDR)` -> 400."""
    m = re.match(r"\s*([\d.]+)\s*Gb", rate)
    return int(float(m.group(1))) if m else 0


def read_nics(root: Path) -> list[Nic]:
    out = []
    base = root / "sys/class/infiniband"
    for d in sorted(base.glob("*")) if base.is_dir() else []:
        dev = d / "device"
        driver = Path(os.path.realpath(dev / "driver")).name
        port = d / "ports" / "1"
        state = _read(port / "state").split(":")[-1].strip() or "unknown"
        out.append(Nic(d.name, _NIC_KINDS.get(driver, ""), driver, state,
                       _gbps(_read(port / "rate")), _read(port / "link_layer"), _numa(dev),
                       pci_path(dev)))
    return sorted(out, key=lambda n: n.path)  # bus order (mlx5_10 after mlx5_9)


def read_numa_cpus(root: Path, allowed: set[int] | None) -> dict[int, str]:
    """NUMA node -> its CPU list, cut to `allowed` (None: all)."""
    nodes = {}
    base = root / "sys/devices/system/node"
    for d in sorted(base.glob("node[0-9]*")) if base.is_dir() else []:
        cpus = [c for c in expand_cpus(_read(d / "cpulist"))
                if allowed is None or c in allowed]
        if cpus:
            nodes[int(d.name[4:])] = compress_cpus(cpus)
    if not nodes:
        cpus = expand_cpus(_read(root / "sys/devices/system/cpu/online", "0"))
        nodes[0] = compress_cpus([c for c in cpus if allowed is None or c in allowed])
    return nodes


def close(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether two PCIe paths meet below the host bridge (share at least its root port)."""
    return len(a) > 2 and len(b) > 2 and a[:2] == b[:2]


def read_node(root: Path, gpus: list[Gpu], allowed: set[int] | None) -> Node:
    devices = root / "sys/bus/pci/devices"
    node = Node(gpus=gpus, gpu_numa=[_numa(devices / g.bdf) for g in gpus],
                gpu_paths=[pci_path(devices / g.bdf) for g in gpus],
                nics=read_nics(root), numa_cpus=read_numa_cpus(root, allowed))
    smt = _read(root / "sys/devices/system/cpu/smt/active")
    if smt:
        node.notes.append(f"SMT {'on' if smt == '1' else 'off'} (numa_cpus lists every "
                          f"hardware thread this process may use)")
    if os.environ.get("SLURM_CPUS_ON_NODE"):
        node.notes.append(f"inside a Slurm allocation: SLURM_CPUS_ON_NODE="
                          f"{os.environ['SLURM_CPUS_ON_NODE']}; numa_cpus holds only its CPUs")
    return node


def registration_notes(root: Path) -> list[str]:
    """How GPU memory can reach the NICs (transfer.gpu_memory)."""
    peermem = (root / "sys/module/nvidia_peermem").exists()
    release = _read(root / "proc/sys/kernel/osrelease")
    m = re.match(r"(\d+)\.(\d+)", release)
    dmabuf = bool(m) and (int(m.group(1)), int(m.group(2))) >= (5, 12)
    if peermem or dmabuf:
        how = " and ".join(x for x, on in (("nvidia_peermem is loaded", peermem),
                                           (f"kernel {release} has dma-buf", dmabuf)) if on)
        return [f"GPU memory registration: {how}; transfer.gpu_memory=auto tries direct "
                f"(FI_HMEM) on each node"]
    return ["GPU memory registration: neither nvidia_peermem nor dma-buf (kernel "
            f"{release or 'unknown'}): set transfer.gpu_memory=staged"]


def fabric_notes() -> list[str]:
    fi = shutil.which("fi_info")
    if fi is None:
        return ["libfabric: no fi_info on PATH (the messenger loads libfabric itself)"]
    res = subprocess.run([fi, "-l"], capture_output=True, text=True, timeout=60, check=False)
    names = sorted({line.split(":")[0].strip() for line in res.stdout.splitlines()
                    if line.strip() and not line.startswith((" ", "\t", "ofi_hook"))})
    return [f"libfabric providers (fi_info -l): {', '.join(names) or 'none'}"]


def preset(node: Node, name: str, host_memory_gib: float) -> tuple[dict, list[str]]:
    """The cluster preset (schema ClusterConfig's fields) and comment lines explaining it."""
    notes = list(node.notes)
    numa_ids = sorted(node.numa_cpus)
    # NUMA nodes renumbered 0.. in the preset's order (a Slurm step may hold some only)
    renumber = {n: i for i, n in enumerate(numa_ids)}
    numa_cpus = [node.numa_cpus[n] for n in numa_ids]
    if not node.gpus:
        slots = CPU_SLOTS
        gb = CPU_SLOT_GB if host_memory_gib >= CPU_SLOTS * CPU_SLOT_GB else 1
        doc = {"name": name, "nodes": 1, "gpus_per_node": slots, "gpu_type": "cpu",
               "gpu_memory_gb": gb, "device": "cpu",
               "gpu_numa": [i * len(numa_ids) // slots for i in range(slots)],
               "numa_cpus": numa_cpus,
               "nics": [{"name": "shm", "kind": "shm", "numa": 0, "gpus": [], "gbps": 0},
                        {"name": "lo", "kind": "tcp", "numa": 0, "gpus": [], "gbps": 0}]}
        notes.append(f"no GPUs: {slots} CPU worker slots of {gb} GiB host memory each "
                     f"(host: {host_memory_gib:.0f} GiB), KV over shm or tcp on loopback")
        return doc, notes
    nics = []
    for nic in node.nics:
        gpus = [g.index for g, p in zip(node.gpus, node.gpu_paths, strict=True)
                if close(p, nic.path)]
        why = ("not a NIC pdtool drives (driver " + nic.driver + ")" if not nic.kind else
               f"port state {nic.state}" if nic.state != "ACTIVE" else
               "near no GPU (a storage or management port)" if not gpus else "")
        if why:
            notes.append(f"left out {nic.name}: {why}")
            continue
        nics.append({"name": nic.name, "kind": nic.kind, "numa": renumber.get(nic.numa, 0),
                     "gpus": gpus, "gbps": nic.gbps})
    # several NICs of one kind close to a GPU at different speeds: the fastest carry KV
    for g in node.gpus:
        mine = [n for n in nics if g.index in n["gpus"]]
        top = max((n["gbps"] for n in mine), default=0)
        for n in mine:
            if n["gbps"] < top:
                notes.append(f"left out {n['name']} for GPU {g.index}: {n['gbps']} Gb/s beside "
                             f"{top} Gb/s")
                n["gpus"] = [x for x in n["gpus"] if x != g.index]
    nics = [n for n in nics if n["gpus"]]
    # NICs that are equally close to several GPUs (p5en: 2 GPUs and 4 EFAs per switch) are
    # dealt out in bus order, so each GPU sends on its own (GPU 2k takes the first pair)
    shared: dict[tuple[int, ...], list[dict]] = {}
    for n in nics:
        if len(n["gpus"]) > 1:
            shared.setdefault(tuple(n["gpus"]), []).append(n)
    for gpus, group in shared.items():
        if len(group) >= len(gpus):
            for j, n in enumerate(group):
                n["gpus"] = [gpus[j * len(gpus) // len(group)]]
            notes.append(f"{len(group)} NICs shared by GPUs {list(gpus)} on one PCIe switch: "
                         f"dealt out {len(group) // len(gpus)} per GPU in bus order")
    without = [g.index for g in node.gpus if not any(g.index in n["gpus"] for n in nics)]
    if without:
        notes.append(f"GPUs {without} have no RDMA NIC on their PCIe switch: their ranks use "
                     f"the NUMA node's NIC (validate says which)")
    kinds = sorted({n["kind"] for n in nics})
    if kinds:
        notes.append("KV transfer: " + ", ".join(
            {"efa": "transfer=efa", "connectx": "transfer=verbs"}[k] for k in kinds))
    first = node.gpus[0]
    doc = {"name": name, "nodes": 1, "gpus_per_node": len(node.gpus),
           "gpu_type": first.name.removeprefix("NVIDIA ").replace(" ", "-"),
           "gpu_memory_gb": round(first.memory_mib / 1024, 1), "device": "cuda",
           "socket_ifname": "", "gpu_numa": [renumber.get(n, 0) for n in node.gpu_numa],
           "numa_cpus": numa_cpus, "nics": nics}
    notes.append("socket_ifname: set it to the nodes' routable interface for instances that "
                 "span nodes (validate refuses them without it)")
    return doc, notes


def to_yaml(doc: dict, notes: list[str], source: str) -> str:
    """The preset as a cluster group file, its notes as comments on top."""
    import yaml

    head = [f"# {source}", *(f"# {n}" for n in notes), "defaults:", "  - base_cluster",
            "  - _self_", ""]
    body = []
    for key, value in doc.items():
        if key == "nics":
            body.append("nics:")
            body += [f"  - {yaml.safe_dump(n, default_flow_style=True, sort_keys=False).strip()}"
                     for n in value]
        else:
            body.append(yaml.safe_dump({key: value}, default_flow_style=True,
                                       sort_keys=False).strip().removeprefix("{").removesuffix("}"))
    return "\n".join(head + body) + "\n"


def host_memory_gib(root: Path) -> float:
    m = re.search(r"MemTotal:\s+(\d+) kB", _read(root / "proc/meminfo"))
    return int(m.group(1)) / 1024**2 if m else 0.0


def discover(name: str, root: Path = Path("/")) -> str:
    """The preset YAML for the node under `root`."""
    import socket
    import time

    gpus, note = query_gpus()
    allowed = set(os.sched_getaffinity(0)) if root == Path("/") else None
    node = read_node(root, gpus, allowed)
    if note:
        node.notes.insert(0, note)
    doc, notes = preset(node, name, host_memory_gib(root))
    if gpus:
        notes += registration_notes(root)
    notes += fabric_notes()
    source = (f"written by `pdtool discover` on {socket.gethostname()}, "
              f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    return to_yaml(doc, notes, source)

"""Does this machine match the cluster preset a local deployment names?

`launcher=local` runs every process here, bound to the preset's GPUs and CPUs. A GPU preset
(cluster=p5, 8 GPUs, CPUs 0-191) validated clean on a 2-core machine without GPUs and then
died in numactl ("<0-47,96-143> is invalid", 40 lines of usage). Not a rule: rules are pure
functions of the config, and this reads the machine (`pdtool validate` and `pdtool launch`
call it for launcher=local).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from pdtool.launch.resources import node_cpus
from pdtool.plan import compress_cpus
from pdtool.ports import deployment_listeners
from pdtool.rules.finding import Finding, error
from pdtool.schema import Config

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver knows
FIX = ("on this machine use cluster=local (CPU workers), or run the deployment on the cluster "
       "it describes with launcher=slurm")


def gpus_here() -> int:
    return len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0


def host_findings(cfg: Config) -> list[Finding]:
    """Errors naming what the preset wants that this machine lacks (launcher=local only)."""
    if cfg.launcher.kind != "local":
        return []
    c, out = cfg.cluster, []
    if c.device == "cuda" and (n := gpus_here()) < c.gpus_per_node:
        out.append(error("cluster", f"cluster={c.name} has {c.gpus_per_node} GPUs per node; "
                                    f"this machine has {n}", FIX))
    here = os.sched_getaffinity(0)
    want = node_cpus(cfg)
    if missing := [x for x in want if x not in here]:
        out.append(error("cluster.numa_cpus",
                         f"cluster={c.name} binds workers to CPUs {compress_cpus(want)}; this "
                         f"machine lets pdtool use CPUs {compress_cpus(sorted(here))} "
                         f"({len(missing)} missing)", FIX))
    path = cfg.model.path
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().exists():
        # a folder, not a Hub id: every worker would fail to load it after starting
        out.append(error("model.path", f"{path} does not exist on this machine",
                         "point model.path at a checkpoint folder here, or give a Hugging Face "
                         "Hub id (org/name) to download"))
    return out


def port_findings(cfg: Config) -> list[Finding]:
    """Errors naming each port the deployment would listen on that a process here holds
    (launcher=local, `pdtool launch` and `pdtool bench --launch` only: validating a running
    deployment's config is fine). Without it a second deployment on the same ports answered
    its health checks with the first one's servers, and was benchmarked in its place."""
    if cfg.launcher.kind != "local":
        return []
    out = []
    for port, key, what in deployment_listeners(cfg):
        if _taken(port):
            out.append(error(key, f"port {port} ({what}) is already in use on this machine",
                             "stop what holds it (another deployment: `pdtool status`, "
                             f"`pdtool stop`), or move {key}"))
    return out


def _taken(port: int) -> bool:
    """Whether binding `port` on every address fails because something holds it (a socket in
    TIME_WAIT does not count: servers bind with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False

"""The record of a running local deployment, so another shell can find, inspect and stop it.

The local supervisor (`pdtool.launch.supervisor.Supervisor`) keeps `running.json` in the job folder
while it runs: its own pid, the state (`starting`, `ready`), the router's URL once ready, and
every process it started (name, pid, log, health URL). It rewrites the file after each start
and restart and removes it after the last process stopped. `pdtool status`, `pdtool logs` and
`pdtool stop` read it; a record whose supervisor is gone (killed with SIGKILL, the machine
rebooted) is stale and ignored.

The file holds no secret (the secret stays in the 0600 `secret.key`); it is written to a
temporary name and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdtool.launch.health import pid_alive

RECORD = "running.json"


@dataclass
class ProcRecord:
    name: str
    role: str
    pid: int
    log: str
    health: str = ""  # its health URL ("" for none)


@dataclass
class Record:
    run_dir: str
    supervisor_pid: int
    state: str = "starting"  # starting | ready
    started: float = field(default_factory=time.time)
    router_url: str = ""
    log_dir: str = ""
    procs: list[ProcRecord] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return pid_alive(self.supervisor_pid)

    def proc(self, name: str) -> ProcRecord:
        """The process called `name` (a ValueError listing the names if there is none)."""
        for p in self.procs:
            if p.name == name:
                return p
        raise ValueError(f"no process {name!r} in {self.run_dir}; its processes: "
                         + ", ".join(p.name for p in self.procs))


def write(rec: Record) -> None:
    path = Path(rec.run_dir) / RECORD
    tmp = path.with_name(f".{RECORD}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(rec), indent=1) + "\n")
    tmp.replace(path)


def remove(run_dir: str | Path) -> None:
    (Path(run_dir) / RECORD).unlink(missing_ok=True)


def read(path: Path) -> Record | None:
    """The record at `path` (a job folder or its running.json); None if absent or unreadable."""
    if path.is_dir():
        path = path / RECORD
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        procs = [ProcRecord(**p) for p in raw.pop("procs")]
        return Record(**raw, procs=procs)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def find(root: Path) -> list[Record]:
    """The live deployments whose job folders lie in `root` (a job folder, or the folder of
    job folders: `launcher.output_dir`; a sweep's folders one level deeper), newest first."""
    paths = [root / RECORD, *root.glob(f"*/{RECORD}"), *root.glob(f"*/*/{RECORD}")]
    found = [r for r in (read(p) for p in paths if p.is_file()) if r is not None and r.alive]
    return sorted(found, key=lambda r: r.started, reverse=True)


def pick(root: Path, job: Path | None) -> Record:
    """The one live deployment a command acts on: `job`'s, or the only one under `root`. A
    LookupError says what was found instead and which option chooses."""
    if job is not None:
        rec = read(job)
        if rec is None:
            raise LookupError(f"{job}: no running deployment there (no readable {RECORD}; "
                              "it is written by `pdtool launch` while the deployment runs)")
        if not rec.alive:
            raise LookupError(f"{job}: its supervisor (pid {rec.supervisor_pid}) is gone; "
                              "the deployment is not running")
        return rec
    live = find(root)
    if not live:
        raise LookupError(f"no running deployment under {root}/ (start one with `pdtool "
                          "launch`, or name its job folder with --job DIR)")
    if len(live) > 1:
        raise LookupError(f"{len(live)} deployments run under {root}/: "
                          + ", ".join(r.run_dir for r in live) + "; choose one with --job DIR")
    return live[0]

"""Start a reference-engine deployment from RankSpecs as local processes (the engine's tests).

`pdtool launch` is the user's way (plan → launch spec → `pdtool.worker`); this module starts the
same serving code straight from specs so the engine's tests can pick TP degrees, faults and
pairings without a config tree, and read each leader's `/stats` and final `STATS` line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

from transfer.fabric import shm_leftovers

from .serve import RankSpec

#: ports handed out by this process: a port is free only until something binds it, so two
#: calls building one config could otherwise return the same port (the kernel's ephemeral
#: range and free_port_run's random bases overlap) and validate refuses the pair
_handed_out: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range, as `free_port_run` finds them (the
    kernel's own pick, a bind to port 0, lies in that range, where any outgoing connection can
    take it before the server binds it)."""
    return free_port_run(1)


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral ports start (Linux: 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_run(n: int) -> int:
    """First of `n` consecutive free ports (instances of a role bind base + i), below the
    kernel's ephemeral range: a port in it that is free now can be taken before the server
    binds it by any process's outgoing connection or bind to port 0 (a real SGLang prefill
    failed so, with "address already in use", while its own TP group's sockets came up)."""
    rng = random.Random()
    top = _ephemeral_low() - n - 1
    for _ in range(200):
        base = rng.randint(10000, top) if top > 12000 else rng.randint(20000, 60000)
        run = range(base, base + n)
        if _handed_out.intersection(run):
            continue
        socks: list[socket.socket] = []
        try:
            for port in run:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _handed_out.update(run)
        return base
    raise RuntimeError(f"no run of {n} free ports found")


def free_port_overrides(decodes: int = 2) -> list[str]:
    """Overrides that move a one-prefill deployment with `decodes` decode instances off its
    recipe's fixed ports onto free ones (concurrent runs on one machine collide on those):
    decode instance i binds each decode port + i, so those come as runs."""
    return [f"prefill.http_port={free_port()}", f"decode.http_port={free_port_run(decodes)}",
            f"router.port={free_port()}", f"prefill.dist_init_port={free_port()}",
            f"decode.dist_init_port={free_port_run(decodes)}",
            f"prefill.bootstrap_port={free_port()}"]


def get_json(url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


class Deployment:
    """Processes started from specs; `stop()` sends SIGTERM and collects their STATS lines."""

    def __init__(self, specs: list[RankSpec], log_dir: Path) -> None:
        self.specs = specs
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.stats: list[dict] = []

    def start(self, timeout_s: float = 120.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        from transfer.wire import write_secret

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        for i, spec in enumerate(self.specs):
            path = self.log_dir / f"{i}-{spec.role}-{spec.instance}-{spec.rank}.log"
            # the secret goes in a 0600 file, never on a command line others can read (ps)
            key = self.log_dir / f"{i}.key"
            write_secret(key, spec.secret)
            public = json.dumps({**asdict(spec), "secret_hex": ""})
            with open(path, "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pdtool.engines.reference.serve", "--spec", public],
                    stdout=log, stderr=subprocess.STDOUT,
                    env={**env, "PDTOOL_SECRET_FILE": str(key)}))
        deadline = time.monotonic() + timeout_s
        for spec in self.specs:
            if spec.rank != 0:
                continue
            while True:
                self._check_alive()
                try:
                    code, _ = get_json(f"http://{spec.host}:{spec.http_port}/health", timeout=2)
                    if code == 200:
                        break
                except (urllib.error.URLError, OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{spec.role}-{spec.instance} not healthy; logs in "
                                       f"{self.log_dir}")
                time.sleep(0.1)

    def _check_alive(self) -> None:
        for p, spec in zip(self.procs, self.specs, strict=True):
            if p.poll() is not None:
                raise RuntimeError(f"{spec.role}-{spec.instance} rank {spec.rank} exited "
                                   f"with {p.returncode}; logs in {self.log_dir}\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}"
                         for f in sorted(self.log_dir.glob("*.log")))

    def stop(self, timeout_s: float = 30.0) -> list[dict]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        _remove_shm_leftovers([p.pid for p in self.procs])
        self.stats = []
        for f in sorted(self.log_dir.glob("*.log")):
            for line in f.read_text().splitlines():
                if line.startswith("STATS "):
                    self.stats.append(json.loads(line[6:]))
        return self.stats


def _remove_shm_leftovers(pids: list[int]) -> None:
    """libfabric's shm provider leaves a 16 MiB file in /dev/shm per process that was killed
    (a test may SIGKILL one on purpose); remove those of our processes, all gone by now."""
    for path in shm_leftovers(pids):
        with contextlib.suppress(OSError):
            os.unlink(path)


def new_secret() -> str:
    return secrets.token_hex(32)

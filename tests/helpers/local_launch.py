"""The local launcher driven as a user drives it: `pdtool launch` (its supervisor) or the
rendered run_local.sh started in the background, on ports from a base, with their output read
line by line; and the processes a job folder's deployment left (they carry PDTOOL_RUN_DIR).
Used by the local launch and restart tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdtool.render import render


def overrides(base: int) -> list[str]:
    return ["+recipe=tiny-local", f"prefill.http_port={base}", f"decode.http_port={base + 10}",
            f"prefill.bootstrap_port={base + 20}", f"prefill.dist_init_port={base + 30}",
            f"decode.dist_init_port={base + 40}", f"router.port={base + 50}",
            "launcher.health_timeout_s=60"]


def procs_of(run_dir: Path) -> list[int]:
    """Pids of live processes started for this job folder (they carry PDTOOL_RUN_DIR)."""
    mark = f"PDTOOL_RUN_DIR={run_dir}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if mark in env and state != "Z":
            out.append(int(d.name))
    return out


def wait_gone(run_dir: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while procs_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert procs_of(run_dir) == [], "processes outlived the deployment"


class Running:
    """A launcher started in the background, its output collected line by line."""

    def __init__(self, argv: list[str], run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env, start_new_session=True)
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if text in line:
                return
        raise AssertionError(f"never saw {text!r}:\n{''.join(self.lines)}")

    def finish(self, timeout: float = 40) -> tuple[int, str]:
        try:
            rest, _ = self.p.communicate(timeout=timeout)
        finally:
            if self.p.poll() is None:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        return self.p.returncode, "".join(self.lines) + (rest or "")

    def kill_everything(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        for pid in procs_of(self.run_dir):
            os.kill(pid, signal.SIGKILL)


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return json.loads(r.read())


def worker_pid(run_dir: Path, role: str, instance: int) -> int:
    for pid in procs_of(run_dir):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"pdtool.worker" in argv and argv[argv.index(b"--role") + 1] == role.encode() \
                and argv[argv.index(b"--instance") + 1] == str(instance).encode():
            return pid
    raise AssertionError(f"no {role} {instance} worker running")


def supervisor(base: int, run_dir: Path, *extra: str) -> Running:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    keys = [e for e in extra if not e.startswith("-")]
    extra = tuple(e for e in extra if e.startswith("-"))
    return Running([sys.executable, "-m", "pdtool.cli", "launch", *overrides(base), *keys,
                    "--out", str(run_dir), "--preflight", *extra], run_dir, env)


def script(base: int, run_dir: Path, *keys: str) -> Running:
    rendered, findings = render([*overrides(base), *keys], run_dir)
    assert rendered is not None, findings
    # a stale PDTOOL_RUN_DIR in the calling shell must not move the job
    env = {**os.environ, "PDTOOL_PYTHON": sys.executable, "PDTOOL_RUN_DIR": "/nonexistent"}
    return Running(["bash", str(rendered.script), "--preflight"], run_dir, env)


STARTERS = {"supervisor": supervisor, "script": script}
STOP_SIGNAL = {"supervisor": signal.SIGINT, "script": signal.SIGTERM}

"""A real Slurm cluster on this one machine, for tests (docs/slurm.md).

Debian's `slurm-wlm` + `munge` run without systemd: one `munged` with its own socket and key in
a temporary folder, one `slurmctld`, and several `slurmd -N nodeK` that all listen on 127.0.0.1
with distinct ports, each with its own spool folder and pid file. Clients (`sbatch`, `sinfo`,
`sacct`-less `scontrol`) find it through `SLURM_CONF`, which `env()` returns.

Everything lives under one folder, so several clusters (two test sessions at once) do not
collide: ports are picked free at start-up. Start-up failures raise `SlurmStartError` with the
tail of every daemon log, so a broken CI machine says why instead of timing out.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol")
#: GPUs each emulated node declares (fake device files, see `gpu_files`)
GPUS_PER_NODE = 2
#: memory (MB) each node declares: jobs ask `--mem=0` (all of it) or an amount below it
NODE_MEMORY_MB = 2000


class SlurmStartError(RuntimeError):
    """The emulated cluster did not come up; the message holds the daemon logs."""


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class SlurmCluster:
    """Config, daemons and client environment of one emulated cluster."""

    def __init__(self, root: Path, nodes: int = 4, cpus: int = 2, gpus: int = GPUS_PER_NODE,
                 task_plugin: str = "task/affinity") -> None:
        self.root = Path(root)
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.gpus = gpus
        self.task_plugin = task_plugin
        self.hostname = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.pids: list[int] = []
        self.logs: list[Path] = []

    # -- configuration -------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, sinfo, scontrol) talking to this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def write_config(self) -> None:
        r = self.root
        for sub in ("munge", "state", "log", "run"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        user = _username()
        lines = [
            "ClusterName=pdtooltest",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'run' / 'd-%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            # binds each task to the CPUs it was given (--cpu-bind), as on a GPU site
            f"TaskPlugin={self.task_plugin}",
            "GresTypes=gpu",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU_Memory",
            "MpiDefault=none",
            "ReturnToService=2",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=600",
            "SlurmdTimeout=60",
            "SlurmctldTimeout=60",
            f"PlugStackConfig={r / 'plugstack.conf'}",
        ]
        gres = []
        for name, port in zip(self.nodes, node_ports, strict=True):
            lines.append(
                f"NodeName={name} NodeHostname={self.hostname} NodeAddr=127.0.0.1 "
                f"Port={port} CPUs={self.cpus} RealMemory={NODE_MEMORY_MB} "
                f"Gres=gpu:{self.gpus} State=UNKNOWN"
            )
            files = self.gpu_files(name)
            for f in files:
                # slurmd wants a character device and only stat()s it: /dev/null stands in
                f.parent.mkdir(parents=True, exist_ok=True)
                f.unlink(missing_ok=True)
                f.symlink_to("/dev/null")
            gres.append(f"NodeName={name} Name=gpu "
                        f"File={files[0].parent}/nvidia[0-{self.gpus - 1}]")
        (r / "gres.conf").write_text("\n".join(gres) + "\n")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        (r / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join(lines) + "\n")

    def gpu_files(self, node: str) -> list[Path]:
        """The fake GPU device files of `node` (gres.conf `File=`, links to /dev/null): Slurm
        hands a step the GPUs it allocated by index (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS)
        as on a real site."""
        return [self.root / "dev" / node / f"nvidia{g}" for g in range(self.gpus)]

    # -- daemons ---------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log: Path) -> None:
        self.logs.append(log)
        out = open(log.with_suffix(".stdout"), "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        out.close()
        self.pids.append(proc.pid)
        self._procs.append(proc)

    def start(self, timeout: float = 60.0) -> None:
        for exe in DAEMONS:
            if shutil.which(exe) is None:
                raise SlurmStartError(
                    f"{exe} not found: install Debian packages slurm-wlm and munge "
                    "(scripts/install.sh does)")
        self._procs: list[subprocess.Popen] = []
        self.write_config()
        r = self.root
        self._spawn(["munged", "--foreground", "--force",
                     f"--socket={self.munge_socket}",
                     f"--key-file={r / 'munge' / 'munge.key'}",
                     f"--pid-file={r / 'munge' / 'munged.pid'}",
                     f"--seed-file={r / 'munge' / 'munged.seed'}",
                     f"--log-file={r / 'log' / 'munged.log'}"], r / "log" / "munged.log")
        self._wait(lambda: self.munge_socket.exists(), 10, "munged socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)],
                    r / "log" / "slurmctld.log")
        for name in self.nodes:
            (r / "run" / f"d-{name}").mkdir(parents=True, exist_ok=True)
            self._spawn(["slurmd", "-D", "-N", name, "-f", str(self.conf)],
                        r / "log" / f"slurmd-{name}.log")
        self._wait(self._all_idle, timeout, "all nodes idle in sinfo")

    def _all_idle(self) -> bool:
        for proc in self._procs:
            if proc.poll() is not None:
                raise SlurmStartError(
                    f"daemon {proc.args[0]} exited with {proc.returncode}\n{self.diagnostics()}")
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(),
                             capture_output=True, text=True, timeout=10)
        if res.returncode != 0:
            return False
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.3)
        raise SlurmStartError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                              f"{self.diagnostics()}")

    def diagnostics(self) -> str:
        """Tails of every daemon log and their captured stdout/stderr."""
        parts = []
        for log in self.logs:
            for path in (log, log.with_suffix(".stdout")):
                if path.exists():
                    parts.append(f"--- {path} ---\n{_tail(path)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """`scontrol shutdown`, then end whatever of ours is left (by pid, never by name)."""
        procs = getattr(self, "_procs", [])
        if any(p.poll() is None for p in procs):
            self._cancel_jobs()
            subprocess.run(["scontrol", "shutdown"], env=self.env(), capture_output=True,
                           timeout=15, check=False)
        slurm_procs = [p for p in procs if p.args[0] != "munged"]
        _reap(slurm_procs, 10)
        _reap(procs, 5)

    def _cancel_jobs(self, timeout: float = 20) -> None:
        """Cancel every job still queued or running, so no job process outlives the cluster."""
        try:
            subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env(),
                           capture_output=True, timeout=15, check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                res = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(),
                                     capture_output=True, text=True, timeout=10, check=False)
                if res.returncode != 0 or not res.stdout.strip():
                    return
                time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    # -- helpers for tests -----------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        res = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True,
                             timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr}")
        return res.stdout

    def job_state(self, job_id: str) -> tuple[str, str]:
        """(state, exit code) of a job, from `scontrol show job` (no accounting daemon here)."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def start_requeued_now(self, job_id: str, timeout: float = 120) -> None:
        """Let a requeued batch job start again at once, as an operator would.

        slurmctld holds a requeued job PENDING (Reason=BeginTime) until now + the credential
        lifetime + 1 s (AuthInfo cred_expire, 120 s by default; slurm.conf(5): it "also
        controls how long a requeued job must wait before starting again"). Once the old run
        has finished completing (the job is PENDING, so slurmd revoked the old credential),
        `scontrol update StartTime=now` moves the begin time: the same requeued job (same id,
        SLURM_RESTART_COUNT=1) starts on the next scheduling pass."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            out = self.run("scontrol", "-o", "show", "job", job_id)
            seen = time.time()  # wall clock, as slurmd's revocation time
            fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
            if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
                # slurmd refuses a credential made in the second its predecessor was revoked
                # (`cred->ctime <= revoked`, whole seconds): a restart within that second
                # failed to launch and the job never ran again. Start in the next second.
                time.sleep(max(0.0, math.floor(seen) + 1.05 - time.time()))
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
                return
            if fields.get("JobState") == "RUNNING" and fields.get("Restarts", "0") != "0":
                return  # already started again
            time.sleep(0.2)
        raise TimeoutError(f"requeued job {job_id} never held for its begin time: {fields}\n"
                           f"{self.diagnostics()}")

    def wait_job(self, job_id: str, timeout: float = 120) -> tuple[str, str]:
        """Block until the job leaves PENDING/RUNNING/COMPLETING; returns (state, exit code)."""
        deadline = time.monotonic() + timeout
        state = ("?", "?")
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state[0] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return state
            time.sleep(0.5)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} still {state[0]} after {timeout}s\n"
                           f"{self.diagnostics()}")


def _username() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _reap(procs: list[subprocess.Popen], grace: float) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=3)


@contextmanager
def slurm_cluster(root: Path, nodes: int = 4) -> Iterator[SlurmCluster]:
    """Start an emulated cluster under `root`, yield it, always stop it."""
    cluster = SlurmCluster(root, nodes=nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()

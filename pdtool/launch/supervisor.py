"""pdtool's one supervisor: start a rendered deployment, keep it in one piece, stop it in order.

`pdtool launch` runs it in-process for launcher=local, and the rendered scripts hand over to it
(`exec python -m pdtool.launch.supervisor JOB_DIR ...`: run_local.sh, and the Slurm batch script
once it has resolved the allocation's nodes and run the site's setup), so the life cycle below
is written once. It streams status (starts, health progress, exits), waits for every instance
and then the router to be healthy, and stops everything — SIGTERM to each process, SIGKILL
after a grace period — on Ctrl-C, SIGTERM (Slurm's `--signal=B:TERM@N` before the time limit,
scancel), or when a process exits on its own or stops answering its health check
(launcher.watchdog_s) and launcher.restart does not restart its instance (pdtool.launch.restart:
`on-failure` stops that instance, waits, starts it again and waits for its health, at most
launcher.max_restarts times per instance); the router stops first, then decode, then prefill.

How a process is started and signalled is the launcher's (`LocalProcesses`, `SlurmSteps`):
locally each process starts in its own session, so stopping it also stops whatever it spawned
(SGLang's schedulers, the reference engine's TP ranks); under Slurm each is a job step, signalled
through scancel.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pdtool import fabric_check
from pdtool.launch import record, scrape, secrets, verify
from pdtool.launch.health import (
    EXIT_DIED,
    WATCHDOG_MISSES,
    HealthFailure,
    log_tail,
    wait_healthy,
    watchdog,
)
from pdtool.launch.restart import RestartPolicy, group_of
from pdtool.launch.shell import resolve
from pdtool.launch.spec import LaunchSpec, Proc
from transfer.workerenv import launch_env

#: the stop order: no new requests first, prefill last (a decode receiving KV outlives it)
STOP_ORDER = ("router", "decode", "prefill")


def prelude_env(spec: LaunchSpec, cwd: Path) -> dict[str, str]:
    """The environment every process starts with: this one, plus what launcher.setup's lines
    and the virtualenv's activate script leave behind, run once in one bash before anything
    starts, as the rendered run_local.sh runs them. A failing line is a HealthFailure naming
    it (bash's own message)."""
    if not spec.setup and not spec.venv_activate:
        return dict(os.environ)
    lines = ["set -euo pipefail", *spec.setup]
    if spec.venv_activate:
        lines += ["set +u", f"source {shlex.quote(spec.venv_activate)}", "set -u"]
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "env"
        lines.append(f"env -0 > {shlex.quote(str(dump))}")
        done = subprocess.run(["bash", "-c", "\n".join(lines)], cwd=cwd, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise HealthFailure("launcher.setup / launcher.venv failed (exit "
                                f"{done.returncode}): " + " | ".join(said), 1)
        entries = dump.read_bytes().decode(errors="surrogateescape").split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


class Stop(Exception):
    """Raised in the supervisor's thread by SIGINT/SIGTERM."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


@dataclass
class Running:
    proc: Proc
    popen: subprocess.Popen
    log: Path


class LocalProcesses:
    """launcher=local: each process in its own session (process group) with its output in its
    log file; a signal goes to the whole group, so what a worker spawned stops with it."""

    slurm = False

    def popen(self, argv: list[str], log: Path, env: dict[str, str],
              cwd: Path) -> subprocess.Popen:
        with open(log, "ab") as fh:
            return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                    cwd=cwd)

    def signal(self, procs: list[Running], sig: signal.Signals) -> None:
        for r in procs:
            _signal_group(r.popen, sig)

    def alive(self, r: Running) -> bool:
        return _group_alive(r.popen)

    def sweep(self, procs: list[Running]) -> None:
        """SIGKILL whatever is left in the processes' groups (children of a dead leader)."""
        self.signal(procs, signal.SIGKILL)


class SlurmSteps:
    """launcher=slurm: each process is an `srun ... --job-name=NAME --output=LOG` job step of
    the job `job_id` (srun writes the log; its own messages go to the batch log). A signal goes
    to the step through `scancel --signal`: srun's own handling of a SIGTERM cancels the step
    with SIGKILL at once, before the engine could stop cleanly."""

    slurm = True

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id

    def popen(self, argv: list[str], log: Path, env: dict[str, str],
              cwd: Path) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, cwd=cwd)

    def signal(self, procs: list[Running], sig: signal.Signals) -> None:
        steps = self._steps()
        for r in procs:
            step = steps.get(r.proc.name)
            if step is not None:
                subprocess.run(["scancel", f"--signal={sig.name.removeprefix('SIG')}", step],
                               capture_output=True, check=False)
            if step is None or sig == signal.SIGKILL:  # not (or no longer) a step: its srun
                with contextlib.suppress(ProcessLookupError):
                    r.popen.send_signal(sig)

    def alive(self, r: Running) -> bool:
        return r.popen.poll() is None

    def sweep(self, procs: list[Running]) -> None:
        """Nothing: a step ends with its srun."""

    def _steps(self) -> dict[str, str]:
        """Step id by step name (each step is named after its process)."""
        try:
            done = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"],
                                  capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        pairs = (line.split(None, 1) for line in done.stdout.splitlines())
        return {name.strip(): step for step, name in (p for p in pairs if len(p) == 2)}


class Supervisor:
    def __init__(self, spec: LaunchSpec, run_dir: Path, cfg: Any, plan: Any, *,
                 out: TextIO = sys.stdout, preflight: bool = False,
                 restart: RestartPolicy | None = None, hosts: list[str] | None = None,
                 node_names: list[str] | None = None, log_dir: Path | None = None,
                 setup_done: bool = False) -> None:
        """`spec` the processes; `cfg` and `plan` the job's (its launcher.* timers, verify,
        the served model, the /metrics targets); `restart`: None restarts nothing (--smoke,
        benchmarks). `hosts` / `node_names`: the address and Slurm name of each allocation
        node (this machine's for launcher=local); `log_dir`: this run's log folder (the batch
        script's, under Slurm; a fresh `logs/local-<time>-<pid>` otherwise); `setup_done`:
        the script that hands over ran launcher.setup and launcher.venv already (its
        environment is this process's)."""
        self.spec = spec
        self.runner: LocalProcesses | SlurmSteps = (
            SlurmSteps(os.environ.get("SLURM_JOB_ID", "")) if spec.launcher == "slurm"
            else LocalProcesses())
        self.cfg, self.plan = cfg, plan
        lc = cfg.launcher
        self.run_dir = Path(run_dir).resolve()
        self.out = out
        self.stop_grace = lc.stop_grace_s
        self.health_timeout = lc.health_timeout_s
        self.preflight = preflight
        self.watchdog_s = lc.watchdog_s
        self.probe_timeout_s = lc.probe_timeout_s
        self.restart = restart or RestartPolicy()
        self.setup_done = setup_done
        self.restarts: dict[str, int] = {}  # restarts so far, per instance (group_of)
        self.force = False
        self.paused = False  # pause(): every process frozen (a compared twin waits its turn)
        self.held: str | None = None  # a signal that came while a process was being started
        self.holding = False
        self.running: list[Running] = []
        self.state = "starting"  # "ready" once the router answers: running.json says which
        self.router_url = ""
        self.base_env = dict(os.environ)  # run() adds launcher.setup's and the venv's
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = log_dir or self.run_dir / "logs" / f"local-{stamp}-{os.getpid()}"
        self.hosts = hosts or ["127.0.0.1"] * spec.job.nodes
        names = node_names or ["localhost"] * spec.job.nodes
        # the variables the command lines name (pdtool.launch.spec): the job's, and the
        # environment's (SLURM_JOB_ID names the job's container, PDTOOL_PYTHON runs helpers)
        self.vars = {k: v for k, v in os.environ.items() if k in ("SLURM_JOB_ID", "PDTOOL_PYTHON")}
        self.vars.setdefault("PDTOOL_PYTHON", sys.executable)
        self.vars.update(RUN_DIR=str(self.run_dir), LOG_DIR=str(self.log_dir))
        for k in range(spec.job.nodes):
            self.vars[f"HOSTS[{k}]"] = self.hosts[k]
            self.vars[f"NODE_NAMES[{k}]"] = names[k]

    @classmethod
    def for_job(cls, rendered: Any, out: TextIO = sys.stdout, preflight: bool = False,
                restart: RestartPolicy | None = None) -> Supervisor:
        """The supervisor of a job just rendered (`pdtool.render.Rendered`): what `pdtool
        launch` and `pdtool bench` run."""
        return cls(rendered.spec, rendered.out, rendered.cfg, rendered.plan, out=out,
                   preflight=preflight, restart=restart)

    def say(self, msg: str) -> None:
        print(f"[pdtool {time.strftime('%H:%M:%S')}] {msg}", file=self.out, flush=True)

    # -- processes -------------------------------------------------------------------------
    def start(self, p: Proc) -> Running:
        argv = resolve(p.argv, self.vars)
        log = Path(resolve([p.log], self.vars)[0])
        env = {**self.base_env, **launch_env(
            run_dir=str(self.run_dir), secret_file=str(self.run_dir / "secret.key"),
            hosts=self.hosts, preflight=self.preflight)}
        with self._signals_held():
            try:
                popen = self.runner.popen(argv, log, env, self.run_dir)
            except OSError as e:
                raise HealthFailure(f"cannot start {p.name}: {argv[0]}: {e.strerror}", 1) from e
            r = Running(p, popen, log)
            self.running.append(r)
            self._record()
        self.say(f"started {p.name} (pid {popen.pid}, log {log})")
        return r

    def _record(self) -> None:
        """Rewrite running.json: what `pdtool status / logs / stop` read from another shell
        (on this machine: a Slurm job's processes are the cluster's, seen with squeue)."""
        if self.runner.slurm:
            return
        record.write(record.Record(
            run_dir=str(self.run_dir), supervisor_pid=os.getpid(), state=self.state,
            router_url=self.router_url, log_dir=str(self.log_dir),
            procs=[record.ProcRecord(r.proc.name, r.proc.role, r.popen.pid, str(r.log),
                                      resolve([r.proc.health], self.vars)[0]
                                      if r.proc.health else "")
                   for r in self.running]))

    @contextlib.contextmanager
    def _signals_held(self) -> Iterator[None]:
        """Hold SIGINT/SIGTERM while a process is started and recorded: a Stop raised between
        the two would leave it running unrecorded (in its own session: an orphan holding its
        ports). A signal that came meanwhile is raised once the record is made."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        held, self.held = self.held, None
        if held is not None:
            raise Stop(held)

    def dead(self) -> list[tuple[str, str, str]]:
        out = []
        for r in self.running:
            rc = r.popen.poll()
            if rc is not None:
                out.append((r.proc.name, _status(rc), str(r.log)))
        return out

    def pause(self) -> None:
        """Freeze every process of the deployment (SIGSTOP to each group): a compared
        deployment on the same CPUs waits out another's measured round without spending any
        of its CPU time (NIXL's idle progress threads take two cores, measured)."""
        self.paused = True
        self.runner.signal([r for r in self.running if r.popen.poll() is None], signal.SIGSTOP)

    def resume(self) -> None:
        """Undo `pause`."""
        if self.paused:
            self.paused = False
            self.runner.signal([r for r in self.running if r.popen.poll() is None],
                               signal.SIGCONT)

    def stop_all(self) -> None:
        """Stop the router first, then decode, then prefill."""
        alive = [r for r in self.running if r.popen.poll() is None]
        if not alive:
            return
        self.resume()  # a frozen process would hold its SIGTERM until the SIGKILL
        self.say(f"stopping {len(alive)} process(es): router, then decode, then prefill")
        for group in STOP_ORDER:
            self._stop_group([r for r in alive if r.proc.role == group])
        self.runner.sweep(self.running)  # children that outlived their leader

    def _stop_group(self, alive: list[Running]) -> None:
        if not alive:
            return
        for r in alive:
            self.say(f"stopping {r.proc.name}")
        self.runner.signal(alive, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        # wait for whole process groups: what a worker spawned must be gone too
        while (any(self.runner.alive(r) for r in alive) and time.monotonic() < deadline
               and not self.force):
            time.sleep(0.1)
        late = [r for r in alive if self.runner.alive(r)]
        for r in late:
            why = "second interrupt" if self.force else \
                f"did not stop within {self.stop_grace:g}s"
            self.say(f"{r.proc.name} {why}: SIGKILL")
        if late:
            self.runner.signal(late, signal.SIGKILL)
        for r in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.popen.wait(timeout=5)

    # -- the run ---------------------------------------------------------------------------
    def _fetch(self) -> None:
        """launcher.model_cache: the Hub model fetched (or found) once, with the prefill
        role's secrets (a gated model's HF_TOKEN), then with launcher.stage_to copied to each
        node's disk, verified (under Slurm one task per node), before any worker starts."""
        for key, argv, what in (("launcher.model_cache", self.spec.fetch, "fetched"),
                                ("launcher.stage_to", self.spec.stage, "staged")):
            if not argv:
                continue
            self.say(f"{key}: the model weights" + (" to every node's disk" if
                                                    key == "launcher.stage_to" else ""))
            done = subprocess.run(resolve(argv, self.vars), env=self.base_env,
                                  cwd=self.run_dir, stdin=subprocess.DEVNULL,
                                  stdout=self.out if self.out is sys.stderr else None,
                                  check=False)
            if done.returncode:
                raise HealthFailure(f"{key}: the model weights could not be {what} (see "
                                    "above)", EXIT_DIED)

    def _health(self, procs: list[Proc]) -> None:
        # preflight workers run no router: its worker list does not exist then
        urls = {p.name: (p.health if self.preflight else p.ready) or p.health for p in procs}
        endpoints = {n: resolve([u], self.vars)[0] for n, u in urls.items() if u}
        wait_healthy(endpoints, self.dead, self.health_timeout, out=self.out)

    def run(self, exit_when_healthy: bool = False,
            smoke: Callable[[str], int] | None = None, task: str = "smoke") -> int:
        """Start, wait for health, then supervise until a signal or a process exits.
        `smoke(router_url)` (launch --smoke, or `task` bench) runs once healthy; its status
        ends the run."""
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def raise_stop(signum, _frame):
            if self.holding:  # start(): raised once the new process is recorded
                self.held = signal.Signals(signum).name
                return
            raise Stop(signal.Signals(signum).name)

        for s in old:
            signal.signal(s, raise_stop)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.say(f"logs in {self.log_dir}")
            if not self.setup_done:
                self.base_env = prelude_env(self.spec, self.run_dir)
            gone = secrets.missing(self.run_dir, self.spec.secret_roles)
            if gone:
                raise HealthFailure(gone, 1)
            try:
                secrets.ensure_key(self.run_dir)
            except OSError as e:
                raise HealthFailure(f"the job's control-plane key {self.run_dir / secrets.KEY_FILE}"
                                    f": {e.strerror or e}", 1) from None
            if not self.preflight:
                self._fetch()
            scrape.write_or_warn(self.run_dir, self.cfg, self.plan, self.hosts)
            if self.preflight:  # this run's fabric check measures afresh
                shutil.rmtree(self.run_dir / fabric_check.FOLDER, ignore_errors=True)
            for p in self.spec.procs:
                self.start(p)
            self._health(self.spec.procs)
            if self.preflight:
                for r in fabric_check.results(self.run_dir):
                    self.say(f"fabric check: {r['src']} ({r['src_nic']}) -> {r['dst']} "
                             f"({r['dst_nic']}): {r['gbps']:g} Gbit/s")
            for p in self.spec.router:
                self.start(p)
            self._health(self.spec.router)
            url = resolve([self.spec.router_url], self.vars)[0]
            if self.cfg.launcher.verify and not self.preflight:  # healthy, not yet serving
                try:
                    verify.run(self.cfg, self.plan, self.hosts, say=self.say)
                except verify.VerifyFailed as e:
                    print(f"pdtool: ERROR: launcher.verify: {e}", file=sys.stderr, flush=True)
                    return 1
            self.state, self.router_url = "ready", url
            self._record()
            self.say(f"deployment ready: router at {url}; {len(self.running)} processes "
                     "(Ctrl-C stops everything)")
            width = max(len(r.proc.name) for r in self.running)
            for r in self.running:
                print(f"  {r.proc.name:<{width}}  pid {r.popen.pid:<7}  {r.log}",
                      file=self.out, flush=True)
            model = self.cfg.model.name
            if model and smoke is None and not self.preflight:
                body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16})
                print(f"  model {model!r}; try:\n    curl -s {url}/v1/completions -H "
                      f"'Content-Type: application/json' -d '{body}'", file=self.out, flush=True)
            if smoke is not None:
                code = smoke(url)
                if code == 0 and self.dead():
                    code = 1
                    print(f"pdtool: ERROR: a process died during the {task} run",
                          file=sys.stderr, flush=True)
                self.say(f"{task} {'passed' if code == 0 else 'FAILED'}: stopping")
                return code
            if exit_when_healthy:
                self.say("stopping after a healthy start (--exit-when-healthy)")
                return 0
            return self.watch()
        except HealthFailure as e:
            print(f"pdtool: ERROR: {e}", file=sys.stderr, flush=True)
            return 1
        except Stop as e:
            self.say(f"received {e.signame}: shutting the deployment down")
            return 130
        finally:
            def force(_signum, _frame):  # a second Ctrl-C: do not wait for the grace period
                self.force = True

            for sig in old:
                signal.signal(sig, force)
            try:
                self.stop_all()
                removed = secrets.remove(self.run_dir)  # the folder keeps none once stopped
                if removed:
                    self.say(f"removed the job's secrets: {' '.join(removed)}")
                if self.running:
                    self.say("stopped: every process of the deployment has exited")
            finally:
                record.remove(self.run_dir)
                secrets.remove(self.run_dir)  # (again, silently, should stopping have failed)
                for s, h in old.items():
                    signal.signal(s, h)

    def watch(self, poll: float = 0.5) -> int:
        """Block until a process exits, or (launcher.watchdog_s) one stops answering its
        health check although it runs; restart its instance when launcher.restart allows,
        else report it (the others are stopped by `run`)."""
        while True:
            group, why = self._next_failure(poll)
            n = self.restarts.get(group, 0)
            if not self.restart.enabled:
                print(f"pdtool: ERROR: {why}", file=sys.stderr, flush=True)
                return 1
            if n >= self.restart.max_restarts:
                print(f"pdtool: ERROR: {why}\n{group} was restarted {n} times already "
                      f"(launcher.max_restarts={self.restart.max_restarts}): stopping",
                      file=sys.stderr, flush=True)
                return 1
            print(f"pdtool: WARNING: {why}", file=sys.stderr, flush=True)
            self.restart_group(group, n + 1)

    def _next_failure(self, poll: float) -> tuple[str, str]:
        """(restart unit, what happened with the log tail) of the next failed process."""
        if self.watchdog_s > 0:
            endpoints = {r.proc.name: resolve([r.proc.health], self.vars)[0]
                         for r in self.running if r.proc.health}
            logs = {r.proc.name: str(r.log) for r in self.running}
            hung = watchdog(endpoints, logs, self.watchdog_s, WATCHDOG_MISSES, out=self.out,
                            stop=lambda: bool(self.dead()),
                            probe_timeout=self.probe_timeout_s)
            if hung is not None and not self.dead():
                return group_of(hung.name), str(hung)
        while True:
            gone = self.dead()
            if gone:
                name, status, log = gone[0]
                return group_of(name), (f"{name} exited ({status}); last lines of {log}:\n"
                                        f"{log_tail(log)}")
            time.sleep(poll)

    def restart_group(self, group: str, n: int) -> None:
        """Stop every process of `group` (an instance's ranks, or the router), wait the
        back-off, start them again with the same command lines and wait for their health.
        One that dies again is left to `watch` (the next restart); a timeout ends the run."""
        self.restarts[group] = n
        victims = [r for r in self.running if group_of(r.proc.name) == group]
        self._stop_group([r for r in victims if self.runner.alive(r)])
        self.runner.sweep(victims)  # what the dead leader spawned
        self.running = [r for r in self.running if r not in victims]
        delay = self.restart.delay(n)
        self.say(f"restarting {group} in {delay:g}s (restart {n} of "
                 f"{self.restart.max_restarts})")
        time.sleep(delay)
        procs = [r.proc for r in victims]
        for p in procs:
            if not self.runner.slurm:  # (srun opens a step's log itself)
                log = Path(resolve([p.log], self.vars)[0])
                with open(log, "a") as fh:
                    fh.write(f"\n[pdtool {time.strftime('%H:%M:%S')}] restart {n} of "
                             f"{p.name}\n")
            self.start(p)
        try:
            self._health(procs)
        except HealthFailure as e:
            if e.code != EXIT_DIED:
                raise
            self.say(f"{group} did not come back: a process exited (see below)")
            return
        self.say(f"{group} is serving again (restart {n})")


def _status(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def _group_alive(popen: subprocess.Popen) -> bool:
    """True while the leader runs or any process is left in its process group."""
    popen.poll()  # reap the leader if it exited
    try:
        os.killpg(popen.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def job_task(sup: Supervisor, argv: list[str], log_dir: Path) -> Callable[[str], int]:
    """launcher.benchmark inside the job: `pdtool bench` against the healthy deployment, with
    every process watched meanwhile (one that exits ends the run, and the benchmark, with 1)."""

    def task(_url: str) -> int:
        sup.say(f"benchmark: pdtool bench, results in {log_dir / 'bench'}")
        bench = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd=sup.run_dir)
        try:
            while bench.poll() is None:
                gone = sup.dead()
                if gone:
                    name, status, log = gone[0]
                    bench.terminate()
                    print(f"pdtool: ERROR: {name} exited ({status}) during the benchmark; see "
                          f"{log}", file=sys.stderr, flush=True)
                    return 1
                time.sleep(1)
        finally:
            if bench.poll() is None:
                bench.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    bench.wait(timeout=30)
        sup.say(f"benchmark finished (status {bench.returncode}): stopping the deployment")
        return bench.returncode

    return task


def from_job_folder(run_dir: Path, *, hosts: list[str] | None, node_names: list[str] | None,
                    log_dir: Path | None, preflight: bool, setup_done: bool,
                    out: TextIO = sys.stdout) -> tuple[Supervisor, Callable[[str], int] | None]:
    """The supervisor of a rendered job folder: its processes exactly as launch.json lists them
    (what was rendered and shown), its timers, restart policy, verify and benchmark from
    config.yaml and plan.json. Also the job's benchmark task."""
    from pdtool.compose import load_job_config
    from pdtool.launch.benchmark import benchmark_argv
    from pdtool.launch.spec import spec_from_dict
    from pdtool.plan import from_json

    cfg, plan = load_job_config(run_dir), from_json((run_dir / "plan.json").read_text())
    try:
        spec = spec_from_dict(json.loads((run_dir / "launch.json").read_text()))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{run_dir / 'launch.json'} was not written by this pdtool version "
                         f"({type(e).__name__}: {e}): render the job again") from None
    sup = Supervisor(spec, run_dir, cfg, plan, out=out, preflight=preflight,
                     restart=RestartPolicy.of(cfg.launcher), hosts=hosts,
                     node_names=node_names, log_dir=log_dir, setup_done=setup_done)
    bench = benchmark_argv(cfg, spec)
    task = job_task(sup, resolve(bench, sup.vars), sup.log_dir) if bench and not preflight \
        else None
    return sup, task


def main(argv: list[str] | None = None) -> int:
    """`python -m pdtool.launch.supervisor JOB_DIR [--preflight] [--exit-when-healthy]`: what
    the rendered scripts hand over to (the Slurm batch script adds the allocation's nodes and
    its log folder)."""
    import argparse

    from pdtool.compose import ComposeError

    ap = argparse.ArgumentParser(prog="python -m pdtool.launch.supervisor")
    ap.add_argument("job_dir", type=Path)
    ap.add_argument("--preflight", action="store_true")
    ap.add_argument("--exit-when-healthy", action="store_true")
    ap.add_argument("--hosts", nargs="+", help="address of each allocation node (Slurm)")
    ap.add_argument("--node-names", nargs="+", help="Slurm name of each allocation node")
    ap.add_argument("--log-dir", type=Path, help="this run's log folder (Slurm)")
    ap.add_argument("--setup-done", action="store_true",
                    help="launcher.setup and launcher.venv ran in the script that hands over")
    args = ap.parse_args(argv)
    try:
        sup, task = from_job_folder(args.job_dir.resolve(), hosts=args.hosts,
                                    node_names=args.node_names, log_dir=args.log_dir,
                                    preflight=args.preflight, setup_done=args.setup_done)
    except (OSError, ValueError, ComposeError) as e:
        print(f"pdtool: ERROR: {e}", file=sys.stderr, flush=True)
        secrets.remove(args.job_dir)
        return 1
    return sup.run(exit_when_healthy=args.exit_when_healthy, smoke=task, task="benchmark")


if __name__ == "__main__":
    sys.exit(main())

"""A rendered deployment submitted to a real Slurm cluster (4 emulated nodes on this machine).

The workers run the worker entry's start-up path (`--preflight`: load the plan, resolve rank,
NIC and environment, check the node, serve health) and the job stops after a healthy start.
The logs must show every process on the node the plan assigned, and the job COMPLETED; a worker
that cannot start makes the job FAILED with a message naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdtool import fabric_check
from pdtool.plan import from_json

#: prefill TP2 spans nodes 0-1 (one "GPU" per node), decode instances on nodes 2 and 3
OVERRIDES = [
    "+recipe=tiny-local", "launcher=slurm", "transfer=tcp", "cluster.nodes=4",
    "cluster.one_host=true",  # the emulated nodes are this machine: loopback reaches them
    "cluster.gpus_per_node=1", "cluster.gpu_numa=[0]", "prefill.tp=2", "prefill.nodes=2",
    "decode.instances=2", "prefill.http_port=26100", "decode.http_port=26200",
    "prefill.bootstrap_port=26150", "prefill.dist_init_port=26160", "decode.dist_init_port=26260",
    "router.port=26300", "launcher.health_timeout_s=120",
]


def launch(slurm, out: Path, *extra: str) -> str:
    # leftovers in the submitting shell change nothing: the options travel as the script's
    # arguments and the job folder is the rendered one
    env = {**slurm.env(), "PDTOOL_RUN_DIR": str(out.parent / "elsewhere"),
           "PDTOOL_PREFLIGHT": "0", "PDTOOL_EXIT_WHEN_HEALTHY": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", *OVERRIDES, *extra, "--out", str(out),
         "--preflight", "--exit-when-healthy"],
        env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.search(r"submitted job (\d+)", res.stdout)
    assert m, res.stdout
    assert str(out / "logs" / m.group(1)) in res.stdout  # tells the user where the logs are
    return m.group(1)


def startup_lines(log_dir: Path) -> dict[str, dict[str, str]]:
    out = {}
    for log in sorted(log_dir.glob("*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("pdtool-worker: start "):
                out[log.stem] = dict(kv.split("=", 1) for kv in line.split()[2:])
    return out


def process_names(plan, engine: str) -> dict[str, tuple[str, int]]:
    """Process name -> (role, allocation node): SGLang runs one process per instance node,
    the reference engine one per rank."""
    expected = {}
    for inst in plan.instances:
        for r in inst.ranks:
            tag = f"n{r.node_rank}" if engine == "sglang" else f"r{r.rank}"
            expected[f"{inst.name}.{tag}"] = (inst.role, r.node)
    expected["router"] = ("router", plan.router.node)
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["reference", "sglang"])
def test_job_places_each_role_on_its_node_group(engine: str, slurm, tmp_path: Path) -> None:
    out = tmp_path / "job"
    # SGLang needs GPUs: the emulated nodes pose as a GPU cluster (--preflight loads no engine);
    # it loads weights, so the built-in model's seed goes
    gpu = ["cluster.device=cuda", "model.seed=0"] if engine == "sglang" else []
    job = launch(slurm, out, "launcher.job_name=pdtool-ok", f"engine={engine}", *gpu)
    state, code = slurm.wait_job(job, timeout=180)
    batch = (out / "logs" / f"slurm-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), batch
    plan = from_json((out / "plan.json").read_text())
    assert plan.nodes == 4
    names = re.search(r"job \d+: nodes (\S+) (\S+) (\S+) (\S+) ", batch).groups()
    lines = startup_lines(out / "logs" / job)
    # every planned process started, on the node the plan assigned
    expected = process_names(plan, engine)
    assert set(lines) == set(expected), batch
    for name, (role, node) in expected.items():
        got = lines[name]
        assert got["role"] == role
        assert got["node"] == names[node], f"{name} ran on {got['node']}, plan: {names[node]}"
        assert got["plan_node"] == str(node)
    groups = {role: {lines[n]["node"] for n, (r, _) in expected.items() if r == role}
              for role in ("prefill", "decode")}
    assert groups == {"prefill": {names[0], names[1]}, "decode": {names[2], names[3]}}
    # rank, NIC and fabric environment resolved from the plan
    second = "prefill-0.n1" if engine == "sglang" else "prefill-0.r1"
    assert lines[second]["ranks"] == "1" and lines[second]["node_rank"] == "1"
    decode = "decode-1.n0" if engine == "sglang" else "decode-1.r0"
    assert lines[decode]["nics"] == "lo"
    assert lines[decode]["FI_PROVIDER"] == "-"  # tcp;ofi_rxm: provider via PDTOOL_*
    assert "deployment ready" in batch and f"healthy: {decode}" in batch
    # the fabric check: each prefill rank (nodes 0 and 1) wrote into both decode instances
    # (nodes 2 and 3) before any of them reported healthy, through the job folder
    rows = fabric_check.results(out)
    assert sorted((r["src"], r["dst"]) for r in rows) == sorted(
        (f"prefill-0 rank {p}", f"decode-{d} rank 0") for p in (0, 1) for d in (0, 1)), batch
    assert all(r["gbps"] > 0 and r["src_nic"] == r["dst_nic"] == "lo" for r in rows)
    assert "stopping after a healthy start" in batch
    assert not (out.parent / "elsewhere").exists()
    # stopped with SIGTERM (scancel --signal), not killed: every worker says so
    for log in (out / "logs" / job).glob("*.log"):
        assert "pdtool-worker: stopped" in log.read_text(), log


@pytest.mark.slow
def test_worker_that_cannot_start_fails_the_job(slurm, tmp_path: Path) -> None:
    """decode-1's port is taken: its worker exits, the job ends FAILED and says which and why."""
    out = tmp_path / "job"
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", 26201))
    blocker.listen()
    try:
        job = launch(slurm, out, "launcher.job_name=pdtool-fail")
        state, _ = slurm.wait_job(job, timeout=180)
    finally:
        blocker.close()
    batch = (out / "logs" / f"slurm-{job}.out").read_text()
    assert state == "FAILED", batch
    assert "pdtool: ERROR: decode-1.r0 exited" in batch
    assert "before the deployment was healthy" in batch
    assert "cannot serve health on 127.0.0.1:26201" in batch
    # the other workers were stopped with the job: no step of it is left
    steps = slurm.run("squeue", "-h", "-s", "-j", job, check=False)
    assert steps.strip() == ""
    assert not os.environ.get("PDTOOL_PREFLIGHT")


#: a GPU site: 2 GPUs per node (the emulated nodes' fake devices), GPU g on CPU g; prefill TP2
#: on node 0, two TP1 decode instances packed on node 1
GPU_SITE = [
    "+recipe=tiny-local", "launcher=slurm", "engine=sglang", "model.seed=0", "transfer=tcp",
    "cluster.nodes=2", "cluster.one_host=true",
    "cluster.device=cuda", "cluster.gpus_per_node=2", "cluster.gpu_numa=[0,0]",
    "cluster.numa_cpus=[0-1]", "prefill.tp=2", "decode.instances=2",
    "prefill.http_port=26400", "decode.http_port=26500", "prefill.bootstrap_port=26450",
    "prefill.dist_init_port=26460", "decode.dist_init_port=26560", "router.port=26600",
    "launcher.health_timeout_s=120",
]


@pytest.mark.slow
@pytest.mark.parametrize(("directive", "extra", "asks"), [
    ("gpus-per-node", [], "--gpus-per-node=2"),
    ("gres", [], "--gres=gpu:2"),
    ("none", ["--gres=gpu:2"], "--gres=gpu:2"),  # the site's own option
])
def test_each_step_sees_its_gpus_and_cpus(slurm, tmp_path: Path, directive, extra,
                                          asks) -> None:
    """From inside every step: the job's GPUs of its node (Slurm's GRES environment: a step
    asks none and inherits the job's, however the job asked: launcher.gpu_directive, or the
    site's option in sbatch_extra), every CPU of its node (the preset here describes a node of
    192 CPUs, this one has 2: the job asks for none by count), and each worker bound to its
    ranks' share of the node's own CPUs."""
    from helpers.slurm_cluster import GPUS_PER_NODE, NODE_MEMORY_MB

    assert asks.endswith(str(GPUS_PER_NODE))

    out, probes = tmp_path / "job", tmp_path / "probes"
    probes.mkdir()
    probe = Path(__file__).parent / "helpers" / "step_probe.py"
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", *GPU_SITE, f"engine.python={probe}",
         f"+launcher.env.all.STEP_PROBE_DIR={probes}", "launcher.job_name=pdtool-gpus",
         f"launcher.gpu_directive={directive}",
         f"launcher.sbatch_extra=[{','.join(repr(e) for e in extra)}]",
         "cluster.numa_cpus=[0-191]", "--out", str(out), "--preflight", "--exit-when-healthy"],
        env=slurm.env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    state = slurm.wait_job(job, timeout=240)
    batch = (out / "logs" / f"slurm-{job}.out").read_text()
    assert state == ("COMPLETED", "0:0"), batch
    header = (out / "job.sbatch").read_text()
    for opt in ("--ntasks-per-node=1", "--exclusive", "--mem=0", asks):
        assert f"#SBATCH {opt}\n" in header
    assert header.count("#SBATCH --g") == 1  # one GPU request
    plan = from_json((out / "plan.json").read_text())
    # --mem=0: the job holds every node's whole memory (without it, only the default)
    shown = slurm.run("scontrol", "-o", "show", "job", job)
    tres = dict(kv.split("=", 1) for kv in re.search(r"\bTRES=(\S+)", shown).group(1).split(","))
    assert tres["mem"] == f"{NODE_MEMORY_MB * plan.nodes}M"
    assert f"TresPerNode=gres:gpu:{GPUS_PER_NODE}" in shown
    # the plan's forecast from the preset; the node has 2 CPUs on its one NUMA node
    assert {r.cpus for i in plan.instances for r in i.ranks} == {"0-95", "96-191"}
    want_cpus = {"prefill-0.n0": "0-1", "decode-0.n0": "0", "decode-1.n0": "1"}
    seen = {}
    for f in probes.glob("*.json"):
        rec = json.loads(f.read_text())
        if "pdtool.worker" not in rec["argv"]:
            continue  # the batch script's health helper runs through the same interpreter
        argv = rec["argv"]
        role = argv[argv.index("--role") + 1]
        name = "router" if role == "router" else \
            f"{role}-{argv[argv.index('--instance') + 1]}.n{argv[argv.index('--node-rank') + 1]}"
        seen[name] = rec
    assert set(seen) == {*want_cpus, "router"}
    for name, rec in seen.items():
        env = rec["env"]
        assert env["SLURM_JOB_ID"] == job and env["SLURM_STEP_ID"] != "batch"
        if name == "router":
            assert rec["cpus_allowed"] == "0-1"  # --cpu-bind=none: the whole node
            continue
        # every GPU of the node, so the plan's GPU ids are the CUDA ordinals (--base-gpu-id)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1", name
        assert env["SLURM_STEP_GPUS"] == "0,1", name
        assert rec["cpus_allowed"] == "0-1", name  # the step holds the whole node
        log = (out / "logs" / job / f"{name}.log").read_text()
        assert f"pdtool-worker: CPUs from the node: {want_cpus[name]} (the preset gave " in log


def submit_running(slurm, out: Path, *extra: str) -> str:
    """Launch the OVERRIDES deployment (preflight workers) and leave it running."""
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", *OVERRIDES, *extra, "--out", str(out),
         "--preflight"], env=slurm.env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    batch = out / "logs" / f"slurm-{job}.out"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if batch.exists() and "deployment ready" in batch.read_text():
            return job
        if slurm.job_state(job)[0] not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.5)
    raise AssertionError(batch.read_text() if batch.exists() else f"job {job} never started")


@pytest.mark.slow
def test_term_before_the_time_limit_stops_every_step_in_order(slurm, tmp_path: Path) -> None:
    """What `#SBATCH --signal=B:TERM@120` delivers before the time limit (here sent at once):
    the router stops first, then decode, then prefill, each with SIGTERM."""
    out = tmp_path / "job"
    job = submit_running(slurm, out, "launcher.job_name=pdtool-term")
    assert f"#SBATCH --signal=B:TERM@{3 * 30 + 30}\n" in (out / "job.sbatch").read_text()
    slurm.run("scancel", "--batch", "--signal=TERM", job)
    slurm.wait_job(job, timeout=180)
    batch = (out / "logs" / f"slurm-{job}.out").read_text()
    assert "received SIGTERM" in batch
    order = [m.group(1) for m in re.finditer(r"\] stopping (\S+)$", batch, re.M)]
    assert order == ["router", "decode-0.r0", "decode-1.r0", "prefill-0.r0", "prefill-0.r1"], \
        batch
    for log in (out / "logs" / job).glob("*.log"):
        assert "pdtool-worker: stopped" in log.read_text(), log  # SIGTERM, not SIGKILL
    assert "SIGKILL" not in batch
    # the ended job's folder keeps no secret
    assert "removed the job's secrets: secret.key" in batch
    assert not [f.name for f in out.iterdir() if f.name.startswith("secret")]


def _step_worker_pid(job: str, role: str, instance: int) -> int:
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit():
                continue
            env = dict(e.split(b"=", 1) for e in (d / "environ").read_bytes().split(b"\0")
                       if b"=" in e)
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the worker itself (python -m pdtool.worker), not the srun that carries the same argv
        if (env.get(b"SLURM_JOB_ID") == job.encode() and argv[1:3] == [b"-m", b"pdtool.worker"]
                and argv[argv.index(b"--role") + 1] == role.encode()
                and argv[argv.index(b"--instance") + 1] == str(instance).encode()):
            return int(d.name)
    raise AssertionError(f"no {role}-{instance} worker of job {job}")


@pytest.mark.slow
def test_hung_engine_ends_the_job(slurm, tmp_path: Path) -> None:
    """decode-1 stops answering although its process lives (SIGSTOP): the watchdog ends the
    job (launcher.restart=never), naming it with the end of its log; the stopped step ignores
    the stop's SIGTERM and is killed launcher.stop_grace_s later."""
    out = tmp_path / "job"
    job = submit_running(slurm, out, "launcher.job_name=pdtool-hang", "launcher.watchdog_s=1",
                         "launcher.probe_timeout_s=1",
                         "launcher.restart=never", "launcher.stop_grace_s=2")
    pid = _step_worker_pid(job, "decode", 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        state, _ = slurm.wait_job(job, timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    batch = (out / "logs" / f"slurm-{job}.out").read_text()
    assert state == "FAILED", batch
    assert "decode-1.r0 stopped answering" in batch
    assert "pdtool-worker: start" in batch  # its log tail
    assert "decode-1.r0 did not stop within 2s: SIGKILL" in batch


def _wait_batch(batch: Path, text: str, after: int = 0, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = batch.read_text()
        if text in got[after:]:
            return got
        time.sleep(0.5)
    raise AssertionError(f"never saw {text!r}:\n{batch.read_text()}")


@pytest.mark.slow
def test_a_dead_step_is_restarted_inside_the_job(slurm, tmp_path: Path) -> None:
    """launcher.restart=on-failure: decode-1's worker is killed, its srun step ends, the job's
    supervisor starts the step again (same name, same node) and waits for its health;
    prefill-0's rank 1 is killed next: the whole TP2 instance (both steps) is restarted. The
    job keeps running; a TERM then stops it in order as usual."""
    out = tmp_path / "job"
    job = submit_running(slurm, out, "launcher.job_name=pdtool-restart",
                         "launcher.restart=on-failure", "launcher.restart_backoff_s=0.5")
    batch = out / "logs" / f"slurm-{job}.out"
    try:
        old = _step_worker_pid(job, "decode", 1)
        os.kill(old, signal.SIGKILL)
        text = _wait_batch(batch, "decode-1 is serving again (restart 1)")
        assert "decode-1.r0 exited" in text and "restarting decode-1 in 0.5s" in text
        assert _step_worker_pid(job, "decode", 1) != old
        steps = slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%j %N", check=False)
        assert "decode-1.r0" in steps, steps
        mark = len(text)
        os.kill(_step_worker_pid(job, "prefill", 0), signal.SIGKILL)  # one of its two ranks
        text = _wait_batch(batch, "prefill-0 is serving again (restart 1)", after=mark)
        restarted = [m.group(1) for m in re.finditer(r"\] started (\S+) ", text[mark:])]
        assert restarted == ["prefill-0.r0", "prefill-0.r1"], text[mark:]
        assert slurm.job_state(job)[0] == "RUNNING"
        logs = (out / "logs" / job / "decode-1.r0.log").read_text()
        assert logs.count("pdtool-worker: start ") == 2  # one log, both runs
    finally:
        slurm.run("scancel", "--batch", "--signal=TERM", job, check=False)
        slurm.wait_job(job, timeout=180)
    assert "received SIGTERM" in batch.read_text()


@pytest.mark.slow
def test_launch_multirun_submits_one_job_per_combination(slurm, tmp_path: Path) -> None:
    over = [o for o in OVERRIDES if not o.startswith("decode.instances=")]
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", "-m", *over, "decode.instances=1,2",
         "launcher.job_name=pdtool-sweep", "--out", str(tmp_path / "sweep"), "--preflight",
         "--exit-when-healthy"],
        env={**slurm.env(), "COLUMNS": "250"}, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    jobs = re.findall(r"^submitted job (\d+) for run (\d+): (\S+)$", res.stdout, re.M)
    assert [(run, folder) for _, run, folder in jobs] == [
        ("0", str(tmp_path / "sweep" / "0")), ("1", str(tmp_path / "sweep" / "1"))]
    assert "2 job(s)" in res.stdout  # the table
    for (job, run, _), n in zip(jobs, (1, 2), strict=True):
        state = slurm.wait_job(job, timeout=180)
        folder = tmp_path / "sweep" / run
        assert state == ("COMPLETED", "0:0"), (folder / "logs" / f"slurm-{job}.out").read_text()
        plan = from_json((folder / "plan.json").read_text())
        assert sum(1 for i in plan.instances if i.role == "decode") == int(n)


@pytest.mark.slow
def test_requeued_job_keeps_the_earlier_logs(slurm, tmp_path: Path) -> None:
    out = tmp_path / "job"
    job = submit_running(slurm, out, "launcher.job_name=pdtool-requeue")
    first = sorted(p.name for p in (out / "logs" / job).glob("*.log"))
    slurm.run("scontrol", "requeue", job)
    slurm.start_requeued_now(job)
    batch = out / "logs" / f"slurm-{job}.out"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and batch.read_text().count("deployment ready") < 2:
        time.sleep(1)
    # where the second run stands if it never came (job and node states, daemon logs)
    why = "\n".join((slurm.run("scontrol", "-o", "show", "job", job, check=False),
                     slurm.run("sinfo", "-N", "-o", "%N %T %E", check=False),
                     slurm.diagnostics()))
    slurm.run("scancel", job, check=False)
    text = batch.read_text()
    assert text.count("deployment ready") == 2, f"{text}\n{why}"  # --open-mode=append
    assert sorted(p.name for p in (out / "logs" / job).glob("*.log")) == first
    again = out / "logs" / f"{job}.1"
    # the requeue stopped the first run, which removed the control-plane key; the second made a
    # fresh one
    assert text.count("removed the job's secrets: secret.key") >= 1, text
    assert sorted(p.name for p in again.glob("*.log")) == first
    for log in (out / "logs" / job).glob("*.log"):
        assert "pdtool-worker: start" in log.read_text()

"""The local launcher (pdtool's supervisor) and the rendered run_local.sh, with real processes:
start, wait for health, stop cleanly on a signal, tear everything down when one process dies.
Workers run the worker entry's start-up path (`--preflight`), so nothing here needs a model."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.local_launch import (
    STARTERS,
    STOP_SIGNAL,
    Running,
    health,
    overrides,
    procs_of,
    script,
    supervisor,
    wait_gone,
    worker_pid,
)

from pdtool.engines.reference.local import free_port_run
from pdtool.render import render


@pytest.mark.slow
@pytest.mark.parametrize("how", list(STARTERS))
def test_starts_waits_for_health_and_stops_on_signal(how: str, tmp_path: Path) -> None:
    base = 27000 if how == "supervisor" else 27100
    run = STARTERS[how](base, tmp_path / "job")
    try:
        run.wait_for("deployment ready")
        assert health(base)["role"] == "prefill"
        assert health(base + 10)["role"] == "decode" and health(base + 11)["role"] == "decode"
        assert health(base + 50)["role"] == "router"
        assert len(procs_of(run.run_dir)) >= 4
        key = run.run_dir / "secret.key"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        os.kill(run.p.pid, STOP_SIGNAL[how])
        code, out = run.finish()
        assert code == 130, out
        wait_gone(run.run_dir)
        # the job folder keeps no secret once the deployment stopped
        assert not key.exists() and "removed the job's secrets: secret.key" in out, out
        logs = list((run.run_dir / "logs").glob("local-*/*.log"))
        assert sorted(p.stem for p in logs) == ["decode-0.r0", "decode-1.r0", "prefill-0.r0",
                                                "router"]
        for log in logs:  # SIGTERM reached each worker, which stopped on its own
            assert "pdtool-worker: stopped" in log.read_text(), log
        assert "healthy: decode-1.r0" in out
        if how == "supervisor":  # the reference engine's KV is host memory
            assert "pdtool: preflight: GPU memory: host memory" in out
            # the last line says everything stopped
            assert "stopped: every process of the deployment has exited" in \
                out.strip().splitlines()[-1], out
    finally:
        run.kill_everything()


@pytest.mark.slow
def test_one_process_dying_stops_everything(tmp_path: Path) -> None:
    """launcher.restart=never: one process exiting ends the deployment (benchmarks)."""
    run = STARTERS["supervisor"](27200, tmp_path / "job", "launcher.restart=never")
    try:
        run.wait_for("deployment ready")
        os.kill(worker_pid(run.run_dir, "decode", 1), signal.SIGKILL)
        code, out = run.finish()
        assert code == 1, out
        assert "decode-1.r0 exited" in out
        wait_gone(run.run_dir)
    finally:
        run.kill_everything()


def signalled_supervisor(program: str, args: list[str], cue: str, delay_s: float,
                         run_dir: Path) -> tuple[int, str]:
    """Run a supervisor PROGRAM (`python -c`, the job folder and ARGS as its arguments),
    SIGTERM it DELAY_S after it printed CUE; its exit code and output, once no process of the
    job is left."""
    run = Running([sys.executable, "-c", program, str(run_dir), *args], run_dir,
                  {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        run.wait_for(cue)
        time.sleep(delay_s)
        os.kill(run.p.pid, signal.SIGTERM)
        code, out = run.finish(timeout=60)
        wait_gone(run.run_dir)
        return code, out
    finally:
        run.kill_everything()


SUPERVISED_STARTS = """
import dataclasses, sys
from pathlib import Path
from pdtool.launch.supervisor import Supervisor
from pdtool.render import render
rendered, _ = render(sys.argv[2:], Path(sys.argv[1]))
spec = rendered.spec
first = spec.procs[0]
spec.procs = [dataclasses.replace(first, name=f"prefill-0.r{n}", argv=["sleep", "600"],
                                  health=None, ready=None) for n in range(400)]
spec.router = []
sup = Supervisor.for_job(rendered)  # as `pdtool bench` builds it
print("body begins", flush=True)
sys.exit(sup.run())
"""


@pytest.mark.parametrize("delay_s", [0.02, 0.05, 0.11, 0.17, 0.23])
def test_a_signal_while_the_supervisor_starts_processes_stops_every_one(
        delay_s: float, tmp_path: Path) -> None:
    """The supervisor (`pdtool launch`) the same way: its own start-up with many quick starts
    in place of the workers, SIGTERM at any moment, no process left running."""
    code, out = signalled_supervisor(SUPERVISED_STARTS, [*overrides(27600)], "body begins",
                                     delay_s, tmp_path / "job")
    assert code == 130, out
    assert "received SIGTERM" in out, out


SUPERVISED_HEALTH_WAIT = """
import dataclasses, sys
from pathlib import Path
from pdtool.launch.shell import word
from pdtool.launch.supervisor import Supervisor
from pdtool.render import render
over = [a for a in sys.argv[3:] if not a.startswith("launcher.health_timeout_s=")]
rendered, _ = render([*over, "launcher.health_timeout_s=600"], Path(sys.argv[1]))
spec = rendered.spec
url = word(f"http://127.0.0.1:{sys.argv[2]}/health")  # nothing listens there
spec.procs = [dataclasses.replace(spec.procs[0], name="decode-0.r0", argv=["sleep", "600"],
                                  health=url, ready=None)]
spec.router = []
sys.exit(Supervisor.for_job(rendered).run())
"""


def test_a_signal_while_waiting_for_health_stops_at_once(tmp_path: Path) -> None:
    """The health wait does not delay a SIGTERM (`kill PID`, `scancel --batch`) until the
    poll ends (here: never healthy, a 600 s timeout)."""
    code, out = signalled_supervisor(SUPERVISED_HEALTH_WAIT,
                                     [str(free_port_run(1)), *overrides(27700)],
                                     "started decode-0.r0", 0.5, tmp_path / "job")
    assert code == 130, out
    assert "stopping decode-0.r0" in out, out


@pytest.mark.slow
def test_worker_that_never_comes_up_fails_clearly(tmp_path: Path) -> None:
    """A port taken once the job is rendered (`pdtool launch` refuses one taken before: the
    rendered script runs without that check, as a port taken in between would)."""
    base = 27400
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", base + 10))  # decode-0's port
    blocker.listen()
    run = script(base, tmp_path / "job")
    try:
        code, out = run.finish(timeout=60)
    finally:
        blocker.close()
        run.kill_everything()
    assert code == 1, out
    assert "decode-0.r0 exited (exit status 2) before the deployment was healthy" in out
    assert f"cannot serve health on 127.0.0.1:{base + 10}" in out
    wait_gone(run.run_dir)


def test_dry_run_prints_commands_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "job"
    res = subprocess.run([sys.executable, "-m", "pdtool.cli", "launch", *overrides(27500),
                          "launcher=slurm", "transfer=tcp", "cluster.nodes=2",
                          "cluster.one_host=true", "--dry-run",
                          "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "srun --export=ALL --nodes=1 --ntasks=1 --relative=1" in res.stdout
    assert "python3 -m pdtool.worker" in res.stdout and "--role decode --instance 1" in res.stdout
    assert "#SBATCH --nodes=2" in res.stdout  # the header too
    assert not out.exists()  # nothing ran, nothing written (no folder, no secret)


# --- the worker entry on its own -------------------------------------------------------------


def run_worker(plan: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 30):
    return subprocess.run([sys.executable, "-m", "pdtool.worker", "--plan", str(plan), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    rendered, findings = render(overrides(27600), tmp_path_factory.mktemp("w") / "job")
    assert rendered is not None, findings
    return rendered.out / "plan.json"


def test_worker_resolves_rank_from_slurm_and_checks_its_node(plan_file: Path) -> None:
    res = run_worker(plan_file, "--role", "decode", "--instance", "1", "--expect-node", "gpu7",
                     env={"SLURM_PROCID": "0", "SLURMD_NODENAME": "gpu3"})
    assert res.returncode == 2
    assert "started on node gpu3, but the plan put this process on gpu7" in res.stderr
    res = run_worker(plan_file, "--role", "decode", "--instance", "1",
                     env={"SLURM_PROCID": "5"})
    assert res.returncode == 2 and "--rank: 5 is not a rank of decode-1" in res.stderr
    res = run_worker(plan_file, "--role", "decode", "--instance", "9")
    assert res.returncode == 2 and "--instance: 9" in res.stderr
    res = run_worker(plan_file.parent / "missing.json", "--role", "decode")
    assert res.returncode == 2 and "cannot read the plan" in res.stderr
    for r in (res,):
        assert "Traceback" not in r.stderr


def test_worker_sets_fabric_environment_and_serves_health(plan_file: Path) -> None:
    p = subprocess.Popen([sys.executable, "-m", "pdtool.worker", "--plan", str(plan_file),
                          "--role", "decode", "--instance", "0", "--host", "127.0.0.1"],
                         env={**os.environ, "PDTOOL_PREFLIGHT": "1", "SLURM_PROCID": "0"},
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        fields = dict(kv.split("=", 1) for kv in line.split()[2:])
        assert fields["role"] == "decode" and fields["instance"] == "0"
        assert fields["ranks"] == "0" and fields["nics"] == "shm"
        assert fields["FI_PROVIDER"] == "shm" and fields["port"] == "27610"
        assert fields["gpu_memory"] == "host"  # reference engine: KV in host memory
        assert "preflight" in p.stdout.readline()
        # its landing buffer for the fabric check is published before health (no prefill
        # runs here: it does not wait for one)
        assert "fabric check: decode-0 rank 0 waits for 1 prefill rank(s) on shm" in \
            p.stdout.readline()
        assert "healthy" in p.stdout.readline()
        assert health(27610)["role"] == "decode"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_worker_execs_the_sglang_line_with_messenger_environment(tmp_path: Path,
                                                                 mode: str) -> None:
    """engine=sglang: the worker (real) execs the rendered SGLang line unchanged, with the plan,
    NIC and deployment secret in the environment of pdtool's SGLang backend. With
    mode=aggregated nothing moves KV: no GPU-memory path is chosen or probed."""
    from pdtool.compose import load_config
    from pdtool.launch.shell import resolve
    from pdtool.plan import build_plan
    from pdtool.render import write_job_folder

    cfg, findings = load_config([*overrides(27700), "engine=sglang", "model.seed=0", "transfer=tcp",
                                 "cluster.device=cuda", f"mode={mode}"])
    assert cfg is not None, findings
    cfg.engine.python = str(Path(__file__).parent / "helpers" / "argv_dump.py")
    rendered = write_job_folder(cfg, build_plan(cfg), tmp_path / "job")
    proc = next(p for p in rendered.spec.procs if p.role == "decode" and p.instance == 1)
    variables = {"RUN_DIR": str(rendered.out), "LOG_DIR": str(tmp_path), "HOSTS[0]": "127.0.0.1"}
    argv = resolve(proc.argv, variables)
    argv[argv.index("pdtool.worker") - 2] = sys.executable  # the worker itself runs for real
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    secret_file = rendered.out / "secret.key"
    env = {**os.environ, "ARGV_DUMP_DIR": str(dumps), "PDTOOL_SECRET_FILE": str(secret_file),
           # the node's GPUs as a Slurm step sees them (pdtool.nodecheck counts them)
           "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    env.pop("PDTOOL_SECRET", None)
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        deadline = time.monotonic() + 30
        while not list(dumps.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        (dump,) = [json.loads(f.read_text()) for f in dumps.glob("*.json")]
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=10)
    assert dump["argv"][1:] == resolve(proc.engine_argv, variables)[1:]
    e = dump["env"]
    secret = secret_file.read_text().strip()
    # the backend reads the 0600 file itself: the secret is in no environment and no output
    assert e["PDTOOL_SECRET_FILE"] == str(secret_file) and "PDTOOL_SECRET" not in e
    assert secret not in json.dumps(e) and secret not in out
    assert e["PDTOOL_ROLE"] == "decode" and e["PDTOOL_INSTANCE"] == "1"
    assert e["PDTOOL_PLAN"] == str(rendered.out / "plan.json")
    assert e["PDTOOL_FI_PROVIDER"] == "tcp;ofi_rxm" and e["PDTOOL_FI_DOMAIN"] == "lo"
    assert json.loads(e["PDTOOL_NICS"]) == {"2": "lo"}
    assert "pdtool-worker: start role=decode" in out
    if mode == "aggregated":
        assert " gpu_memory=none " in out and "transfer.gpu_memory" not in out
        assert "--disaggregation-mode" not in dump["argv"]
        return
    # tcp;ofi_rxm never registers GPU memory: auto is staged, decided without a probe
    assert " gpu_memory=staged " in out
    assert "pdtool-worker: transfer.gpu_memory=auto: staged (tcp;ofi_rxm has no FI_HMEM)" in out


class _StandInWorker:
    """An HTTP server answering what sglang-router 0.3.2 asks a worker while registering it
    (/health, /model_info, /server_info): SGLang's own servers need a GPU."""

    def __init__(self, port: int) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"model_path": "tiny", "tokenizer_path": "tiny",
                                   "is_generation": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_sglang_router_is_ready_once_every_instance_is_registered(tmp_path: Path,
                                                                  mode: str) -> None:
    """engine=sglang: the real sglang-router, started with the rendered line, answers /health
    while decode-1 is not registered; the readiness the scripts and the supervisor wait on
    (its /workers list) holds until every prefill and decode instance is, then passes. With
    mode=aggregated every instance is one of its regular workers."""
    from pdtool.launch.health import check, wait_healthy
    from pdtool.launch.shell import resolve

    base = free_port_run(60)
    rendered, findings = render([*overrides(base), "engine=sglang", "model.seed=0", "transfer=tcp",
                                 "cluster.device=cuda", f"mode={mode}"], tmp_path / "job")
    assert rendered is not None, findings
    (router,) = rendered.spec.router
    variables = {"RUN_DIR": str(rendered.out), "LOG_DIR": str(tmp_path), "HOSTS[0]": "127.0.0.1"}
    argv = resolve(router.engine_argv, variables)
    ready = resolve([router.ready], variables)[0]
    health = resolve([router.health], variables)[0]
    want, missing, stats_keys, counts = {
        "disaggregated": ("prefill=1,decode=2", "1 of 2 decode",
                          ("prefill_count", "decode_count"), (1, 2)),
        "aggregated": ("regular=3", "2 of 3 regular", ("regular_count",), (3,)),
    }[mode]
    assert ready == f"http://127.0.0.1:{base + 50}/workers#{want}"
    workers = [_StandInWorker(base), _StandInWorker(base + 10)]  # decode-1 (base + 11) is not up
    log = open(tmp_path / "router.log", "w")  # noqa: SIM115
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while check(health) or check(ready) != f"registered healthy: {missing}":
            assert p.poll() is None, (tmp_path / "router.log").read_text()
            assert time.monotonic() < deadline, (check(health), check(ready))
            time.sleep(0.5)
        assert not check(health)  # /health alone would call it ready
        workers.append(_StandInWorker(base + 11))
        wait_healthy({"router": ready}, lambda: [], timeout=120)
        with urllib.request.urlopen(ready.split("#")[0], timeout=5) as r:
            stats = json.loads(r.read())["stats"]
        assert tuple(stats[k] for k in stats_keys) == counts
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
        log.close()
        for w in workers:
            w.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["supervisor", "script"])
def test_setup_lines_and_the_virtualenv_reach_every_process(how: str, tmp_path: Path) -> None:
    """launcher.setup runs once before any process starts and launcher.venv is activated after
    it, in the supervisor (`pdtool launch`) as in the rendered run_local.sh: both shape the
    environment every worker starts with."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(
        'export VIRTUAL_ENV="$(dirname "$(dirname "${BASH_SOURCE[0]}")")"\n'
        'export PDTOOL_TEST_MARK="venv after $PDTOOL_TEST_MARK"\n')
    base = free_port_run(60)
    run = STARTERS[how](base, tmp_path / "job", f"launcher.venv={venv}",
                        "launcher.setup=['export PDTOOL_TEST_MARK=setup']")
    try:
        run.wait_for("deployment ready")
        for role, instance in (("prefill", 0), ("decode", 1)):
            pid = worker_pid(run.run_dir, role, instance)
            env = dict(e.split(b"=", 1) for e in
                       Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
            assert env[b"PDTOOL_TEST_MARK"] == b"venv after setup", (role, env)
            assert env[b"VIRTUAL_ENV"] == str(venv).encode()
        os.kill(run.p.pid, signal.SIGINT if how == "supervisor" else signal.SIGTERM)
        run.finish()
        wait_gone(run.run_dir)
    finally:
        run.kill_everything()


def test_a_failing_setup_line_stops_the_supervisor_before_anything_starts(tmp_path):
    base = free_port_run(60)
    run = supervisor(base, tmp_path / "job", "launcher.setup=['false']")
    code, out = run.finish(timeout=60)
    assert code == 1 and "launcher.setup / launcher.venv failed (exit 1)" in out, out
    assert "started" not in out


def _pdtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdtool.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_status_logs_and_stop_from_another_shell(tmp_path: Path) -> None:
    """A deployment started by `pdtool launch` in one shell is found, inspected and stopped
    from another through its job folder (running.json under launcher.output_dir); stopping
    it is Ctrl-C in its own shell: every process exits and the record goes."""
    base = free_port_run(60)
    out = tmp_path / "outputs"
    run = supervisor(base, out / "job")
    try:
        nothing = _pdtool("status", cwd=tmp_path)
        assert nothing.returncode == 1 and "no running deployment under outputs/" in \
            nothing.stderr, nothing.stderr
        run.wait_for("deployment ready")
        st = _pdtool("status", cwd=tmp_path)
        assert st.returncode == 0 and "Traceback" not in st.stderr, st.stderr
        assert f"{out / 'job'}: ready" in st.stdout and f"router http://127.0.0.1:{base + 50}" \
            in st.stdout, st.stdout
        shown = json.loads(_pdtool("status", "--json", cwd=tmp_path).stdout)
        assert [p["name"] for p in shown[0]["processes"]] == \
            ["prefill-0.r0", "decode-0.r0", "decode-1.r0", "router"]
        assert all(p["alive"] and p["health"] == "ok" for p in shown[0]["processes"]), shown
        logs = _pdtool("logs", "decode-1.r0", "-n", "0", cwd=tmp_path)
        assert logs.returncode == 0 and "pdtool-worker: start" in logs.stdout, logs.stdout
        wrong = _pdtool("logs", "decode-7", cwd=tmp_path)
        assert wrong.returncode == 1 and "its processes: prefill-0.r0, decode-0.r0" in \
            wrong.stderr, wrong.stderr
        stop = _pdtool("stop", "--job", str(out / "job"), cwd=tmp_path)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert stop.stdout.strip().splitlines()[-1] == \
            "stopped: every process of the deployment has exited"
        code, said = run.finish()
        assert code == 130 and "received SIGTERM" in said, said
        wait_gone(run.run_dir)
        assert not (out / "job" / "running.json").exists()
        gone = _pdtool("stop", cwd=tmp_path)
        assert gone.returncode == 1 and "no running deployment" in gone.stderr
    finally:
        run.kill_everything()


@pytest.mark.slow
def test_launcher_verify_stops_a_deployment_whose_tokens_are_wrong(tmp_path: Path) -> None:
    """run_local.sh with launcher.verify=2: once healthy, greedy prompts through the front are
    compared with the model computed in the script's helper. A decode that damages a received
    page of every request (the reference engine's test hook, as a faulty NIC would) answers
    HTTP 200, and the run fails naming the prompts and the first differing character, before
    it serves; the same deployment without the fault passes."""
    def run(*keys: str) -> tuple[int, str]:
        out = tmp_path / f"job{len(keys)}"
        rendered, findings = render([*overrides(27800), "launcher.verify=2", *keys], out)
        assert rendered is not None, findings
        p = subprocess.run(["bash", str(rendered.script), "--exit-when-healthy"],
                           env={**os.environ, "PDTOOL_PYTHON": sys.executable},
                           capture_output=True, text=True, timeout=300, check=False)
        wait_gone(out)
        return p.returncode, p.stdout + p.stderr

    code, out = run()
    assert code == 0, out
    assert "launcher.verify: 2 greedy prompts through the front: every text is the model's " \
        "own" in out
    code, out = run("+launcher.env.decode.PDTOOL_REFERENCE_ALLOW_FAULTS=1",
                    "+launcher.env.decode.PDTOOL_REFERENCE_CORRUPT_PAGE='0,0'")
    assert code == 1, out
    assert "launcher.verify: 2 of 2 outputs differ from the model: prompt 0 through the " \
        "front: differs from the model computed here at character" in out, out
    assert "deployment ready" not in out and "stopping" in out  # it never served

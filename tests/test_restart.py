"""launcher.restart=on-failure on a live reference deployment (real processes, pdtool's local
supervisor, `pdtool launch +recipe=tiny-local`: one prefill, two decode instances, the front).

Under load from several concurrent clients, one decode instance is killed (SIGKILL): the
requests in flight on it fail with a reason naming it, every other request completes exact
(the engine's oracle), the supervisor restarts the instance, the front reconnects to its new
request socket and routes to it again, exact. Then the same for the prefill instance: requests
whose KV it was computing fail naming it, the others are exact, and once restarted (its lead's
control socket on the same bootstrap port, where the decode ranks greet it again) it serves
exact again. A process that fails on every start ends the deployment after
launcher.max_restarts restarts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.local_launch import procs_of, wait_gone

from pdtool.engines.reference.fromplan import model_fields
from pdtool.engines.reference.local import free_port, free_port_run, get_json
from pdtool.engines.reference.model import TinyModel
from pdtool.engines.reference.oracle import encode, generate
from pdtool.engines.reference.spec import RankSpec
from pdtool.plan import from_json

PROMPTS = ["restart me", "a decode instance dies", "the KV pages", "zz", "prefill again",
           "one more request", "abcdefghij" * 3, "ok"]


class Launched:
    """`pdtool launch +recipe=tiny-local` on free ports; its output in launch.log."""

    def __init__(self, tmp: Path, *overrides: str) -> None:
        p, d, r = free_port(), free_port_run(2), free_port()
        self.prefill_health = f"http://127.0.0.1:{p}/health"
        self.bootstrap = free_port()
        self.run_dir = tmp / "job"
        self.log = tmp / "launch.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local",
             f"prefill.http_port={p}", f"decode.http_port={d}", f"router.port={r}",
             f"prefill.dist_init_port={free_port()}", f"decode.dist_init_port={free_port_run(2)}",
             f"prefill.bootstrap_port={self.bootstrap}", "launcher.restart=on-failure",
             "launcher.restart_backoff_s=0.5", *overrides,
             "--out", str(self.run_dir)],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.url = f"http://127.0.0.1:{r}"

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout: float = 180, after: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output()[after:]:
            assert self.proc.poll() is None or text in self.output()[after:], self.output()
            assert time.monotonic() < deadline, f"never saw {text!r}:\n{self.output()}"
            time.sleep(0.2)

    def worker(self, role: str, instance: int) -> int:
        for pid in procs_of(self.run_dir):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"pdtool.worker" in argv and argv[argv.index(b"--role") + 1] == role.encode() \
                    and argv[argv.index(b"--instance") + 1] == str(instance).encode():
                return pid
        raise AssertionError(f"no {role} {instance} worker running")

    def oracle(self):
        plan = from_json((self.run_dir / "plan.json").read_text())
        cfg = RankSpec(role="decode", model=model_fields(plan.model, plan.transfer.kv_dtype)).cfg
        model = TinyModel(cfg)
        return lambda prompt, n: generate(cfg, encode(prompt), n, model)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in procs_of(self.run_dir):
            os.kill(pid, signal.SIGKILL)


def _load(url: str, stop: threading.Event, results: list, clients: int = 4,
          max_tokens: int = 64) -> list[threading.Thread]:
    """Clients sending requests back to back until `stop`."""

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            code, body = get_json(f"{url}/v1/completions",
                                  {"prompt": prompt, "max_tokens": max_tokens}, timeout=120)
            results.append((prompt, max_tokens, code, body))
            i += clients

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    return threads


def _kill_under_load(dep: Launched, role: str, instance: int) -> list:
    results: list = []
    stop = threading.Event()
    threads = _load(dep.url, stop, results)
    try:
        deadline = time.monotonic() + 60
        while len(results) < 4:  # the clients are running and answered
            assert time.monotonic() < deadline, results
            time.sleep(0.05)
        os.kill(dep.worker(role, instance), signal.SIGKILL)
        time.sleep(3.0)  # requests keep coming while the instance is gone
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    return results


def _exact_after_restart(dep: Launched, oracle, want_instance: int | None = None) -> None:
    seen = set()
    for i in range(6):  # sequential requests alternate between the decode instances
        prompt = PROMPTS[i]
        code, body = get_json(f"{dep.url}/v1/completions", {"prompt": prompt, "max_tokens": 12})
        assert code == 200, body
        assert body["pdtool"]["token_ids"] == oracle(prompt, 12)
        seen.add(body["pdtool"]["decode_instance"])
    if want_instance is not None:
        assert want_instance in seen, seen


@pytest.fixture
def launched(tmp_path):
    dep = Launched(tmp_path)
    try:
        yield dep
    finally:
        dep.stop()
    wait_gone(dep.run_dir)


@pytest.mark.slow
def test_a_killed_decode_then_prefill_instance_is_restarted_and_serves_again(launched):
    dep = launched
    dep.wait_for("deployment ready")
    oracle = dep.oracle()
    old = dep.worker("decode", 1)

    mark = len(dep.output())
    results = _kill_under_load(dep, "decode", 1)
    failed = [(c, b) for _, _, c, b in results if c != 200]
    assert failed, "no request was in flight on the killed instance"
    for code, body in failed:  # in flight on it (or sent before the front saw it go)
        assert code == 503 and "decode instance 1 stopped answering" in \
            body["error"]["message"], body
    ok = [(p, n, b) for p, n, c, b in results if c == 200]
    assert ok
    for prompt, n, body in ok:
        assert body["pdtool"]["token_ids"] == oracle(prompt, n), prompt
    dep.wait_for("decode-1 is serving again (restart 1)", after=mark)
    out = dep.output()[mark:]
    assert "decode-1.r0 exited (killed by SIGKILL)" in out
    assert "restarting decode-1 in 0.5s (restart 1 of 3)" in out
    assert dep.worker("decode", 1) != old
    deadline = time.monotonic() + 30  # the front reconnects to the new request socket
    while get_json(f"{dep.url}/health")[1].get("decode_up") != 2:
        assert time.monotonic() < deadline, get_json(f"{dep.url}/health")
        time.sleep(0.2)
    _exact_after_restart(dep, oracle, want_instance=1)

    before = get_json(dep.prefill_health)[1]  # the lead listens on the planned bootstrap port
    assert before["control"] == [f"tcp://127.0.0.1:{dep.bootstrap}"], before
    mark = len(dep.output())
    results = _kill_under_load(dep, "prefill", 0)
    failed = [(c, b) for _, _, c, b in results if c != 200]
    assert failed, "no request needed the killed prefill instance"
    for code, body in failed:  # their KV was being computed, or nobody could compute it
        msg = body["error"]["message"]
        assert code in (500, 503) and "KV transfer failed: prefill 0 rank 0" in msg, body
    for prompt, n, code, body in results:
        if code == 200:
            assert body["pdtool"]["token_ids"] == oracle(prompt, n), prompt
    dep.wait_for("prefill-0 is serving again (restart 1)", after=mark)
    deadline = time.monotonic() + 60  # the decode ranks find the new control addresses
    while True:
        code, body = get_json(f"{dep.url}/v1/completions", {"prompt": "ok", "max_tokens": 4})
        if code == 200:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    _exact_after_restart(dep, oracle)
    assert get_json(dep.prefill_health)[1]["control"] == before["control"]
    assert dep.proc.poll() is None, dep.output()


@pytest.mark.slow
def test_restarts_are_bounded(tmp_path):
    """Each instance is restarted at most max_restarts times: the next failure ends the run."""
    dep = Launched(tmp_path, "launcher.max_restarts=2", "launcher.restart_backoff_s=0.2")
    try:
        dep.wait_for("deployment ready")
        for n in (1, 2):
            os.kill(dep.worker("decode", 0), signal.SIGKILL)
            dep.wait_for(f"decode-0 is serving again (restart {n})")
        os.kill(dep.worker("decode", 0), signal.SIGKILL)
        assert dep.proc.wait(timeout=120) == 1
        out = dep.output()
        assert "restarting decode-0 in 0.4s (restart 2 of 2)" in out
        assert "decode-0 was restarted 2 times already (launcher.max_restarts=2): stopping" \
            in out
    finally:
        dep.stop()
    wait_gone(dep.run_dir)


# -- the rendered run_local.sh (its supervisor), preflight workers --------------------------
@pytest.mark.slow
def test_a_dead_and_a_hung_instance_are_restarted(tmp_path: Path) -> None:
    """decode-1 killed: restarted, the deployment keeps running; decode-0 stopped (SIGSTOP,
    its process lives): the watchdog names it, it is restarted too (its stopped process ignores
    the SIGTERM: SIGKILL launcher.stop_grace_s later). The Slurm job's supervisor is the same
    (tests/test_slurm_launch.py restarts a step inside a job)."""
    from helpers.local_launch import STARTERS, health

    base = free_port_run(60)
    keys = ("launcher.restart=on-failure", "launcher.restart_backoff_s=0.2",
            "launcher.watchdog_s=1", "launcher.probe_timeout_s=1",
            "launcher.stop_grace_s=2")
    run = STARTERS["script"](base, tmp_path / "job", *keys)
    try:
        run.wait_for("deployment ready")
        os.kill(_worker(run.run_dir, "decode", 1), signal.SIGKILL)
        run.wait_for("decode-1 is serving again (restart 1)")
        assert health(base + 11)["role"] == "decode"
        hung = _worker(run.run_dir, "decode", 0)
        os.kill(hung, signal.SIGSTOP)
        run.wait_for("decode-0 is serving again (restart 1)", timeout=120)
        out = "".join(run.lines)
        assert "decode-1.r0 exited" in out
        assert "decode-0.r0 stopped answering" in out
        assert "decode-0.r0 did not stop within 2s: SIGKILL" in out
        assert run.p.poll() is None, out
        assert _worker(run.run_dir, "decode", 0) != hung
        os.kill(run.p.pid, signal.SIGTERM)
        code, out = run.finish()
        assert code == 130, out
        wait_gone(run.run_dir)
    finally:
        run.kill_everything()


def _worker(run_dir: Path, role: str, instance: int) -> int:
    from helpers.local_launch import worker_pid

    return worker_pid(run_dir, role, instance)

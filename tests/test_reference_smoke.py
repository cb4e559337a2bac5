"""`pdtool launch +recipe=tiny-local --smoke`, the README's main command, as a user runs it."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from pdtool.engines.reference.client import Oracle, smoke
from pdtool.engines.reference.local import free_port, free_port_overrides, free_port_run


@pytest.mark.slow
def test_launch_smoke_serves_one_prompt_and_exits_0(tmp_path):
    # free ports instead of the recipe's fixed ones, so concurrent test runs do not collide
    ports = free_port_overrides()
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local", *ports, "--smoke",
         "--smoke-prompt", "Hello from the smoke test", "--out", str(tmp_path / "job")],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    # the prompt's length apart from max_tokens (bytes: the built-in model's tokens)
    assert "smoke: prompt 'Hello from the smoke test' (25 prompt tokens, max_tokens 32)" \
        in res.stdout
    # the text is checked against the model computed in the launcher, and said to be noise
    assert "smoke: checked: the text equals the model's greedy output" in res.stdout
    assert "random weights" in res.stdout
    m = re.search(r"smoke: (\d+) tokens, TTFT ([\d.]+) ms, TPOT ([\d.]+) ms", res.stdout)
    assert m and int(m.group(1)) == 32, res.stdout
    assert "smoke passed: stopping" in res.stdout
    # every worker shut down cleanly, with its KV pages free
    logs = list((tmp_path / "job" / "logs").glob("*/*.log"))
    stats = [json.loads(line[6:]) for log in logs for line in log.read_text().splitlines()
             if line.startswith("STATS ")]
    assert len(stats) == 3, res.stdout  # one prefill and two decode ranks
    assert all(s["pages_free"] == s["pages_total"] for s in stats)


@pytest.mark.slow
def test_a_taken_bootstrap_port_is_one_clear_line_and_the_launch_stops_at_once(tmp_path):
    """The prefill lead listens on its planned bootstrap port (the decode ranks reach it
    there); taken by another process, the prefill exits naming the key with no traceback, and
    the decode ranks, still waiting for its /health, stop on the launcher's SIGTERM instead of
    sitting out their grace period (launcher.stop_grace_s) until SIGKILL. `pdtool launch`
    refuses a port taken before it starts (test_cli.py); the worker's own line covers a port
    taken after that, and the rendered job run on its own (`run_local.sh` hands over to the
    supervisor, as here)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports = [f"prefill.http_port={free_port()}", f"decode.http_port={free_port_run(2)}",
             f"router.port={free_port()}", f"prefill.bootstrap_port={port}"]
    job = tmp_path / "job"
    try:
        rendered = subprocess.run(
            [sys.executable, "-m", "pdtool.cli", "render", "+recipe=tiny-local", *ports,
             "--out", str(job)], capture_output=True, text=True, timeout=120)
        assert rendered.returncode == 0, rendered.stdout + rendered.stderr
        res = subprocess.run(
            [sys.executable, "-m", "pdtool.launch.supervisor", str(job), "--exit-when-healthy"],
            capture_output=True, text=True, timeout=300)
    finally:
        taken.close()
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert (f"pdtool-reference: ERROR: prefill 0 rank 0: prefill.bootstrap_port (base + "
            f"instance 0): bind_host/port: cannot listen on 127.0.0.1:{port}") in out
    assert "Traceback" not in out
    assert "SIGKILL" not in out and "did not stop within" not in out, out


@pytest.mark.slow
def test_the_ready_banner_shows_a_request_that_works(tmp_path, capsys):
    """Without --smoke the ready banner names the served model and prints a curl line; that
    request, as printed, is answered; Ctrl-C ends with a line saying everything stopped."""
    ports = free_port_overrides()
    p = subprocess.Popen(
        [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local", *ports,
         "--out", str(tmp_path / "job")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if "curl -s" in line:
                break
        m = re.search(r"curl -s (\S+) -H 'Content-Type: application/json' -d '(.+)'", line)
        assert m and any("model 'tiny-gqa'" in x for x in lines), lines
        req = urllib.request.Request(m.group(1), data=m.group(2).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 16
        # the smoke's check fails on a text that is not the model's, naming where it differs
        base = m.group(1).removesuffix("/v1/completions")
        wrong = Oracle(text="not what the model says", prompt_tokens=5, random_weights=True)
        assert smoke(base, "Hello", model="tiny-gqa", out=io.StringIO(), oracle=wrong) == 1
        assert "differs from the model's own greedy output from character" in \
            capsys.readouterr().err
        os.kill(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=120)
        assert out.strip().splitlines()[-1].endswith(
            "stopped: every process of the deployment has exited"), out
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

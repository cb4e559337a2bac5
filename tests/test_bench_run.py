"""`pdtool bench --launch` against a real tiny-local deployment: it starts the deployment,
drives a short two-point sweep, writes results.json and the PNG into the job folder, and stops
everything. No timing assertions: only that every figure is there and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdtool.engines.reference.local import free_port_overrides


@pytest.mark.slow
def test_launch_sweep_writes_results_and_plot(tmp_path: Path):
    ports = free_port_overrides()
    out = tmp_path / "bench"
    p = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "bench", "+recipe=tiny-local", *ports,
         f"launcher.output_dir={tmp_path}", "--launch", "--concurrency", "1,3", "--requests", "6",
         "--isl", "8-80", "--osl", "4-12", "--slo", "ttft_ms=60000,tpot_ms=60000",
         "--out", str(out), "--jsonl", str(tmp_path / "sweep.jsonl"), "--verify", "2",
         "--json"],
        capture_output=True, text=True, timeout=600, check=False)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "Traceback" not in log
    assert "bench passed: stopping" in p.stderr  # the supervisor's lines go to stderr with --json
    assert "verify: 2 greedy prompts on disaggregated: every text matches the model computed " \
        "here" in " ".join(log.split())
    # every worker stopped cleanly: a decode messenger's teardown once logged a traceback here
    logs = list(tmp_path.glob("*/logs/*/*.log"))
    assert len(logs) == 4 and not [w for w in logs if "Traceback" in w.read_text()], logs
    # the front served the 2 --verify prompts and the 2 warm-up requests (--warmup's default)
    # besides the 2 x 6 measured ones, which alone are in the figures below
    router = next(w for w in logs if w.name == "router.log").read_text()
    assert router.count("request: ") == 2 + 2 + 2 * 6, router
    printed = json.loads(p.stdout)
    doc = json.loads((out / "results.json").read_text())
    assert [r["pace"] for r in doc["runs"]] == ["concurrency 1", "concurrency 3"]
    assert doc["settings"]["isl"] == "8-80" and doc["settings"]["requests"] == 6
    # where the figures come from: version, commit, host, date and the resolved deployment
    src = doc["provenance"]
    assert src["pdtool_version"] and src["host"]["cpus"] >= 1 and src["date"][:2] == "20"
    assert len(src["commit"].split("+")[0]) in (0, 40)  # '' outside a git checkout
    assert src["config"]["decode"]["instances"] == 2 and src["config"]["recipe"] == "tiny-local"
    lines = [json.loads(x) for x in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [x["pace"] for x in lines] == ["concurrency 1", "concurrency 3"]
    assert all("records" not in x and x["provenance"] == src for x in lines)
    for run, shown in zip(doc["runs"], printed["runs"], strict=True):
        s = run["summary"]
        assert s == shown["summary"]
        assert (s["requests"], s["completed"], s["failed"]) == (6, 6, 0)
        # the prompts are exactly the drawn lengths; outputs at most what was asked
        assert [r["input_tokens"] for r in run["records"]] == \
            [r["input_tokens"] for r in doc["runs"][0]["records"]]
        assert all(8 <= r["input_tokens"] <= 80 for r in run["records"])
        assert all(1 <= sum(r["tokens"]) <= 12 for r in run["records"])
        assert s["input_tokens"] == sum(r["input_tokens"] for r in run["records"])
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            d = s[key]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"]
        assert s["good_requests"] == 6  # a one-minute SLO: every request meets it
        # tiny-local occupies 3 worker slots (1 prefill + 2 decode, TP1)
        assert s["gpus"] == 3 and s["output_throughput_per_gpu"] == \
            pytest.approx(s["output_throughput"] / 3)
        assert s["user_tokens_s"] == pytest.approx(1000 / s["tpot_ms"]["mean"])
        assert run["advice"]["override"].startswith("decode.instances=")
    assert "balanced prefill:decode = 1:" in log
    assert "across load points" in log and "per GPU" in log  # the sweep's summary table
    png = (out / "latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _job_process_states(root: Path) -> list[tuple[str, str]]:
    """(target, state letter) of every process whose command line names a job folder under
    `root`: the twin's folder is `<job>/aggregated`."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(root) in argv and "pdtool.cli" not in argv:
            out.append(("aggregated" if "/aggregated/" in argv else "disaggregated", state))
    return out


@pytest.mark.slow
def test_compare_aggregated_runs_both_deployments_interleaved(tmp_path: Path):
    """--compare aggregated starts the mode=aggregated twin on moved ports in its own job
    folder, runs the same prompts against both, and writes one summary per target; on one
    machine's CPUs each target's rounds run with the other frozen."""
    ports = free_port_overrides()
    out = tmp_path / "bench"
    p = subprocess.Popen(
        [sys.executable, "-m", "pdtool.cli", "bench", "+recipe=tiny-local", *ports,
         f"launcher.output_dir={tmp_path}", "--launch", "--compare", "aggregated",
         "--concurrency", "1", "--requests", "8", "--rounds", "2", "--isl", "16", "--osl", "32",
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # cluster.device=cpu: the twins share this machine's cores, so while one is measured the
    # other's processes are stopped (state T); sample which were seen stopped (each target's
    # round is 4 requests of 32 output tokens, hundreds of ms: with 3 tokens a round could
    # pass between two samples on a loaded box, and a target was once never seen stopped)
    frozen: set[str] = set()
    deadline = time.monotonic() + 600
    while p.poll() is None and time.monotonic() < deadline:
        for target, state in _job_process_states(tmp_path):
            if state == "T":
                frozen.add(target)
        time.sleep(0.05)
    log = p.communicate(timeout=60)[0]
    assert p.returncode == 0, log
    assert "disaggregated / aggregated" in log
    assert frozen == {"disaggregated", "aggregated"}, frozen
    doc = json.loads((out / "results.json").read_text())
    runs = {r["target"]: r for r in doc["runs"]}
    assert set(runs) == {"disaggregated", "aggregated"}
    for r in runs.values():
        assert r["summary"]["completed"] == 8
    assert runs["aggregated"]["advice"] is None  # no prefill:decode ratio to balance there
    # the same prompts went to both
    assert [x["input_tokens"] for x in runs["disaggregated"]["records"]] == \
        [x["input_tokens"] for x in runs["aggregated"]["records"]]
    twin = [d for d in tmp_path.iterdir() if (d / "aggregated" / "plan.json").exists()]
    assert len(twin) == 1
    assert json.loads((twin[0] / "aggregated" / "plan.json").read_text())["mode"] == "aggregated"
    assert json.loads((twin[0] / "plan.json").read_text())["mode"] == "disaggregated"


@pytest.mark.slow
def test_ctrl_c_keeps_the_finished_load_points(tmp_path: Path):
    """Ctrl-C in the second load point: results.json holds the first, whole, says it was
    interrupted, and the deployment is stopped (exit 130). The second load point sends one
    request a second for 40 s, so the signal lands in it however loaded the machine is."""
    import os
    import signal
    import time

    ports = free_port_overrides()
    out, n = tmp_path / "bench", 40
    p = subprocess.Popen(
        [sys.executable, "-m", "pdtool.cli", "bench", "+recipe=tiny-local", *ports,
         f"launcher.output_dir={tmp_path}", "--launch", "--rate", "100,1", "--requests",
         str(n), "--isl", "16", "--osl", "8", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the front logs each request it answered
            logs = list(tmp_path.glob("*/logs/*/router.log"))
            if logs and logs[0].read_text().count("request: ") > 2 + n:
                break  # warm-up and the first load point done, the second one running
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        said, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    assert p.returncode == 130, said
    assert "interrupted: reporting the 1 finished run(s)" in said, said
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["interrupted"] is True
    assert [(r["pace"], r["summary"]["requests"]) for r in doc["runs"]] == \
        [("rate 100/s", n)]
    assert "stopped: every process of the deployment has exited" in said


@pytest.mark.slow
def test_verify_catches_a_corrupted_page_before_measuring(tmp_path: Path):
    """A decode that damages one received page of every request (the reference engine's test
    hook, as a faulty NIC would) still answers HTTP 200: `--verify` compares the texts with
    the model computed in this process, stops before any figure is measured (exit 1) and
    names the prompt, the target and the first differing character."""
    ports = free_port_overrides()
    p = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "bench", "+recipe=tiny-local", *ports,
         f"launcher.output_dir={tmp_path}", "+launcher.env.decode.PDTOOL_REFERENCE_ALLOW_FAULTS=1",
         "+launcher.env.decode.PDTOOL_REFERENCE_CORRUPT_PAGE='0,0'", "--launch",
         "--concurrency", "1", "--requests", "4", "--isl", "16-64", "--osl", "8",
         "--verify", "3", "--out", str(tmp_path / "bench")],
        capture_output=True, text=True, timeout=600, check=False)
    log = p.stdout + p.stderr
    assert p.returncode == 1, log
    assert "--verify: 3 of 3 outputs differ; first: prompt 0 on disaggregated: differs from " \
        "the model computed here at character" in " ".join(log.split()), log
    assert not (tmp_path / "bench" / "results.json").exists()  # nothing was measured
    assert "stopped: every process of the deployment has exited" in log

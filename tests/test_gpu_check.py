"""`gpu/check.sh --cpu`: the GPU check's entry point runs here every step that needs no GPU.

What CI can prove of the GPU check: the entry point, the step runner (a process and a timeout
per step, the summary rewritten after each), and the CPU emulation of every step that has one
(pointer checks without a CUDA driver, the fabric-written HND pages and their paged decode,
the progress word watched mid-forward with fresh tokens each pass, the staged transfer between
two processes, the head-slice copies, the per-layer markers consumed by a thread). The
GPU-only step is listed as not run, never as passed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_the_gpu_check_runs_every_cpu_step_and_keeps_its_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = subprocess.run(["bash", "gpu/check.sh", "--cpu", "--out", str(out), "--replays", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert list(steps) == ["mapped_aliasing", "pointer_checks", "paged_decode",
                           "graph_progress", "staged_transfer", "head_slice",
                           "side_stream_markers"]
    assert steps["mapped_aliasing"] == {"ok": None, "run": "not run (no GPU)"}
    for name in list(steps)[1:]:
        assert steps[name]["ok"] is True, (name, steps[name])
        assert (out / f"{name}.json").is_file()
    assert summary["ok"] is True and "CHECK PASSED" in res.stdout
    graph = steps["graph_progress"]
    assert graph["replays"] == 5 and graph["first_replay"]["stale_layers"] == []
    assert steps["pointer_checks"]["direct_refused"]  # Debian's libfabric has no CUDA
    assert (out / "build.log").read_text().count("using it") == 1  # the built binding


def test_a_step_that_overruns_is_reported_and_the_next_steps_still_run(tmp_path: Path) -> None:
    """A step past its timeout is killed and recorded as failed; the summary written so far
    survives (here the runner is asked for one step, with its timeout cut to 1 s)."""
    code = ("import sys, runpy; sys.argv = ['check.py', '--cpu', '--out', sys.argv[1], "
            "'--only', 'graph_progress', '--only', 'pointer_checks', '--replays', '500'];"
            "sys.path.insert(0, 'gpu'); import check;"
            "check.STEPS = tuple(s if s.name != 'graph_progress' else "
            "check.Step(s.name, 1, s.gpu_only, s.run) for s in check.STEPS);"
            "sys.exit(check.main())")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert steps["graph_progress"]["ok"] is False
    assert steps["graph_progress"]["error"] == "timed out after 1 s"
    assert steps["pointer_checks"]["ok"] is True
    assert "graph_progress: FAILED" in res.stdout


def test_a_word_ahead_of_its_layers_kv_fails_the_progress_step(tmp_path: Path) -> None:
    """The graph step can fail: a progress writer that reports each layer one early (what a
    word visible before its KV looks like) leaves stale pages behind reported layers."""
    res = subprocess.run([sys.executable, "gpu/check.py", "--cpu", "--out", str(tmp_path),
                          "--only", "graph_progress", "--replays", "2", "--report-ahead"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    step = json.loads((tmp_path / "summary.json").read_text())["steps"]["graph_progress"]
    assert step["ok"] is False and step["failed_replays"], step
    assert step["failed_replays"][0]["stale_layers"], step

"""`launcher.benchmark`: validated with `pdtool bench`'s own parser, rendered quoted into the
Slurm script, and run inside a job on the emulated cluster once the deployment is healthy
(results in the job folder, the job ending with the benchmark's status)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdtool.compose import load_config
from pdtool.launch.benchmark import benchmark_argv
from pdtool.launch.shell import display
from pdtool.render import render
from pdtool.rules import validate

BENCH = "launcher.benchmark=[--concurrency,2,--requests,4,--isl,8,--osl,2]"


def _errors(*overrides: str) -> list:
    cfg, problems = load_config(list(overrides))
    assert cfg is not None, problems
    return [f for f in validate(cfg) if f.severity == "error"]


@pytest.mark.parametrize(("value", "says"), [
    ("[--concurency,4]", "unrecognized arguments"),
    ("[--requests,x]", "invalid int value"),
    ("[--isl,abc]", "--isl"),
    ("[--url,http://elsewhere:8000]", "--url: set by the job"),
    ("[--out,/tmp/x]", "--out: set by the job"),
    ("[--launch]", "--launch: set by the job"),
    ("[--compare,aggregated]", "--compare: set by the job"),
    ("['decode.instances=2']", "not a bench option"),
])
def test_validate_refuses_bad_bench_arguments(value: str, says: str) -> None:
    found = _errors("+recipe=deepseek-r1", f"launcher.benchmark={value}")
    assert [f.key for f in found] == ["launcher.benchmark"], found
    assert says in found[0].message, found[0]


def test_validate_refuses_it_off_slurm_and_accepts_good_arguments() -> None:
    found = _errors("+recipe=tiny-local", BENCH)
    assert [f.key for f in found] == ["launcher.benchmark"]
    assert "pdtool bench --launch" in found[0].fix
    assert not _errors("+recipe=deepseek-r1",
                       "launcher.benchmark=[--concurrency,'1,4',--isl,32-64,--slo,'ttft_ms=500']")
    assert not _errors("+recipe=deepseek-r1")  # empty: no benchmark


def test_rendered_quoted_and_shellcheck_clean(tmp_path: Path) -> None:
    rendered, findings = render(["+recipe=deepseek-r1",
                                 "launcher.benchmark=[--isl,32-64,--slo,'ttft_ms=500']"],
                                tmp_path / "job")
    assert rendered is not None, findings
    argv = shlex.split(display(benchmark_argv(rendered.cfg, rendered.spec)))
    assert argv == ["${PDTOOL_PYTHON}", "-m", "pdtool.cli", "bench", "--job", "${RUN_DIR}",
                    "--url", "http://${HOSTS[0]}:8000", "--out", "${LOG_DIR}/bench",
                    # no --timeout given: the job's outlasts SGLang's 300 + 300 s timers
                    "--timeout", "600", "--isl", "32-64", "--slo", "ttft_ms=500"]
    res = subprocess.run(["shellcheck", "-x", "-s", "bash", str(rendered.script)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    plain, _ = render(["+recipe=deepseek-r1"], tmp_path / "plain")
    assert benchmark_argv(plain.cfg, plain.spec) == []


def test_bench_job_option_refuses_overrides(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pdtool.cli", "bench", "--job", str(tmp_path),
                          "decode.instances=2"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--job" in res.stderr, res.stderr


@pytest.mark.slow
def test_the_job_benchmarks_itself_once_healthy(slurm, tmp_path: Path) -> None:
    from pdtool.engines.reference.local import free_port, free_port_run

    out = tmp_path / "job"
    router, prefill, decode = free_port(), free_port(), free_port_run(1)
    overrides = [
        "+recipe=tiny-local", "launcher=slurm", "transfer=tcp", "cluster.nodes=2",
        "cluster.one_host=true", "cluster.gpus_per_node=1", "cluster.gpu_numa=[0]",
        "decode.instances=1", f"prefill.http_port={prefill}", f"decode.http_port={decode}",
        f"prefill.bootstrap_port={free_port()}", f"prefill.dist_init_port={free_port()}",
        f"decode.dist_init_port={free_port_run(2)}", f"router.port={router}",
        "launcher.health_timeout_s=120", "launcher.job_name=pdtool-bench", BENCH,
        "launcher.verify=2",
    ]
    res = subprocess.run([sys.executable, "-m", "pdtool.cli", "launch", *overrides, "--out",
                          str(out)], env=slurm.env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    batch = out / "logs" / f"slurm-{job}.out"
    state, code = slurm.wait_job(job, timeout=300)
    log = batch.read_text() if batch.exists() else ""
    assert (state, code) == ("COMPLETED", "0:0"), log
    assert "benchmark finished (status 0)" in log, log
    # launcher.verify checked the tokens once healthy, before the benchmark started
    checked = "launcher.verify: 2 greedy prompts through the front: every text is the model's own"
    assert checked in log and log.index(checked) < log.index("benchmark: pdtool bench"), log
    doc = json.loads((out / "logs" / job / "bench" / "results.json").read_text())
    assert (out / "logs" / job / "bench" / "latency.png").stat().st_size > 0
    runs = doc["runs"] if "runs" in doc else doc["results"]
    assert runs and all(r["summary"]["completed"] == 4 for r in runs), doc

"""The `pdtool bench` command line a Slurm job runs once healthy (`launcher.benchmark`).

It runs on the batch host (node 0, beside the router) with pdtool's own interpreter, reads the
deployment from the job folder's config.yaml (`--job`), drives the router the plan placed, and
writes results.json and latency.png into this run's log folder, so a requeued job keeps each
run's figures. The user's arguments (validated by pdtool.rules.benchmark) follow as literals;
without a `--timeout` among them the job gives one that outlasts the deployment's transfer
timers (pdtool.budgets.in_job_bench_timeout_s).
"""

from __future__ import annotations

from pdtool.budgets import bench_timeout_s, in_job_bench_timeout_s
from pdtool.launch.shell import Var, Word, word
from pdtool.launch.spec import LOG_DIR, RUN_DIR, LaunchSpec
from pdtool.schema import Config


def benchmark_argv(cfg: Config, spec: LaunchSpec) -> list[str | Var | Word]:
    """The command, or [] when `launcher.benchmark` is empty."""
    if not cfg.launcher.benchmark:
        return []
    args = [str(a) for a in cfg.launcher.benchmark]
    if bench_timeout_s(args) is None:
        args = ["--timeout", f"{in_job_bench_timeout_s(cfg):g}", *args]
    return [Var("PDTOOL_PYTHON"), "-m", "pdtool.cli", "bench", "--job", RUN_DIR,
            "--url", spec.router_url, "--out", word(LOG_DIR, "/bench"), *args]

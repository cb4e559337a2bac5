"""`launcher.benchmark`: the `pdtool bench` arguments a Slurm job runs once it is healthy.

Checked here with the bench command's own options and checks (`pdtool.bench.args`), so a
typo fails at validate time on the login node, not an hour later inside the allocation after
the model loaded. What the job decides itself is refused in the list: the target (`--url`,
`--launch`, the config overrides: it is this deployment), where results go (`--out`: the job
folder), and `--compare` (a second, aggregated deployment the job does not start).
"""

from __future__ import annotations

import argparse

from pdtool.bench.args import BenchError, add_arguments, check_args
from pdtool.rules.finding import Finding, error
from pdtool.schema import Config

KEY = "launcher.benchmark"
#: options the job sets itself, with the reason given to the user
JOB_OWNED = {
    "url": "the job benchmarks its own router",
    "launch": "the job has already started the deployment",
    "job": "the job passes its own folder",
    "out": "results go to the job folder (logs/<jobid>/bench/)",
    "compare": "the job starts no aggregated twin to compare against",
    "compare_url": "the job starts no aggregated twin to compare against",
}


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refused(message)


def parse(args: list[str]) -> argparse.Namespace:
    """The bench arguments as `pdtool bench` parses them; raises ValueError naming the problem."""
    p = _Parser(prog="pdtool bench", add_help=False)
    p.add_argument("overrides", nargs="*")  # parsed only to be refused below
    add_arguments(p)
    try:
        ns = p.parse_args([str(a) for a in args])
    except _Refused as exc:
        raise ValueError(str(exc)) from None
    if ns.overrides:
        raise ValueError(f"{' '.join(ns.overrides)!r}: not a bench option (config overrides "
                         f"do not belong here: the job benchmarks the deployment it runs)")
    for dest, why in JOB_OWNED.items():
        if getattr(ns, dest, None):
            raise ValueError(f"--{dest.replace('_', '-')}: set by the job ({why})")
    try:
        check_args(ns)
    except BenchError as exc:
        raise ValueError(str(exc)) from None
    return ns


def check_benchmark(cfg: Config) -> list[Finding]:
    lc = cfg.launcher
    if not lc.benchmark:
        return []
    if lc.kind != "slurm":
        return [error(KEY, "runs inside a Slurm job (launcher=slurm)",
                      "on this machine run `pdtool bench --launch` with the same overrides, "
                      "or set launcher.benchmark=[]")]
    try:
        parse(list(lc.benchmark))
    except ValueError as exc:
        return [error(KEY, str(exc), "give `pdtool bench` options, e.g. "
                      "launcher.benchmark='[--concurrency,4,--requests,64,--isl,128,--osl,32]'")]
    return []


ALL = (check_benchmark,)

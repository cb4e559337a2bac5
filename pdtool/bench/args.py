"""`pdtool bench`'s options and their checks: one schema for the command and for validate's
`launcher.benchmark` (rules.benchmark), which checks a Slurm job's bench arguments with it on
the login node. No I/O here, so the rules can import it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BenchError(ValueError):
    """Bad bench arguments or an unusable target: one line, naming the option."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options (the caller adds the config overrides' positional argument)."""
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--concurrency", metavar="N[,N...]",
                      help="requests kept in flight (a comma list sweeps); default 4")
    pace.add_argument("--rate", metavar="R[,R...]",
                      help="Poisson arrivals, requests per second (a comma list sweeps)")
    p.add_argument("--requests", type=int, default=32, help="requests per load point (32)")
    p.add_argument("--isl", default="128", help="prompt tokens: N, A-B or A-B:log (128)")
    p.add_argument("--osl", default="32", help="output tokens: N, A-B or A-B:log (32)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts, arrivals (0)")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="the first N tokens of every prompt are the same (a system prompt: "
                   "prefix caches and cache-aware routing get hits); 0: all random (0)")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="before measuring, N greedy prompts on every target compared with the "
                   "model computed here (reference engine) or the first target; any difference "
                   "stops the bench (exit 1), naming prompt, target and position (0: off)")
    p.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="requests sent to each target before the measured ones, one at a time, "
                   "and left out of every figure (2)")
    p.add_argument("--slo", help="goodput counts requests within these, e.g. ttft_ms=200,tpot_ms=50"
                   " (keys ttft_ms, tpot_ms, itl_ms, e2e_ms)")
    p.add_argument("--url", help="the deployment's OpenAI base URL "
                   "(default http://127.0.0.1:<router.port>)")
    p.add_argument("--launch", action="store_true",
                   help="start the deployment described by the overrides, benchmark it, stop it")
    p.add_argument("--compare", action="append", metavar="OVERRIDES",
                   help="also run the same load against the deployment with these overrides "
                   "(space-separated, e.g. transfer.backend=nixl; `aggregated` is "
                   "mode=aggregated), interleaved round by round; repeatable")
    p.add_argument("--compare-url", action="append", metavar="URL",
                   help="without --launch: the running deployment of each --compare, in order")
    p.add_argument("--rounds", type=int, default=4,
                   help="with --compare: rounds each load point is split into (4)")
    p.add_argument("--job", type=Path, metavar="DIR",
                   help="bench the deployment of this job folder (its config.yaml, no "
                   "overrides); results into DIR/bench unless --out (launcher.benchmark)")
    p.add_argument("--out", type=Path, help="folder for results.json and latency.png")
    p.add_argument("--jsonl", type=Path, metavar="FILE",
                   help="also append one line per run (target, load point) to FILE: a sweep "
                   "of bench invocations collects its figures in one file")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one request may take before it counts as failed (300)")
    p.add_argument("--json", action="store_true", help="print results.json's summary on stdout")


# -- arguments -> settings ---------------------------------------------------------------------

@dataclass(frozen=True)
class Pace:
    """How requests are released: `concurrency` in flight, or Poisson arrivals at `rate`/s."""

    concurrency: int | None = None
    rate: float | None = None

    def __str__(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"rate {self.rate:g}/s"

    @property
    def label(self) -> str:
        return f"c{self.concurrency}" if self.concurrency else f"r{self.rate:g}"



def _paces(args: argparse.Namespace) -> list[Any]:
    if args.rate:
        vals = _numbers(args.rate, "--rate", float)
        if any(not v > 0 for v in vals):
            raise BenchError(f"--rate: expected positive requests per second, got {args.rate!r}")
        return [Pace(rate=v) for v in vals]
    vals = _numbers(args.concurrency or "4", "--concurrency", int)
    if any(v < 1 for v in vals):
        raise BenchError(f"--concurrency: expected integers >= 1, got {args.concurrency!r}")
    return [Pace(concurrency=v) for v in vals]


def _numbers(text: str, option: str, kind: type) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()] or [kind("")]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise BenchError(f"{option}: expected {what} separated by commas, got {text!r}") from None


def compare_sets(values: list[str]) -> list[tuple[str, list[str]]]:
    """Each --compare value as (label, overrides): `aggregated` is mode=aggregated; the label
    names the target in tables and results.json."""
    out: list[tuple[str, list[str]]] = []
    for value in values:
        overrides = ["mode=aggregated" if w == "aggregated" else w for w in value.split()]
        if not overrides:
            raise BenchError("--compare: expected overrides such as transfer.backend=nixl or "
                             "aggregated, got an empty value")
        bad = [w for w in overrides if "=" not in w]
        if bad:
            raise BenchError(f"--compare {value!r}: expected KEY=VALUE overrides (or "
                             f"aggregated), got {bad[0]!r}")
        label = "aggregated" if overrides == ["mode=aggregated"] else " ".join(overrides)
        if label in [x for x, _ in out]:
            raise BenchError(f"--compare {value!r}: given twice")
        out.append((label, overrides))
    return out


def check_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument checked before anything starts; BenchError names the first bad one."""
    from pdtool.bench.lengths import SpecError, parse_lengths
    from pdtool.bench.stats import SloError, parse_slo

    if args.requests < 1:
        raise BenchError(f"--requests: expected at least 1, got {args.requests}")
    if args.rounds < 1:
        raise BenchError(f"--rounds: expected at least 1, got {args.rounds}")
    if args.verify < 0:
        raise BenchError(f"--verify: expected 0 or more prompts, got {args.verify}")
    if args.warmup < 0:
        raise BenchError(f"--warmup: expected 0 or more requests, got {args.warmup}")
    if args.shared_prefix < 0:
        raise BenchError(f"--shared-prefix: expected 0 or more tokens, got {args.shared_prefix}")
    if not args.timeout > 0:
        raise BenchError(f"--timeout: expected positive seconds, got {args.timeout}")
    if args.url and args.launch:
        raise BenchError("--url and --launch: give one (--launch benchmarks what it starts)")
    if getattr(args, "job", None) and (args.launch or args.overrides):
        raise BenchError("--job: the job folder's config.yaml is the deployment; give no "
                         "overrides and no --launch with it")
    compare = compare_sets(args.compare or [])
    urls = args.compare_url or []
    if urls and not compare:
        raise BenchError("--compare-url: only with --compare")
    if compare and not args.launch and len(urls) != len(compare):
        raise BenchError(f"--compare {compare[len(urls)][0]}: needs --launch (starts every "
                         f"deployment) or one --compare-url per --compare (the running "
                         f"deployments' URLs, in order)")
    try:
        return {"paces": _paces(args), "isl": parse_lengths(args.isl, "--isl"),
                "osl": parse_lengths(args.osl, "--osl"), "slo": parse_slo(args.slo),
                "compare": compare, "shared_prefix": args.shared_prefix,
                "warmup": args.warmup}
    except (SpecError, SloError) as exc:
        raise BenchError(str(exc)) from None

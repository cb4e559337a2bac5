"""Printing and writing a bench run: one table per run, side-by-side with ratios when comparing,
the ratio advice, and results.json (every figure, the settings, where they come from, and each
request's record); `--jsonl` appends one line per run to a file a sweep shares."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdtool.bench.stats import (
    PERCENTILES,
    SPREAD_MIN_REQUESTS,
    SPREAD_SLICES,
    Rates,
    RatioAdvice,
)

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
THROUGHPUTS = (("request_throughput", "requests/s"), ("input_throughput", "input tokens/s"),
               ("output_throughput", "output tokens/s"),
               ("output_throughput_per_gpu", "tokens/s per GPU"),
               ("user_tokens_s", "tokens/s per user"),
               ("goodput", "goodput (requests/s)"))


def rows(summary: dict) -> list[tuple[str, float | None]]:
    """(label, value) of every headline figure, in table order (latencies in ms)."""
    out: list[tuple[str, float | None]] = []
    for key, name in LATENCIES:
        for q in PERCENTILES:
            out.append((f"{name} p{q} (ms)", summary[key][f"p{q}"]))
    for key, name in THROUGHPUTS:
        if (key == "goodput" and not summary["slo"]) or key not in summary:
            continue
        out.append((name, summary[key]))
    return out


#: the sweep summary's columns: (header, summary key, sub-key or None)
SWEEP_COLUMNS = (("TTFT mean", "ttft_ms", "mean"), ("TTFT p50", "ttft_ms", "p50"),
                 ("TTFT p99", "ttft_ms", "p99"), ("TPOT mean", "tpot_ms", "mean"),
                 ("TPOT p99", "tpot_ms", "p99"), ("out tok/s", "output_throughput", None),
                 ("per GPU", "output_throughput_per_gpu", None),
                 ("per user", "user_tokens_s", None))


def sweep_table(runs: list[tuple[str, str, dict]]) -> Any:
    """One row per (load point, target) of a sweep: latencies (ms) and throughputs side by
    side, the shape a capacity plan reads (tokens/s per GPU against tokens/s per user)."""
    from rich.table import Table

    t = Table(title="across load points (latencies in ms)", title_justify="left",
              pad_edge=False)
    t.add_column("load", style="bold")
    t.add_column("target")
    t.add_column("done", justify="right")
    for header, _, _ in SWEEP_COLUMNS:
        t.add_column(header, justify="right")
    for pace, target, s in runs:
        cells = [_fmt(s[key][sub] if sub else s.get(key)) for _, key, sub in SWEEP_COLUMNS]
        t.add_row(pace, target, f"{s['completed']}/{s['requests']}", *cells)
    return t


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"


def table(title: str, columns: dict[str, dict]) -> Any:
    """A rich table: one column per target (e.g. disaggregated, aggregated), plus the ratio of
    the first to the second when there are two."""
    from rich.table import Table

    names = list(columns)
    t = Table(title=title, title_justify="left", pad_edge=False)
    t.add_column("figure", style="bold")
    for n in names:
        t.add_column(n, justify="right")
    if len(names) == 2:
        t.add_column(f"{names[0]} / {names[1]}", justify="right", style="cyan")
    per = [dict(rows(columns[n])) for n in names]
    for label in per[0]:
        vals = [p.get(label) for p in per]
        cells = [_fmt(v) for v in vals]
        if len(names) == 2:
            a, b = vals
            cells.append(f"{a / b:.2f}x" if a is not None and b else "n/a")
        t.add_row(label, *cells)
    s = columns[names[0]]
    t.caption = (f"{s['completed']}/{s['requests']} requests completed in {s['duration_s']:.1f} s"
                 + (f"; failures: {s['errors']}" if s["failed"] else ""))
    t.caption_justify = "left"
    return t


def added_text(names: list[str], added: dict) -> str:
    """One line: the median per-prompt TTFT difference of the first target over the second."""
    if not added["pairs"]:
        return f"TTFT {names[0]} - {names[1]}: no request completed on both"
    return (f"TTFT {names[0]} - {names[1]}, same prompts ({added['pairs']} pairs): median "
            f"{added['p50']:+,.2f} ms ({100 * added['relative_p50']:+.1f} % of "
            f"{names[1]}'s p50 {added['baseline_ttft_p50_ms']:,.2f} ms), p90 "
            f"{added['p90']:+,.2f} ms")


def advice_text(rates: Rates, advice: RatioAdvice, current: int) -> str:
    if advice.spread is None:
        steady = (f"too few requests to say how steady it is: each of {SPREAD_SLICES} slices "
                  f"of the run needs {SPREAD_MIN_REQUESTS}; measure more before sizing on it")
    else:
        lo, hi = advice.spread
        steady = f"1:{lo:.2f} to 1:{hi:.2f} over {SPREAD_SLICES} slices of the run"
    return (f"measured per instance: prefill {rates.prefill_tokens_s:,.0f} input tokens/s, "
            f"decode {rates.decode_tokens_s:,.0f} output tokens/s at mean lengths "
            f"{rates.mean_input:.0f} in / {rates.mean_output + 1:.0f} out.\n"
            f"balanced prefill:decode = 1:{advice.decode_per_prefill:.2f} ({steady}); for "
            f"{advice.prefill_instances} prefill instance(s): {advice.decode_instances} decode "
            f"(now {current}) -> override: {advice.override}")


def provenance(cfg: Any) -> dict[str, Any]:
    """Where the figures come from: pdtool's version and commit, the host, the date, and the
    resolved config of the deployment (secrets redacted, as in a job's config.yaml)."""
    from omegaconf import OmegaConf

    from pdtool import __version__
    from pdtool.launch.secrets import redacted

    return {"pdtool_version": __version__, "commit": _commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": {"name": socket.gethostname(), "cpus": os.cpu_count(),
                     "load_1m": round(os.getloadavg()[0], 2), "platform": platform.platform(),
                     "python": platform.python_version()},
            "config": OmegaConf.to_container(OmegaConf.structured(redacted(cfg)))}


def _commit() -> str:
    """The commit of the pdtool checkout running (`+dirty` with local changes; '' outside a
    git checkout, e.g. an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return ""
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _plain(x: Any) -> Any:
    return asdict(x) if hasattr(x, "__dataclass_fields__") else x


def write_json(path: Path, settings: dict, runs: list[dict], source: dict[str, Any]) -> None:
    """runs: [{"target", "pace", "summary", "rates", "advice", "records"}]; `source`: the
    provenance()."""
    doc = {"provenance": source, "settings": settings,
           "runs": [{k: ([_plain(r) for r in v] if k == "records" else _plain(v))
                     for k, v in run.items()} for run in runs]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def append_jsonl(path: Path, settings: dict, runs: list[dict], source: dict[str, Any]) -> None:
    """One line per run (target and load point: its summary, rates and advice, without the
    per-request records) appended to `path`, so a sweep of bench invocations fills one file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for run in runs:
            line = {"provenance": source, "settings": settings,
                    **{k: _plain(v) for k, v in run.items() if k != "records"}}
            fh.write(json.dumps(line) + "\n")

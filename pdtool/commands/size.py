"""`pdtool size`: the prefill:decode ratio and parallelism for an SLO, before any GPU is rented.

Evaluates every validate-clean variation of the config's parallelism and instance counts
(pdtool.sizing.search) with the sizing model (pdtool.sizing.model, docs/sizing.md) and the
constants of the cluster's GPU kind (conf/sizing/hardware.yaml), and prints the best by
goodput per GPU that meet the SLO, with the override line of each. `--calibrate` refits the
constants from `pdtool bench` results; `--published` compares the model with the published
measurements in conf/sizing/published.yaml (`--refit`: fit the H100 entry to them again).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from pdtool.commands._common import (
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    add_overrides_argument,
    console,
    dump_json,
    print_findings,
)

NAME = "size"
HELP = "choose the prefill:decode ratio and parallelism for an SLO (a model, docs/sizing.md)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_overrides_argument(p)
    p.add_argument("--isl", default="1024", metavar="N|LO-HI",
                   help="input tokens per request: N, or LO-HI uniform (default 1024)")
    p.add_argument("--osl", default="256", metavar="N|LO-HI",
                   help="output tokens per request: N, or LO-HI uniform (its mean counts; "
                   "default 256)")
    p.add_argument("--slo", default="ttft_ms=2000,tpot_ms=50", metavar="ttft_ms=X,tpot_ms=Y",
                   help="mean TTFT and TPOT to meet (default ttft_ms=2000,tpot_ms=50)")
    p.add_argument("--rate", type=float, metavar="R",
                   help="requests/s to serve: the fewest GPUs that meet the SLO at R")
    p.add_argument("--gpus", type=int, metavar="N",
                   help="GPUs available (default: the cluster's nodes x GPUs per node)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="deployments shown (5)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="tokens/s per GPU against tokens/s per user, SLO drawn")
    p.add_argument("--hardware", type=Path, metavar="YAML",
                   help="constants file (default conf/sizing/hardware.yaml)")
    p.add_argument("--fabric", type=Path, metavar="JOB_DIR",
                   help="take the KV fabric's efficiency from the fabric check a --preflight "
                   "run of JOB_DIR measured (measured over line rate, per NIC pair)")
    p.add_argument("--calibrate", type=Path, nargs="+", metavar="RESULTS_JSON",
                   help="refit the cluster's GPU entry from `pdtool bench` results.json files")
    p.add_argument("--fit", default="prefill_overhead_ms,step_overhead_ms", metavar="A,B",
                   help="with --calibrate: the constants refitted (default "
                   "prefill_overhead_ms,step_overhead_ms)")
    p.add_argument("--write", type=Path, metavar="YAML",
                   help="with --calibrate or --published --refit: write the fitted entry here")
    p.add_argument("--published", action="store_true",
                   help="the model against conf/sizing/published.yaml's measurements")
    p.add_argument("--refit", action="store_true",
                   help="with --published: fit the H100 entry to its fit points first")


def _slo(text: str) -> tuple[float, float]:
    from pdtool.sizing.model import SizingError

    want = {"ttft_ms": None, "tpot_ms": None}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in want:
            raise SizingError(f"--slo: {key.strip()!r} is not ttft_ms or tpot_ms")
        try:
            want[key.strip()] = float(value)
        except ValueError:
            raise SizingError(f"--slo: {part!r}: expected {key.strip()}=<milliseconds>"
                              ) from None
    if any(v is None or v <= 0 for v in want.values()):
        raise SizingError(f"--slo: give both ttft_ms and tpot_ms, > 0 (got {text!r})")
    return want["ttft_ms"], want["tpot_ms"]


def run(args: argparse.Namespace) -> int:
    from pdtool.sizing.hardware import HardwareError
    from pdtool.sizing.model import SizingError

    err = console(stderr=True)
    try:
        if args.published:
            return _published(args)
        if args.calibrate:
            return _calibrate(args)
        return _size(args)
    except (SizingError, HardwareError, ValueError) as e:
        err.print(f"[bold red]pdtool size:[/] {e}")
        return EXIT_USAGE


def _config(overrides: list[str], varied: tuple[str, ...] = ()) -> Any:
    """The composed config, or None after printing its errors; errors on keys starting with
    one of `varied` are left to the candidates, which set those keys themselves."""
    from pdtool.compose import load_config
    from pdtool.rules import validate

    cfg, findings = load_config(overrides)
    findings = findings if cfg is None else [*findings, *validate(cfg)]
    errors = [f for f in findings if f.severity == "error" and not f.key.startswith(varied)]
    if cfg is None or errors:
        con = console(stderr=True)
        con.print("[bold red]pdtool size: the config has errors[/]")
        print_findings(con, errors or [f for f in findings if f.severity == "error"])
        return None
    return cfg


def _size(args: argparse.Namespace) -> int:
    from pdtool.sizing.hardware import for_gpu
    from pdtool.sizing.model import Workload, deployment, goodput, parse_lengths, predict
    from pdtool.sizing.search import candidates

    ttft, tpot = _slo(args.slo)
    osl = round(sum(n * w for n, w in parse_lengths(args.osl, "--osl")))
    wl = Workload(isl=parse_lengths(args.isl, "--isl"), osl=max(osl, 1))
    # what the search varies may be wrong in the base (cluster.nodes too few for its instances)
    cfg = _config(list(args.overrides), ("prefill.", "decode.", "cluster.nodes", "mode"))
    if cfg is None:
        return EXIT_ERRORS
    hw = _with_fabric(for_gpu(cfg.cluster.gpu_type, args.hardware), args.fabric)
    rows = []
    for cand in candidates(cfg, args.gpus):
        dep = deployment(cand.cfg, round(wl.mean_isl))
        if args.rate is not None:
            pred = predict(dep, wl, hw, args.rate)
            if not (pred.feasible and pred.ttft_ms <= ttft and pred.tpot_ms <= tpot):
                continue
        else:
            pred = goodput(dep, wl, hw, ttft, tpot)
            if pred.rate <= 0:
                continue
        rows.append((cand, pred))
    if args.rate is not None:
        rows.sort(key=lambda r: (r[1].gpus, -r[1].tokens_per_s_gpu))
    else:
        rows.sort(key=lambda r: (-round(r[1].tokens_per_s_gpu, 6), r[1].gpus))
    best = rows[:args.top]
    agg = next((r for r in rows if r[0].aggregated), None)
    if agg is not None and agg not in best:
        best.append(agg)  # the aggregated alternative beside the disaggregated ones
    out = [{"deployment": c.text, "aggregated": c.aggregated, "gpus": p.gpus,
            "overrides": _merged(args.overrides, c.overrides), **p.to_dict()} for c, p in best]
    if args.plot:
        _plot(args.plot, rows, best, cfg, wl, ttft, tpot, hw.name)
    if args.json:
        dump_json({"hardware": hw.name, "isl": args.isl, "osl": args.osl,
                   "slo": {"ttft_ms": ttft, "tpot_ms": tpot}, "rate": args.rate,
                   "deployments": out})
        return EXIT_OK
    _print(out, cfg, args, hw.name, len(rows))
    return EXIT_OK


def _merged(user: list[str], candidate: tuple[str, ...]) -> list[str]:
    """The user's overrides, less the keys the candidate sets, then the candidate's."""
    keys = {o.split("=", 1)[0] for o in candidate}
    return [*(o for o in user if o.split("=", 1)[0].lstrip("+~") not in keys), *candidate]


def _with_fabric(hw: Any, job_dir: Path | None) -> Any:
    """`hw` with the fabric as measured by a preflight run's fabric check: `nic_eff` the median
    of measured over line rate where the preset gives the links' speed, else
    `default_nic_gbps` the median measured rate (a NIC of unknown speed, e.g. shm)."""
    if job_dir is None:
        return hw
    from statistics import median

    from pdtool.fabric_check import results
    from pdtool.sizing.model import SizingError

    rows = results(job_dir)
    if not rows:
        raise SizingError(f"--fabric: {job_dir} holds no fabric check results: run `pdtool "
                          f"launch ... --preflight --out {job_dir}` first")
    shares = [r["gbps"] / min(r["link_gbps"]) for r in rows if all(r["link_gbps"])]
    if shares:
        return hw.with_fit(nic_eff=min(median(shares), 1.0))
    return hw.with_fit(default_nic_gbps=median(r["gbps"] for r in rows), nic_eff=1.0)


def _print(out: list[dict], cfg: Any, args: argparse.Namespace, hw: str, n: int) -> None:
    from rich.table import Table

    con = console()
    what = (f"at {args.rate:g} requests/s, fewest GPUs first" if args.rate is not None
            else "by goodput per GPU (the highest rate whose mean TTFT and TPOT meet the SLO)")
    con.print(f"{cfg.model.name} on {cfg.cluster.name} ({hw}); input {args.isl}, output "
              f"{args.osl} tokens; SLO {args.slo}; {n} deployments meet it, {what}")
    if not out:
        con.print("[bold red]no deployment meets the SLO[/]: relax it, allow more GPUs "
                  "(--gpus, cluster.nodes) or shorten the requests")
        return
    t = Table(title_justify="left")
    for col in ("#", "deployment", "GPUs", "req/s", "TTFT ms", "TPOT ms", "tok/s/GPU",
                "tok/s/user", "KV ms"):
        t.add_column(col, no_wrap=col != "deployment")
    for i, r in enumerate(out, 1):
        t.add_row(str(i), r["deployment"], str(r["gpus"]), f"{r['rate']:.2f}",
                  f"{r['ttft_ms']:.0f}", f"{r['tpot_ms']:.1f}", f"{r['tokens_per_s_gpu']:.0f}",
                  f"{r['tokens_per_s_user']:.1f}", f"{r['transfer_ms']:.1f}")
    con.print(t)
    for i, r in enumerate(out, 1):
        print(f"{i}: pdtool validate " + " ".join(r["overrides"]))
    print("A model, not a measurement: docs/sizing.md says what it leaves out; "
          "`pdtool size --calibrate results.json` fits it to your cluster.")


def _plot(path: Path, rows: list, best: list, cfg: Any, wl: Any, ttft: float, tpot: float,
          hw: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
    for aggregated, marker, label in ((False, "o", "disaggregated"), (True, "s", "aggregated")):
        pts = [(p.tokens_per_s_user, p.tokens_per_s_gpu) for c, p in rows
               if c.aggregated == aggregated]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, alpha=0.6, label=label)
    for i, (c, p) in enumerate(best, 1):
        ax.annotate(f"{i}: {c.text}", (p.tokens_per_s_user, p.tokens_per_s_gpu), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.axvline(1e3 / tpot, color="red", linestyle="--", label=f"SLO: TPOT {tpot:g} ms")
    ax.set_xlabel("output tokens/s per user (1 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU, at the highest rate meeting the SLO")
    isl = "-".join(str(n) for n in (wl.isl[0][0], wl.isl[-1][0])) if len(wl.isl) > 1 else \
        str(wl.isl[0][0])
    ax.set_title(f"pdtool size: {cfg.model.name} on {cfg.cluster.name} ({hw}), ISL {isl}, "
                 f"OSL {wl.osl}, SLO TTFT {ttft:g} ms / TPOT {tpot:g} ms", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- calibration ---------------------------------------------------------------------------


def bench_points(paths: list[Path]) -> list[Any]:
    """Every run of these `pdtool bench` results.json files as TTFT and TPOT points (the
    deployment from the results' resolved config, its concurrency and mean lengths)."""
    from omegaconf import OmegaConf

    from pdtool.compose import ComposeError, to_typed
    from pdtool.schema import Config
    from pdtool.sizing.calibrate import Point
    from pdtool.sizing.model import SizingError, Workload, deployment

    points = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
            cfg = to_typed(OmegaConf.merge(OmegaConf.structured(Config),
                                           OmegaConf.create(doc["provenance"]["config"])))
            runs = doc["runs"]
        except (OSError, ValueError, KeyError, TypeError, ComposeError) as e:
            raise SizingError(f"--calibrate: {path} is not a pdtool bench results.json ({e})"
                              ) from None
        for run in runs:
            s = run["summary"]
            # "concurrency 4" or "rate 2.5/s" (pdtool.bench.args.Pace)
            pace = re.fullmatch(r"(concurrency|rate) ([0-9.]+)(/s)?", str(run.get("pace")))
            if not s.get("completed") or pace is None:
                continue
            conc = int(pace[2]) if pace[1] == "concurrency" else 0
            rate = float(pace[2]) if pace[1] == "rate" else 0.0
            isl = round(s["input_tokens"] / s["completed"])
            osl = max(round(s["output_tokens"] / s["completed"]), 2)
            dep = deployment(cfg, isl)
            wl = Workload(isl=((isl, 1.0),), osl=osl)
            name = f"{path.name}:{run.get('target', '')}@" + (f"c{conc}" if conc else
                                                                  f"{rate:g}/s")
            for kind in ("ttft_ms", "tpot_ms"):
                points.append(Point(f"{name} {kind[:4].upper()}", dep, wl, kind,
                                    s[kind]["mean"], concurrency=int(conc), rate=float(rate)))
    if not points:
        raise SizingError("--calibrate: no run with a concurrency or rate and completed "
                          "requests")
    return points


def _calibrate(args: argparse.Namespace) -> int:
    from pdtool.sizing.calibrate import fit
    from pdtool.sizing.hardware import for_gpu

    points = bench_points(args.calibrate)
    gpu = points[0].dep.cfg.cluster.gpu_type
    hw = _with_fabric(for_gpu(gpu, args.hardware), args.fabric)
    names = [n.strip() for n in args.fit.split(",") if n.strip()]
    fitted, err = fit(points, hw, names)
    doc = _report(points, hw, fitted, names, err, args)
    if args.json:
        dump_json(doc)
    return EXIT_OK


def _report(points: list, before: Any, after: Any, names: list[str], err: float,
            args: argparse.Namespace) -> dict[str, Any]:
    """The fit, as JSON-ready data (printed as text unless --json), and the fitted entry
    written to --write."""
    import yaml

    from pdtool.sizing.calibrate import model_value

    rows = [{"point": p.name, "kind": p.kind, "measured": p.measured,
             "before": model_value(p, before), "after": model_value(p, after)} for p in points]
    if args.write:
        entry = {k: v for k, v in after.to_dict().items() if k != "name"}
        fitted_to = ", ".join(str(p) for p in args.calibrate or []) or \
            "conf/sizing/published.yaml's fit points"
        entry["sources"] = {**entry["sources"], **{n: f"fitted: {fitted_to}" for n in names}}
        if args.fabric is not None:
            for n in ("nic_eff", "default_nic_gbps"):
                entry["sources"][n] = f"measured: the fabric check of {args.fabric}"
        args.write.write_text(yaml.safe_dump({after.name: entry}, sort_keys=False))
    doc = {"hardware": after.name, "fitted": {n: getattr(after, n) for n in names},
           "error": err, "points": rows}
    if args.json:
        return doc
    print(f"{after.name}: fitted " + ", ".join(f"{n}={getattr(after, n):.4g} (was "
                                               f"{getattr(before, n):.4g})" for n in names)
          + f"; sum of squared log ratios {err:.4f}")
    for r in rows:
        print(f"  {r['point']:<48} measured {r['measured']:>10.4g}  model {r['after']:>10.4g} "
              f"({r['after'] / r['measured'] - 1:+.1%}; before {r['before']:.4g})")
    if args.write:
        print(f"wrote {args.write}: use it with --hardware {args.write}")
    return doc


def published_points(hardware: Path | None = None) -> list[tuple[dict, Any]]:
    """conf/sizing/published.yaml's points, each with its composed deployment."""
    import yaml

    from pdtool.paths import conf_dir
    from pdtool.sizing.calibrate import Point
    from pdtool.sizing.model import SizingError, Workload, deployment

    doc = yaml.safe_load((conf_dir() / "sizing" / "published.yaml").read_text())
    out = []
    for e in doc["points"]:
        cfg = _config(e["overrides"])
        if cfg is None:
            raise SizingError(f"published point {e['name']}: its overrides do not validate")
        isl = int(e.get("isl", e.get("context", 1024)))
        point = Point(e["name"], deployment(cfg, isl),
                      Workload(isl=((isl, 1.0),), osl=int(e.get("osl", 1))), e["kind"],
                      float(e["measured"]), float(e.get("batch_per_gpu", 0)),
                      float(e.get("context", 0)), int(e.get("concurrency", 0)))
        out.append((e, point))
    return out


#: what `--published --refit` fits the H100 entry to (docs/sizing.md says why these two)
PUBLISHED_FIT = ("prefill_mfu", "comm_eff")


def _published(args: argparse.Namespace) -> int:
    from pdtool.sizing.calibrate import fit, model_value
    from pdtool.sizing.hardware import for_gpu

    pts = published_points(args.hardware)
    fitted: dict[str, float] = {}
    fit_doc = None
    if args.refit:
        base = for_gpu("H100-80GB", args.hardware)
        after, err = fit([p for e, p in pts if e["use"] == "fit"], base, PUBLISHED_FIT)
        fitted = {n: getattr(after, n) for n in PUBLISHED_FIT}
        fit_doc = _report([p for e, p in pts if e["use"] == "fit"], base, after,
                          list(PUBLISHED_FIT), err, args)
    rows = []
    for e, p in pts:
        hw = for_gpu(e["hardware"], args.hardware).with_fit(**fitted)
        v = model_value(p, hw)
        rows.append({"point": e["name"], "use": e["use"], "hardware": e["hardware"],
                     "kind": e["kind"], "measured": p.measured, "model": v,
                     "error": v / p.measured - 1, "source": e["source"]})
    if args.json:
        dump_json({"fit": fit_doc, "points": rows})
        return EXIT_OK
    from rich.table import Table

    t = Table(title="the model against published measurements (conf/sizing/published.yaml)",
              title_justify="left")
    for col in ("point", "use", "GPU", "figure", "measured", "model", "error"):
        t.add_column(col, no_wrap=True)
    for r in rows:
        t.add_row(r["point"], r["use"], r["hardware"], r["kind"], f"{r['measured']:,.0f}",
                  f"{r['model']:,.0f}", f"{r['error']:+.1%}")
    console().print(t)
    return EXIT_OK


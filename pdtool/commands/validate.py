"""`pdtool validate`: compose a config and report every problem, with the key and the fix.

Exit 0 when there are no errors (warnings allowed), 1 on errors, 2 when the command line or
the config cannot be composed. Also prints per-role memory fit, KV bytes per token, the
path KV in GPU memory takes (`transfer.gpu_memory`) and the time budgets (`pdtool.budgets`:
each limit against the timers that must fit inside it).
"""

from __future__ import annotations

import argparse
from typing import Any

from pdtool.commands._common import (
    Run,
    add_config_arguments,
    console,
    dump_json,
    exit_code,
    load_runs,
    print_findings,
    run_header,
)

NAME = "validate"
HELP = "check a deployment config (shards, nodes, ports, NICs, memory) and explain problems"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def memory_rows(run: Run) -> list[Any] | None:
    """Per-role memory fit, when the values are sane enough to compute it."""
    from pdtool.memory import deployment_memory
    from pdtool.rules import has_errors, values
    from pdtool.rules import run as run_rules

    cfg = run.cfg
    if cfg is None or has_errors(run_rules(values.ALL, cfg)):
        return None
    return list(deployment_memory(cfg))


def budget_rows(run: Run) -> list[Any] | None:
    """The time budgets (pdtool.budgets), when the single values are sane."""
    from pdtool.budgets import budgets
    from pdtool.rules import has_errors, values
    from pdtool.rules import run as run_rules

    cfg = run.cfg
    if cfg is None or has_errors(run_rules(values.ALL, cfg)):
        return None
    return budgets(cfg)


def gpu_memory_path(run: Run) -> str | None:
    """How KV reaches the fabric (`pdtool.plan.routes.gpu_memory_path`, what `pdtool plan`
    shows), once the config has no errors (with errors the finding says what is wrong)."""
    from pdtool.plan.routes import gpu_memory_path as path_of
    from pdtool.rules import has_errors

    if run.cfg is None or has_errors(run.all_findings):
        return None
    return path_of(run.cfg)


def _result(run: Run) -> dict[str, Any]:
    from dataclasses import asdict

    mem = memory_rows(run)
    budgets = budget_rows(run)
    errors = sum(f.severity == "error" for f in run.all_findings)
    return {
        "overrides": run.overrides,
        "recipe": run.cfg.recipe if run.cfg is not None else None,
        "ok": run.ok,
        "composed": run.composed,
        "errors": errors,
        "warnings": len(run.all_findings) - errors,
        "findings": [f.to_dict() for f in run.all_findings],
        "memory": [asdict(m) for m in mem] if mem else None,
        "gpu_memory": gpu_memory_path(run),
        "budgets": None if budgets is None else [
            {"name": b.name, "key": b.key, "limit_s": b.limit_s, "need_s": b.need_s,
             "parts": [{"key": k, "seconds": s} for k, s in b.parts], "fits": b.fits}
            for b in budgets],
    }


def _print_run(con: Any, run: Run) -> None:
    from pdtool.budgets import parts_text, seconds
    from pdtool.memory import GIB, human_bytes
    from pdtool.schema import headline

    if not run.composed:
        con.print("[bold red]config does not compose:[/]")
        print_findings(con, run.compose_findings)
        return
    cfg = run.cfg
    con.print(f"[bold]{cfg.recipe}[/]: {headline(cfg)}")
    print_findings(con, run.findings)
    mem = memory_rows(run)
    for m in mem or []:
        con.print(
            f"  {m.role:8s} weights {human_bytes(m.weights_gb * GIB)}/GPU, KV budget "
            f"{human_bytes(m.kv_budget_gb * GIB)} ({m.kv_tokens:,} tokens"
            f"{': the engine allocates no more' if m.capped else ''}), "
            f"KV {human_bytes(m.kv_bytes_per_token)}/token and "
            f"{human_bytes(m.kv_bytes_per_page)}/page per rank ({m.kv_dtype})"
        )
    path = gpu_memory_path(run)
    if path is not None:
        con.print(f"  GPU memory: {path}")
    for b in budget_rows(run) or []:
        mark = "ok" if b.fits else "[bold red]too short[/]"
        con.print(f"  budget  {b.name}: {b.key} {seconds(b.limit_s)} >= {parts_text(b)}: "
                  f"{mark}", highlight=False, soft_wrap=True)
    errors = sum(f.severity == "error" for f in run.findings)
    warnings = len(run.findings) - errors
    if errors:
        con.print(f"[bold red]✗ {errors} error(s)[/], {warnings} warning(s)")
    else:
        con.print(f"[bold green]✓ valid[/] ({warnings} warning(s))")


def run(args: argparse.Namespace) -> int:
    from pdtool.launch.host import host_findings

    runs = load_runs(args)
    for r in runs:  # launcher=local: the preset against this machine
        if r.cfg is not None:
            r.findings += host_findings(r.cfg)
    if args.json:
        results = [_result(r) for r in runs]
        dump_json(results if args.multirun else results[0])
        return exit_code(runs)
    con = console()
    for i, r in enumerate(runs):
        run_header(con, runs, i)
        _print_run(con, r)
    return exit_code(runs)

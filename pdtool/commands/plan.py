"""`pdtool plan`: the resolved deployment — instances, ranks with node/GPU/NIC/NUMA/CPUs,
ports, memory and KV sizes, and the KV transfer routes with the writes each decoder counts.

Refuses (exit 1, findings printed) when the config has validation errors; `--json` prints the
plan exactly as `pdtool.plan.plan_to_dict` returns it (what render and the workers read).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pdtool.commands._common import (
    EXIT_ERRORS,
    EXIT_OK,
    add_config_arguments,
    console,
    dump_json,
    exit_code,
    load_runs,
    print_findings,
    run_header,
)

NAME = "plan"
HELP = "show the resolved deployment: ranks, NICs, ports, memory and KV transfer routes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        metavar="N",
        help="prompt length for the per-request write counts (default 4096)",
    )
    p.add_argument(
        "--no-ranks",
        action="store_true",
        help="leave out the per-rank table (large deployments)",
    )
    p.add_argument(
        "--fabric",
        type=Path,
        metavar="JOB_DIR",
        help="add the fabric check a --preflight run of this job folder measured (per NIC "
        "pair: Gbit/s against the links and the floor)",
    )


def _heads(lo: int, n: int) -> str:
    return f"head {lo}" if n == 1 else f"heads {lo}-{lo + n - 1}"


def _sources(cands: tuple[int, ...]) -> str:
    if len(cands) == 1:
        return f"prefill rank {cands[0]}"
    return f"any of prefill ranks {cands[0]}-{cands[-1]} ({len(cands)} replicas)"


def _nics(names: tuple[str, ...], kind: str) -> str:
    shown = ",".join(names) if len(names) <= 2 else f"{names[0]}..{names[-1]} ({len(names)})"
    return f"{shown or 'none'} {kind}".strip()


def _layout(t: Any) -> str:
    """The layout written, and where it comes from when the config value does not apply."""
    if t.layout_source == "transfer.layout":
        return t.layout
    parts = "K and V buffers" if t.buffers_per_layer > 1 else "one buffer"
    return f"{t.layout} ({t.layout_source}, {parts} per layer; transfer.layout does not apply)"


def print_fabric(con: Any, plan: Any, rows: list[dict[str, Any]]) -> None:
    """The fabric check's pairs (pdtool.fabric_check.results) as a table."""
    from rich.table import Table

    from pdtool.fabric_check import enabled, floor_gbps

    t = plan.transfer
    if not enabled(plan):
        con.print("fabric check: none (transfer.preflight_mib=0, an aggregated deployment or "
                  "another backend)")
        return
    floor = floor_gbps(plan, "", "") if t.preflight_min_gbps >= 0 else None
    rule = (f"{floor:g} Gbit/s (transfer.preflight_min_gbps)" if floor is not None
            else "a quarter of the slower link, where its speed is known")
    con.print(f"fabric check (--preflight runs): {t.preflight_mib} MiB per prefill->decode NIC "
              f"pair, floor {rule}")
    if not rows:
        return
    ft = Table(title="fabric check, measured", title_justify="left")
    for col in ("prefill rank", "NIC", "decode rank", "NIC", "Gbit/s", "links", "floor", ""):
        ft.add_column(col, no_wrap=True)
    for r in rows:
        links = "/".join(f"{g:g}" if g else "?" for g in r["link_gbps"])
        slow = r["gbps"] < r["floor_gbps"]
        ft.add_row(r["src"], r["src_nic"], r["dst"], r["dst_nic"], f"{r['gbps']:g}", links,
                   f"{r['floor_gbps']:g}" if r["floor_gbps"] else "-",
                   "[bold red]SLOW[/]" if slow else "ok")
    con.print(ft)


def print_plan(con: Any, plan: Any, show_ranks: bool = True, headline: str = "",
               fabric: list[dict[str, Any]] | None = None) -> None:
    from rich.table import Table

    from pdtool.memory import GIB, human_bytes

    m, c, t = plan.model, plan.cluster, plan.transfer
    con.print(f"[bold]{plan.recipe}[/]: {headline or plan.description}")
    heads = (
        f"MLA latent {m.kv_lora_rank}+{m.qk_rope_head_dim}"
        if m.attention == "mla"
        else f"{m.num_kv_heads} KV heads x {m.head_dim}"
    )
    con.print(
        f"model [cyan]{m.name}[/] ({m.attention}, {m.num_layers} layers, {heads}, {m.dtype}, "
        f"{m.num_params_b:g}B params) | cluster [cyan]{c.name}[/] ({c.gpus_per_node}x "
        f"{c.gpu_type}, {c.device}) | {plan.nodes} node(s) | launcher [cyan]{plan.launcher}[/]"
        f" | engine [cyan]{plan.engine}[/] | mode [cyan]{plan.mode}[/]"
    )

    it = Table(title="instances", title_justify="left")
    for col in ("instance", "TP", "DP", "GPUs", "nodes", "HTTP", "bootstrap", "dist-init"):
        it.add_column(col, no_wrap=True)
    for i in plan.instances:
        dp = f"{i.dp}" + (" (attn)" if i.dp_attention else "")
        it.add_row(
            i.name,
            str(i.tp),
            dp,
            str(i.gpus),
            ",".join(map(str, i.nodes)),
            str(i.http_port),
            str(i.bootstrap_port or "-"),
            str(i.dist_init_port),
        )
    con.print(it)
    r = plan.router
    if plan.aggregated:
        con.print(
            f"router on node {r.node}:{r.port} ({r.policy}): whole requests to "
            + ", ".join(f"{x.instance}@node{x.node}:{x.http_port}" for x in r.targets)
        )
    else:
        con.print(
            f"router on node {r.node}:{r.port} ({r.policy}): prefill "
            + ", ".join(
                f"{x.instance}@node{x.node}:{x.http_port}+{x.bootstrap_port}" for x in r.prefill
            )
            + " | decode "
            + ", ".join(f"{x.instance}@node{x.node}:{x.http_port}" for x in r.decode)
        )
    if r.metrics_port is not None:
        con.print(f"router metrics (Prometheus): node {r.node}:{r.metrics_port}/metrics")

    if show_ranks:
        rt = Table(title="ranks", title_justify="left")
        for col in ("instance", "rank", "dp/tp", "node", "GPU", "NUMA", "CPUs", "NIC", "near"):
            rt.add_column(col, no_wrap=True)
        for x in plan.all_ranks():
            rt.add_row(
                f"{x.role}-{x.instance}",
                str(x.rank),
                f"{x.dp_rank}/{x.tp_rank}",
                str(x.node),
                str(x.gpu),
                str(x.numa),
                x.cpus,
                _nics(x.nics, x.nic_kind),
                x.nic_affinity,
            )
        con.print(rt)

    mt = Table(title="memory per GPU", title_justify="left")
    for col in ("role", "weights", "KV budget", "KV/token", "KV/page", "tokens", "KV dtype"):
        mt.add_column(col, no_wrap=True)
    for mm in plan.memory:
        mt.add_row(
            mm.role,
            human_bytes(mm.weights_gb * GIB),
            human_bytes(mm.kv_budget_gb * GIB),
            human_bytes(mm.kv_bytes_per_token),
            human_bytes(mm.kv_bytes_per_page),
            f"{mm.kv_tokens:,}",
            mm.kv_dtype,
        )
    con.print(mt)
    for mm in plan.memory:
        if mm.capped:
            con.print(f"{mm.role}: the reference engine allocates {mm.kv_pages:,} KV pages "
                      f"({mm.kv_tokens:,} tokens) per rank at most, whatever the budget")
    if plan.aggregated:
        con.print("transfer: none (mode=aggregated: every instance prefills and decodes its "
                  "own requests; transfer.* is not used)")
        return

    con.print(
        f"transfer: provider [cyan]{t.provider}[/], layout [cyan]{_layout(t)}[/], page "
        f"{t.page_size} tokens; prefill attention TP "
        f"{t.prefill.attn_tp} ({t.prefill.heads_per_rank} head(s)/rank"
        f"{', replicated' if t.prefill.replicated else ''}) -> decode attention TP "
        f"{t.decode.attn_tp} ({t.decode.heads_per_rank} head(s)/rank"
        f"{', replicated' if t.decode.replicated else ''})"
    )
    con.print(f"GPU memory: {t.gpu_memory_path}")
    con.print(f"routes: {t.summary}")
    if t.draft:
        con.print(t.draft)
    ct = Table(
        title=f"routes for a {t.tokens}-token request ({t.pages_per_request} pages x "
        f"{m.num_layers} layers"
        + (f" x {t.buffers_per_layer} buffers (K, V)" if t.buffers_per_layer > 1 else "")
        + (" + the draft's buffers" if t.draft else "")
        + f" + {t.aux_writes} aux)",
        title_justify="left",
    )
    for col in ("decode rank", "receives", "writes/page", "writes/request"):
        ct.add_column(col, overflow="fold")
    for route in t.routes:
        recv = "; ".join(
            f"{_heads(s.head_lo, s.num_heads)} from {_sources(s.src_candidates)}"
            + (f" [{s.writes_per_page}/page]" if len(route.slices) > 1 else "")
            for s in route.slices
        )
        ct.add_row(
            str(route.dst_rank), recv, str(route.writes_per_page), f"{route.writes_per_request:,}"
        )
    con.print(ct)
    print_fabric(con, plan, fabric or [])


def run(args: argparse.Namespace) -> int:
    from pdtool.plan import PlanError, build_plan, plan_to_dict
    from pdtool.schema import headline

    if args.tokens < 1:
        print("pdtool plan: --tokens must be >= 1", file=sys.stderr)
        return 2
    fabric: list[dict[str, Any]] | None = None
    if args.fabric is not None:
        from pdtool.fabric_check import FOLDER, results

        if not (args.fabric / FOLDER / "results").is_dir():
            print(f"pdtool plan: --fabric: {args.fabric} holds no fabric check results "
                  f"({FOLDER}/results/): run `pdtool launch ... --preflight --out "
                  f"{args.fabric}` first", file=sys.stderr)
            return 2
        fabric = results(args.fabric)
    runs = load_runs(args)
    con = console()
    err = console(stderr=True)
    out: list[dict[str, Any]] = []
    codes = []
    for i, r in enumerate(runs):
        if not args.json:
            run_header(con, runs, i)
        if not r.ok:
            if args.json:
                out.append(
                    {
                        "overrides": r.overrides,
                        "plan": None,
                        "findings": [f.to_dict() for f in r.all_findings],
                    }
                )
            else:
                con.print("[bold red]not planned: the config has errors[/]")
                print_findings(con, r.all_findings)
            codes.append(r.exit_code)
            continue
        try:
            plan = build_plan(r.cfg, tokens=args.tokens)
        except PlanError as e:  # the validator should have caught it: report, not crash
            err.print(f"[bold red]cannot plan:[/] {e}")
            if args.json:
                out.append({"overrides": r.overrides, "plan": None, "error": str(e)})
            codes.append(EXIT_ERRORS)
            continue
        warnings = [f for f in r.findings if f.severity == "warning"]
        if args.json:
            data = plan_to_dict(plan)
            if fabric is not None:
                data = {**data, "fabric_check": fabric}
            if args.multirun:
                out.append({"overrides": r.overrides, "plan": data})
            else:
                out.append(data)
            print_findings(err, warnings)
        else:
            print_findings(con, warnings)
            print_plan(con, plan, show_ranks=not args.no_ranks, headline=headline(r.cfg),
                       fabric=fabric)
        codes.append(EXIT_OK)
    if args.json:
        dump_json(out if args.multirun else out[0])
    return max([*codes, exit_code(runs)])

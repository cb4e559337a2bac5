"""What config-taking commands share: override arguments, multirun expansion, composition
and validation per run, and printing findings.

Other commands (render, launch) can reuse `add_config_arguments` + `load_runs`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from pdtool.rules.finding import Finding, has_errors

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


@dataclass
class Run:
    """One composition (one point of a multirun sweep)."""

    overrides: list[str]
    cfg: Any = None  # pdtool.schema.Config, or None when composition failed
    compose_findings: list[Finding] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)  # validation findings

    @property
    def composed(self) -> bool:
        return self.cfg is not None

    @property
    def ok(self) -> bool:
        return self.composed and not has_errors(self.findings)

    @property
    def exit_code(self) -> int:
        if not self.composed:
            return EXIT_USAGE
        return EXIT_ERRORS if has_errors(self.findings) else EXIT_OK

    @property
    def all_findings(self) -> list[Finding]:
        return self.compose_findings + self.findings


def add_overrides_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="OVERRIDE",
        help="Hydra overrides: +recipe=NAME, key=value, group=option",
    )


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    add_overrides_argument(p)
    p.add_argument(
        "-m",
        "--multirun",
        action="store_true",
        help="expand sweeps (key=a,b,c) and run once per combination",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def load_runs(args: argparse.Namespace, *, validate: bool = True) -> list[Run]:
    """Compose (and validate) one run per sweep combination (one run without -m)."""
    from pdtool.compose import ComposeError, expand_sweeps, load_config

    overrides = list(args.overrides)
    if args.multirun:
        try:
            combos = expand_sweeps(overrides)
        except ComposeError as e:
            return [Run(overrides, None, e.findings)]
    else:
        combos = [overrides]
    runs = []
    for combo in combos:
        cfg, problems = load_config(combo)
        run = Run(combo, cfg, problems)
        if cfg is not None and validate:
            from pdtool.rules import validate as validate_cfg

            run.findings = validate_cfg(cfg)
        runs.append(run)
    return runs


def exit_code(runs: list[Run]) -> int:
    return max((r.exit_code for r in runs), default=EXIT_OK)


def console(stderr: bool = False) -> Any:
    import shutil

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # rich falls back to 80 columns when piped; wide tables read better in logs at 120
    width = None if stream.isatty() else shutil.get_terminal_size((120, 24)).columns
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def print_findings(con: Any, findings: list[Finding]) -> None:
    from rich.table import Table

    if not findings:
        return
    t = Table(show_lines=False, expand=False, pad_edge=False)
    t.add_column("", no_wrap=True)
    t.add_column("key", style="bold cyan", no_wrap=True)
    t.add_column("problem", overflow="fold")
    t.add_column("fix", style="green", overflow="fold")
    for f in findings:
        sev = "[bold red]error[/]" if f.severity == "error" else "[yellow]warning[/]"
        t.add_row(sev, f.key, _esc(f.message), _esc(f.fix))
    con.print(t)


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def run_header(con: Any, runs: list[Run], i: int) -> None:
    if len(runs) > 1:
        r = runs[i]
        con.rule(f"run {i}: {' '.join(r.overrides) or '(defaults)'}", style="dim")


def dump_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def error_line(message: str) -> None:
    """One line on stderr saying what went wrong (no traceback)."""
    print(f"pdtool: ERROR: {message}", file=sys.stderr, flush=True)

"""`pdtool render [+recipe=NAME] [overrides...] --out DIR`: write a job folder.

With `-m`, sweeps (`decode.instances=1,2,3`) render one folder per combination: `DIR/<i>`, or
`<output_dir>/<job_name>-<timestamp>-<i>` without --out.

The folder holds the launcher's script (job.sbatch or run_local.sh), the resolved config, the
plan, every process's command line (launch.json) and a 0600 control-plane secret, so the job can
be re-run from the folder alone. A config with validation errors is refused (findings printed,
exit 1); nothing is written then.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

NAME = "render"
HELP = "write the launch scripts, resolved config and plan of a deployment into a folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Overrides, sweeps and the job folder; `pdtool launch` takes the same."""
    from pdtool.commands._common import add_overrides_argument

    add_overrides_argument(p)
    p.add_argument(
        "-m",
        "--multirun",
        action="store_true",
        help="expand sweeps (key=a,b,c): one job folder per combination, <out>/<index> "
        "(or one timestamped folder each)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="job folder (default: <launcher.output_dir>/<job_name>-<timestamp>)",
    )


def combinations(args: argparse.Namespace) -> tuple[list[tuple[list[str], Path | None, str]], int]:
    """([(overrides, job folder or None for the default, folder suffix)], 0), one per sweep
    point (one without -m), or ([], exit code) after printing why the sweep is invalid."""
    from pdtool.commands._common import EXIT_USAGE, console, print_findings
    from pdtool.compose import ComposeError, expand_sweeps

    if not getattr(args, "multirun", False):
        return [(list(args.overrides), args.out, "")], 0
    try:
        combos = expand_sweeps(list(args.overrides))
    except ComposeError as e:
        print_findings(console(stderr=True), e.findings)
        return [], EXIT_USAGE
    if len(combos) == 1:
        return [(combos[0], args.out, "")], 0
    return [(c, args.out / str(i) if args.out else None, f"-{i}")
            for i, c in enumerate(combos)], 0


def default_out(cfg: Any, suffix: str = "") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.launcher.output_dir) / f"{cfg.launcher.job_name}-{stamp}{suffix}"


def render_or_explain(overrides: list[str], out: Path | None, suffix: str = "",
                      write: bool = True, check_host: bool = False) -> tuple[Any, int]:
    """(Rendered, 0) or (None, exit code) after printing the findings that refused it.
    `write=False` (a dry run) builds everything and writes nothing; then `Rendered.text` is
    the script. `check_host` (launch): a launcher=local deployment whose cluster preset this
    machine does not match, or whose ports a process here holds, is refused before its job
    folder (and secret) is written."""
    from pdtool.commands._common import EXIT_ERRORS, EXIT_USAGE, console, print_findings
    from pdtool.launch.spec import LaunchError
    from pdtool.render import build_job, prepare, write_job_folder
    from pdtool.rules.finding import error

    cfg, plan, findings = prepare(overrides)
    err = console(stderr=True)
    if plan is None:
        err.print("[bold red]not rendered:[/] the config has errors")
        print_findings(err, findings)
        return None, EXIT_USAGE if cfg is None else EXIT_ERRORS
    if findings:
        print_findings(err, findings)  # warnings only
    if check_host:
        from pdtool.launch.host import host_findings, port_findings

        if mismatch := host_findings(cfg):
            err.print("[bold red]not started:[/] this machine does not match the cluster preset")
            print_findings(err, mismatch)
            return None, EXIT_ERRORS
        if taken := port_findings(cfg):
            err.print("[bold red]not started:[/] ports of the deployment are in use here")
            print_findings(err, taken)
            return None, EXIT_ERRORS
    try:
        if not write:
            rendered, text, _ = build_job(cfg, plan, out or default_out(cfg, suffix))
            rendered.text = text
            return rendered, 0
        return write_job_folder(cfg, plan, out or default_out(cfg, suffix)), 0
    except LaunchError as e:
        key, _, msg = str(e).partition(": ")
        err.print("[bold red]not rendered:[/]")
        print_findings(err, [error(key, msg or str(e))])
        return None, EXIT_ERRORS
    except OSError as e:  # the job folder cannot be written there: the user's --out
        folder = out or default_out(cfg, suffix)
        err.print("[bold red]not rendered:[/]")
        print_findings(err, [error("--out", f"cannot write the job folder {folder}: "
                                   f"{e.strerror or e} ({e.filename or folder})",
                                   "choose a folder you can write, e.g. --out ./job "
                                   "(default: launcher.output_dir)")])
        return None, EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    combos, code = combinations(args)
    worst = code
    for overrides, out, suffix in combos:
        if len(combos) > 1:
            print(f"--- {' '.join(overrides)}")
        worst = max(worst, _render_one(overrides, out, suffix))
    return worst


def _render_one(overrides: list[str], out: Path | None, suffix: str) -> int:
    rendered, code = render_or_explain(overrides, out, suffix)
    if rendered is None:
        return code
    spec = rendered.spec
    print(
        f"rendered {rendered.cfg.recipe or 'default'} for launcher={spec.launcher}, "
        f"engine={spec.engine}: {len(spec.procs)} worker process(es) + router on "
        f"{spec.job.nodes} node(s)"
    )
    for name in (rendered.script.name, "config.yaml", "plan.json", "launch.json", "secret.key"):
        print(f"  {rendered.out / name}")
    how = "sbatch" if spec.launcher == "slurm" else "bash"
    print(f"run it with: {how} {rendered.script}", file=sys.stdout)
    return 0

"""`pdtool render [+recipe=NAME] [overrides...] --out DIR`: write a job folder.

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
    """Overrides and the job folder; `pdtool launch` takes the same two."""
    from pdtool.commands._common import add_overrides_argument

    add_overrides_argument(p)
    p.add_argument(
        "--out",
        type=Path,
        help="job folder (default: <launcher.output_dir>/<job_name>-<timestamp>)",
    )


def default_out(cfg: Any) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.launcher.output_dir) / f"{cfg.launcher.job_name}-{stamp}"


def render_or_explain(overrides: list[str], out: Path | None) -> tuple[Any, int]:
    """(Rendered, 0) or (None, exit code) after printing the findings that refused it."""
    from pdtool.commands._common import EXIT_ERRORS, EXIT_USAGE, console, print_findings
    from pdtool.launch.spec import LaunchError
    from pdtool.render import prepare, write_job_folder
    from pdtool.rules.finding import error

    cfg, plan, findings = prepare(overrides)
    err = console(stderr=True)
    if plan is None:
        err.print("[bold red]not rendered:[/] the config has errors")
        print_findings(err, findings)
        return None, EXIT_USAGE if cfg is None else EXIT_ERRORS
    if findings:
        print_findings(err, findings)  # warnings only
    try:
        return write_job_folder(cfg, plan, out or default_out(cfg)), 0
    except LaunchError as e:
        key, _, msg = str(e).partition(": ")
        err.print("[bold red]not rendered:[/]")
        print_findings(err, [error(key, msg or str(e))])
        return None, EXIT_ERRORS


def run(args: argparse.Namespace) -> int:
    rendered, code = render_or_explain(args.overrides, args.out)
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

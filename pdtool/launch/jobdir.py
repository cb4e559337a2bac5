"""What a helper the job script runs (`python -m pdtool.launch.MODULE JOB_DIR HOST...`) is
given: the job folder, whose resolved config and plan it loads, and the address of each node
of the allocation (HOST k: node k), known only once the job runs."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def arguments(argv: Sequence[str] | None, module: str) -> tuple[Path, list[str]] | None:
    """(job folder, hosts) from the command line; None after printing the usage."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(f"usage: python -m {module} JOB_DIR HOST...", file=sys.stderr)
        return None
    return Path(args[0]), args[1:]


def load(run_dir: Path) -> tuple[Any, Any]:
    """(config, plan) of a rendered job folder; ComposeError, OSError or ValueError naming
    what could not be read."""
    from pdtool.compose import load_job_config
    from pdtool.plan import from_json

    return load_job_config(run_dir), from_json((run_dir / "plan.json").read_text())

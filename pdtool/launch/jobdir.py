"""A rendered job folder's resolved config and plan, as the supervisor and its helpers load
them when the job runs (they travel in the folder: config.yaml, plan.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load(run_dir: Path) -> tuple[Any, Any]:
    """(config, plan) of a rendered job folder; ComposeError, OSError or ValueError naming
    what could not be read."""
    from pdtool.compose import load_job_config
    from pdtool.plan import from_json

    return load_job_config(run_dir), from_json((run_dir / "plan.json").read_text())

"""Submit a rendered job folder with `sbatch` (the batch script does the rest on the nodes)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class SubmitError(RuntimeError):
    """sbatch is missing or refused the job; the message carries sbatch's own words."""


@dataclass
class Submitted:
    job_id: str
    cluster: str
    log_dir: Path  # one log per process, created when the job starts
    batch_log: Path  # the batch script's own output (health progress, failures)


def submit(script: Path, exit_when_healthy: bool = False, preflight: bool = False) -> Submitted:
    """`sbatch --parsable SCRIPT` from the job folder; returns the job id and where logs go."""
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found: run on a Slurm login node (or use launcher=local)")
    script = Path(script).resolve()
    # the options are the script's arguments: inherited environment is lost with
    # SBATCH_EXPORT=NONE, and a stale value in this shell must not change the job
    args = [*(["--preflight"] if preflight else []),
            *(["--exit-when-healthy"] if exit_when_healthy else [])]
    res = subprocess.run(["sbatch", "--parsable", str(script), *args], cwd=script.parent,
                         env=dict(os.environ), capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip() or f"exit status {res.returncode}"
        raise SubmitError(f"sbatch refused {script}: {msg}")
    job_id, _, cluster = res.stdout.strip().partition(";")
    run_dir = script.parent
    return Submitted(job_id=job_id, cluster=cluster, log_dir=run_dir / "logs" / job_id,
                     batch_log=run_dir / "logs" / f"slurm-{job_id}.out")

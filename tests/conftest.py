"""Shared pytest fixtures. Each block belongs to the issue that added it; add yours surgically."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


# -- launch issue: a real 4-node Slurm cluster on this machine (tests/slurm_cluster.py) --------
@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running emulated 4-node Slurm cluster; stopped (scontrol shutdown) after the session."""
    from slurm_cluster import slurm_cluster

    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster

"""Shared pytest fixtures. Each block belongs to the issue that added it; add yours surgically."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


# -- markers (registered in pyproject.toml): what a test needs beyond Python -------------------
#: Test modules whose every test needs a part of the machine, by marker. A module not listed
#: can mark itself (`pytestmark = pytest.mark.fabric`); the Slurm fixture marks its users.
MODULE_MARKS: dict[str, tuple[str, ...]] = {
    # libfabric in this process, or in the engine processes the test starts (the reference
    # engine's messenger, pdtool's SGLang backend)
    "test_fabric": ("fabric",),
    "test_messenger": ("fabric",),
    "test_messenger_faults": ("fabric",),
    "test_messenger_slots": ("fabric",),
    "test_faults_random": ("fabric",),
    "test_local_launch": ("fabric",),
    "test_reference_serve": ("fabric",),
    "test_reference_smoke": ("fabric",),
    "test_reference_slurm": ("fabric",),
    "test_reliability_serve": ("fabric",),
    "test_workerenv": ("fabric",),
    "test_staging": ("fabric",),
    "test_reference_aggregated": ("fabric",),
    "test_reference_hf": ("fabric",),
    "test_reference_layout": ("fabric",),
    "test_reference_openai": ("fabric",),
    "test_bench_run": ("fabric",),
    "test_bench_messenger": ("fabric",),
    "test_progress": ("fabric",),
    "test_restart": ("fabric",),
    "test_launcher_benchmark": ("fabric",),
    "test_plane_ledger": ("fabric",),
    "test_sglang_backend": ("fabric", "sglang"),
    "test_sglang_frames": ("fabric", "sglang"),  # transfer.sglang.conn loads the binding
    "test_sglang_nics": ("fabric", "sglang"),
    "test_sglang_nics_slow_peer": ("fabric", "sglang"),
    "test_sglang_staging": ("fabric", "sglang"),
    "test_sglang_layer_stream": ("fabric", "sglang"),
    "test_sglang_idle_wait": ("fabric", "sglang"),
    # real SGLang servers and sglang-router, started by `pdtool launch +recipe=sglang-local`
    "test_sglang_servers": ("fabric", "sglang"),
    "test_sglang_servers_tcp": ("fabric", "sglang"),
    # SGLang's own classes and parsers
    "test_sglang_plugin": ("sglang",),
    "test_sglang_lines": ("sglang",),
    "test_geometry": ("sglang",),
}
#: Fixtures that bring a part up, by the marker their users get.
FIXTURE_MARKS = {"slurm": "slurm"}
#: Markers whose tests start a service and are `slow` whatever they do besides (the cost tier:
#: `pytest -m "not slow"` is the quick inner loop; tests that take seconds carry the marker)
SLOW_MARKS = ("slurm", "sglang_servers")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem if item.path else ""
        for name in MODULE_MARKS.get(module, ()):
            item.add_marker(name)
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in FIXTURE_MARKS:
                item.add_marker(FIXTURE_MARKS[fixture])
        if any(item.get_closest_marker(m) for m in SLOW_MARKS):
            item.add_marker("slow")


# -- launch issue: a real 4-node Slurm cluster on this machine (tests/slurm_cluster.py) --------
@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running emulated 4-node Slurm cluster; stopped (scontrol shutdown) after the session."""
    from helpers.slurm_cluster import slurm_cluster

    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster

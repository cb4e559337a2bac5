"""`pdtool discover`: a cluster preset from the node it runs on.

On this machine (no GPU) the preset it writes validates and launches tiny-local. On recorded
node topologies (tests/helpers/node_trees.py: AWS p5 and p5en, NVIDIA DGX H100, from
docs/topologies.md) it finds the GPU -> NIC map, NUMA placement and CPU lists the hand-written
presets carry, and leaves out what must not carry KV (storage ports, a port that is down).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.node_trees import dgx_h100, p5, p5en

CLI = [sys.executable, "-m", "pdtool.cli"]
PRESETS = Path(__file__).resolve().parent.parent / "conf" / "cluster"


def _discover(tmp_path: Path, tree, name: str) -> tuple[dict, str]:
    root, bindir = tmp_path / "root", tmp_path / "bin"
    tree.write(root, bindir)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run([*CLI, "discover", "--root", str(root), "--name", name,
                          "--out", str(tmp_path / "presets")],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    text = (tmp_path / "presets" / "cluster" / f"{name}.yaml").read_text()
    return yaml.safe_load(text), text


@pytest.mark.parametrize(("tree", "preset"), [(p5, "p5"), (p5en, "p5en"),
                                              (dgx_h100, "dgx-h100")])
def test_recorded_nodes_give_the_hand_written_presets(tmp_path: Path, tree, preset) -> None:
    got, text = _discover(tmp_path, tree(), f"found-{preset}")
    want = yaml.safe_load((PRESETS / f"{preset}.yaml").read_text())
    for key in ("gpus_per_node", "device", "gpu_numa", "numa_cpus", "nics"):
        assert got[key] == want[key], key
    assert abs(got["gpu_memory_gb"] - want["gpu_memory_gb"]) < 1
    if preset == "dgx-h100":  # the storage and management ports are named, not used
        for name in ("mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"):
            assert f"# left out {name}: near no GPU" in text
    # the preset composes as cluster=NAME and a recipe validates on it
    res = subprocess.run([*CLI, "validate", "+recipe=deepseek-r1",
                          f"hydra.searchpath=[file://{tmp_path / 'presets'}]",
                          f"cluster=found-{preset}", "transfer=" +
                          ("verbs" if preset == "dgx-h100" else "efa"),
                          "cluster.gpu_memory_gb=141"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_port_that_is_down_is_left_out_and_said(tmp_path: Path) -> None:
    got, text = _discover(tmp_path, dgx_h100(down="mlx5_3"), "down")
    assert "mlx5_3" not in [n["name"] for n in got["nics"]]
    assert "# left out mlx5_3: port state DOWN" in text
    assert "# GPUs [1] have no RDMA NIC on their PCIe switch" in text


@pytest.mark.slow
def test_this_machine_gives_a_preset_that_launches_tiny_local(tmp_path: Path) -> None:
    """No GPU here: a CPU preset of worker slots from this machine's CPUs, which validates
    and serves tiny-local (--smoke checks the tokens against the model in process)."""
    res = subprocess.run([*CLI, "discover", "--name", "here", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "use it with: pdtool validate" in res.stdout
    got = yaml.safe_load((tmp_path / "cluster" / "here.yaml").read_text())
    assert got["device"] == "cpu" and [n["kind"] for n in got["nics"]] == ["shm", "tcp"]
    allowed = sorted(os.sched_getaffinity(0))
    from pdtool.plan import expand_cpus

    assert sorted(c for cpus in got["numa_cpus"] for c in expand_cpus(cpus)) == allowed
    from pdtool.engines.reference.local import free_port_run

    base = free_port_run(40)
    ports = [f"prefill.http_port={base}", f"prefill.bootstrap_port={base + 10}",
             f"prefill.dist_init_port={base + 20}", f"decode.http_port={base + 30}",
             f"router.port={base + 39}"]
    res = subprocess.run([*CLI, "launch", "+recipe=tiny-local",
                          f"hydra.searchpath=[file://{tmp_path}]", "cluster=here", *ports,
                          "--smoke", "--out", str(tmp_path / "job")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "smoke passed" in res.stdout

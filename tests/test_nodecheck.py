"""Every worker compares this node with the plan before its engine starts
(pdtool.nodecheck): GPUs, NICs and their state, NUMA nodes, CPUs; a mismatch stops the job
naming the preset key. Unit checks on a recorded DGX H100 tree (tests/helpers/node_trees.py)
and a real launch on this machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from helpers.node_trees import dgx_h100, p5
from helpers.pdtool_cfg import recipe

from pdtool.nodecheck import (
    cpu_problems,
    cpus_from_node,
    gpu_problems,
    nic_problems,
    numa_problems,
)
from pdtool.plan import build_plan, compress_cpus


def _rank(rank: int, gpu: int, nics: tuple[str, ...], kind: str, numa: int = 0,
          cpus: str = "") -> SimpleNamespace:
    return SimpleNamespace(rank=rank, gpu=gpu, nics=nics, nic_kind=kind, numa=numa, cpus=cpus)


def _tree(tmp_path: Path, **kw) -> tuple[Path, str]:
    """A recorded DGX H100's sysfs under tmp_path, and its nvidia-smi output."""
    tree, root = dgx_h100(**kw), tmp_path / "root"
    tree.write(root, tmp_path / "bin")
    return root, tree.smi_text()


def test_nics_that_are_missing_or_down_are_named(tmp_path: Path) -> None:
    root, _ = _tree(tmp_path, down="mlx5_3")
    ranks = [_rank(0, 0, ("mlx5_0",), "connectx"), _rank(1, 1, ("mlx5_3",), "connectx"),
             _rank(2, 2, ("mlx5_99",), "connectx")]
    down, missing = nic_problems(ranks, root)
    assert down.startswith("rank 1: NIC mlx5_3 is DOWN, not ACTIVE")
    assert "rank 2: NIC mlx5_99 (connectx) is not on this node" in missing
    assert "mlx5_3 (DOWN)" in missing and "cluster.nics" in missing


def test_gpus_numa_nodes_and_cpus_against_the_plan(tmp_path: Path, monkeypatch) -> None:
    root, smi = _tree(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # GPUs 0-3 are on NUMA 0 in the tree: a plan that says 1 for GPU 2 is another node
    ranks = [_rank(0, 0, (), "", numa=0), _rank(1, 2, (), "", numa=1)]
    (p,) = gpu_problems(ranks, root, smi)
    assert p.startswith("rank 1: GPU 2 is on NUMA node 0, the plan says 1: cluster.gpu_numa")
    (p,) = gpu_problems([_rank(0, 8, (), "")], root, smi)
    assert "sees 8 GPU(s)" in p and "addresses GPU 8" in p
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what a Slurm step was given
    (p,) = gpu_problems([_rank(0, 3, (), "")], root, smi)
    assert "CUDA_VISIBLE_DEVICES=0,1" in p and "launcher.gpus_per_node" in p
    assert numa_problems([_rank(0, 0, (), "", numa=2)], root)[0].startswith(
        "rank 0: NUMA node 2 is not on this node (it has [0, 1])")
    (p,) = cpu_problems([_rank(0, 0, (), "", cpus="0-3,8")], {0, 1, 2})
    assert "CPUs 3,8 of its plan list 0-3,8 are not this process's (it may use 0-2)" in p


def test_an_exclusive_slurm_worker_takes_its_share_of_the_nodes_own_cpus(
        tmp_path: Path) -> None:
    """The p5 preset lists 192 CPUs (SMT on); this p5 has SMT off, and Slurm keeps 4 cores of
    NUMA 0 for itself (CoreSpecCount): each rank takes its share of what the node has."""
    tree = p5()
    tree.numa_cpus = ["0-47", "48-95"]
    root = tmp_path / "root"
    tree.write(root, tmp_path / "bin")
    plan = build_plan(recipe("llama-3.1-70b", "launcher=slurm", "cluster.nodes=16"))
    (prefill,) = plan.role_instances("prefill")
    by_gpu = {r.gpu: r for r in prefill.ranks}
    assert by_gpu[0].cpus == "0-11,96-107"  # the preset's forecast
    cpus, problems = cpus_from_node(plan, [by_gpu[0]], root, allowed=set(range(96)))
    assert compress_cpus(cpus) == "0-11" and problems == []
    cpus, _ = cpus_from_node(plan, [by_gpu[5]], root, allowed=set(range(96)))
    assert compress_cpus(cpus) == "60-71"  # NUMA 1, its second of four GPUs
    allowed = set(range(4, 96))
    shares = [compress_cpus(cpus_from_node(plan, [by_gpu[g]], root, allowed)[0])
              for g in range(4)]
    assert shares == ["4-14", "15-25", "26-36", "37-47"]  # 44 cores, 11 each
    # an SGLang process drives all eight: the union
    cpus, _ = cpus_from_node(plan, list(prefill.ranks), root, allowed)
    assert compress_cpus(cpus) == "4-95"
    _, (p,) = cpus_from_node(plan, [by_gpu[0]], root, allowed=set(range(48, 96)))
    assert p.startswith("rank 0: NUMA node 0 has no CPU this process may use (it may use "
                        "48-95)")


def test_a_launch_on_a_node_without_the_presets_nic_stops_naming_it(tmp_path: Path) -> None:
    """Before: a NIC the node lacks fell back to the provider's default domain and the
    deployment ran on some other interface. Now every worker stops before its engine."""
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local", "transfer=tcp",
         "cluster.nics=[{name:eth9,kind:tcp,numa:0,gpus:[],gbps:0}]", "--preflight",
         "--exit-when-healthy", "--out", str(tmp_path / "job")],
        capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "this node does not match the plan" in out
    assert "interface eth9 is not on this node" in out and "cluster.nics" in out

"""What the render tests and the tests of rendered features share: the overrides that make a
recipe fit a launcher, and the syntax and shellcheck gate every rendered script passes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers.pdtool_cfg import recipe_args
from pdtool.compose import load_config
from pdtool.schema import gpus_per_instance


def launcher_overrides(recipe: str, launcher: str) -> list[str]:
    """Overrides that make a recipe fit the launcher: Slurm gets enough nodes; the local launcher
    gets one machine with every GPU the deployment needs (a GPU recipe does not fit 8 GPUs)."""
    args = [f"+recipe={recipe}", *recipe_args(recipe)]
    cfg, findings = load_config(args)
    assert cfg is not None, findings
    if launcher == "slurm":
        # shm cannot cross nodes: the one-machine recipes use TCP over the cluster network
        # (over loopback: every rendered "node" is this machine)
        net = ["transfer=tcp", "cluster.one_host=true"] if cfg.transfer.provider == "shm" else []
        return [*args, "launcher=slurm", "cluster.nodes=16", *net]
    need = sum(gpus_per_instance(cfg.prefill if r == "prefill" else cfg.decode) *
               (cfg.prefill if r == "prefill" else cfg.decode).instances
               for r in ("prefill", "decode"))
    over = [*args, "launcher=local"]
    if need > cfg.cluster.gpus_per_node:
        numa = cfg.cluster.gpu_numa or [0]
        per = max(1, need // max(1, len(set(numa))))
        gpu_numa = [min(g // per, max(numa)) for g in range(need)]
        over += [f"cluster.gpus_per_node={need}",
                 "cluster.gpu_numa=[" + ",".join(map(str, gpu_numa)) + "]"]
    return over


def check_script(path: Path) -> None:
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    res = subprocess.run(["shellcheck", "-x", "-s", "bash", str(path)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr

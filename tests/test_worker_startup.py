"""What the worker decides and checks at start-up, before any engine runs.

`transfer.gpu_memory`: the path KV in GPU memory takes is decided from the node's libfabric
(`transfer.fabric.gpu_direct_support`) and printed in the start line; `direct` on a node that
cannot fails there with the reason. `engine.version`: the installed SGLang must be the release
the plan names. The worker entry runs for real
(`python -m pdtool.worker`); with engine=sglang and nothing after `--` it stops right after
its start-up lines, so no engine and no port is needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.pdtool_cfg import compose

from pdtool.plan import build_plan, to_json
from pdtool.worker import (
    cudart_problem,
    gpu_memory_choice,
    kv_in_gpu_memory,
    parse_args,
    resolve,
)


def _plan(tmp_path: Path, *overrides: str) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(to_json(build_plan(compose(*overrides))))
    return path


def _worker(plan: Path, role: str = "decode", pythonpath: str = "",
            **env_vars: str) -> subprocess.CompletedProcess[str]:
    args = ["--role", role] + (["--instance", "0", "--node-rank", "0"] if role != "router"
                               else [])
    # the node's GPUs as a Slurm step sees them (pdtool.nodecheck counts them; this machine
    # has none, and these tests are about what comes after that check)
    env = {**os.environ, "PDTOOL_PREFLIGHT": "", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
           **env_vars}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pdtool.worker", "--plan", str(plan), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def _start_fields(stdout: str) -> dict[str, str]:
    line = next(x for x in stdout.splitlines() if x.startswith("pdtool-worker: start "))
    return dict(kv.split("=", 1) for kv in line.split()[2:])


SGLANG_ON_GPUS = ("engine=sglang", "model.seed=0", "cluster.device=cuda")


def test_auto_probes_nothing_and_leaves_the_choice_to_the_ranks(tmp_path: Path) -> None:
    # a CUDA registration of a host page answers yes whether or not GPUDirect works: under
    # auto each rank tries its own pools (transfer/sglang/staging_plane.py, tested there)
    res = _worker(_plan(tmp_path, *SGLANG_ON_GPUS))
    assert _start_fields(res.stdout)["gpu_memory"] == "auto", res.stdout
    assert ("pdtool-worker: transfer.gpu_memory=auto: undecided (direct if shm on the node "
            "registers the KV pools' GPU memory (FI_HMEM), else staged; each rank tries at "
            "start)") in res.stdout
    # a node where libfabric's CUDA support cannot dlopen libcudart.so: the worker says why
    # a CUDA libfabric would go staged, and the fix (this machine may have the toolkit's)
    missing = cudart_problem()
    said = "pdtool-worker: transfer.gpu_memory=auto: libcudart.so cannot be loaded here ("
    assert (said in res.stdout and "on LD_LIBRARY_PATH" in res.stdout) == bool(missing)
    assert "needs its launch line" in res.stderr and "Traceback" not in res.stderr


def test_direct_on_a_node_that_cannot_fails_at_start_up_with_the_reason(tmp_path: Path) -> None:
    res = _worker(_plan(tmp_path, *SGLANG_ON_GPUS, "transfer.gpu_memory=direct"))
    assert res.returncode == 2
    assert "pdtool-worker: start" not in res.stdout  # refused before anything starts
    err = res.stderr
    assert "pdtool-worker: ERROR: transfer.gpu_memory=direct: shm cannot register GPU memory " \
           "here:" in err and "use transfer.gpu_memory=staged or auto" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("overrides", [("transfer.gpu_memory=staged",),
                                       ("transfer=tcp",)])
def test_staged_and_providers_without_fi_hmem_need_no_probe(tmp_path: Path, overrides) -> None:
    plan = _plan(tmp_path, *SGLANG_ON_GPUS, *overrides)
    ctx = resolve(parse_args(["--plan", str(plan), "--role", "prefill", "--instance", "0",
                              "--node-rank", "0"]))
    choice = gpu_memory_choice(ctx)
    assert choice.path == "staged"
    res = _worker(plan, "prefill")
    assert _start_fields(res.stdout)["gpu_memory"] == "staged"
    assert f"pdtool-worker: {choice.line()}" in res.stdout
    assert "libcudart.so" not in res.stdout  # staged needs no CUDA libfabric


def test_host_memory_kv_and_the_router_print_no_probe(tmp_path: Path) -> None:
    plan = _plan(tmp_path)  # the reference engine on this machine: KV in host memory
    ctx = resolve(parse_args(["--plan", str(plan), "--role", "decode", "--instance", "0",
                              "--rank", "0"]))
    assert not kv_in_gpu_memory(ctx.plan) and gpu_memory_choice(ctx) is None
    res = _worker(_plan(tmp_path, *SGLANG_ON_GPUS), "router")
    assert "gpu_memory" not in res.stdout and "transfer.gpu_memory" not in res.stdout


def test_the_installed_sglang_must_be_the_release_engine_version_names(tmp_path: Path) -> None:
    plan = _plan(tmp_path, *SGLANG_ON_GPUS)
    assert json.loads(plan.read_text())["engine_version"] == "0.5.23"
    res = _worker(plan)  # this machine has SGLang 0.5.23: start-up goes on to the engine
    assert "pdtool-worker: start" in res.stdout and "engine.version" not in res.stderr
    # another release first on the path (package metadata as pip installs it)
    other = tmp_path / "site"
    (other / "sglang-0.5.22.dist-info").mkdir(parents=True)
    (other / "sglang-0.5.22.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.22\n")
    res = _worker(plan, pythonpath=str(other))
    assert res.returncode == 2 and "pdtool-worker: start" not in res.stdout
    assert "engine.version=0.5.23, but" in res.stderr and "has sglang==0.5.22" in res.stderr
    assert "Traceback" not in res.stderr


def test_sglangs_own_backend_registers_gpu_memory_itself(tmp_path: Path) -> None:
    res = _worker(_plan(tmp_path, *SGLANG_ON_GPUS, "transfer.backend=mooncake"))
    assert _start_fields(res.stdout)["gpu_memory"] == "sglang-mooncake", res.stdout
    assert "transfer.gpu_memory=" not in res.stdout  # no probe, no pdtool path


def test_hnd_pools_inherited_from_the_shell_stop_a_pd_server_before_sglang(tmp_path: Path) -> None:
    """SGLANG_USE_HND_KVCACHE exported in the shell that ran pdtool reaches the servers (validate
    sees launcher.env only): the worker refuses it, naming the variable, before SGLang starts
    and asserts; an aggregated instance transfers nothing and goes on."""
    res = _worker(_plan(tmp_path, *SGLANG_ON_GPUS), SGLANG_USE_HND_KVCACHE="1")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "SGLANG_USE_HND_KVCACHE=1: SGLang 0.5.23 does not support PD transfer" in res.stderr
    res = _worker(_plan(tmp_path, *SGLANG_ON_GPUS, "mode=aggregated"),
                  SGLANG_USE_HND_KVCACHE="1")
    assert "SGLANG_USE_HND_KVCACHE" not in res.stderr and "pdtool-worker: start" in res.stdout

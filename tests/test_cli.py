"""The `pdtool` command: exit codes, --json, -m sweeps, no tracebacks. Called in-process
(`pdtool.cli.main`, what the console script runs) for speed; the installed command itself, its
help, its broken pipe, its imports and the built wheel run as real processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli

PDTOOL = (
    [shutil.which("pdtool")] if shutil.which("pdtool") else [sys.executable, "-m", "pdtool.cli"]
)


def pdtool(*args: str) -> subprocess.CompletedProcess[str]:
    p = run_cli(*args)
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p


def pdtool_process(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The installed command (or `python -m pdtool.cli`) as a real process."""
    env = {**os.environ, "COLUMNS": "200"}
    p = subprocess.run(
        [*PDTOOL, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p


def test_help_lists_commands():
    p = pdtool_process("--help")
    assert p.returncode == 0
    for cmd in ("validate", "plan", "recipes"):
        assert cmd in p.stdout
    assert pdtool().returncode == 2


def test_bad_option_is_usage_error():
    p = pdtool("validate", "--no-such-flag")
    assert p.returncode == 2
    assert "unrecognized arguments" in p.stderr


def test_validate_clean_recipe():
    p = pdtool("validate", "+recipe=tiny-local")
    assert p.returncode == 0, p.stdout
    assert "valid" in p.stdout
    assert "KiB/token" in p.stdout  # KV bytes per token are shown


def test_validate_json_and_options_after_overrides():
    p = pdtool("validate", "+recipe=deepseek-r1", "--json")
    assert p.returncode == 0
    out = json.loads(p.stdout)
    assert out["ok"] is True and out["errors"] == 0 and out["recipe"] == "deepseek-r1"
    dec = out["memory"][1]
    assert dec["role"] == "decode" and dec["kv_bytes_per_token"] == 61 * 576 * 2


@pytest.mark.slow
def test_aggregated_plan_shows_no_transfer_and_no_bootstrap():
    """mode=aggregated (SGLang, as `pdtool bench --compare aggregated` starts it): the plan says
    what runs, whole requests on every instance, and no KV transfer, routes or bootstrap port;
    a bootstrap port no process binds meets no other port."""
    args = ("+recipe=deepseek-r1", "mode=aggregated", "prefill.bootstrap_port=30000")
    p = pdtool("validate", *args)
    assert p.returncode == 0, p.stdout
    assert "GPU memory: not used (mode=aggregated: no KV transfer)" in p.stdout
    p = pdtool("plan", *args)
    assert p.returncode == 0, p.stdout
    text = " ".join(p.stdout.split())
    assert "engine sglang | mode aggregated" in text
    assert "whole requests to prefill-0@node0:30000, decode-0@node1:31000," in text
    assert "transfer: none (mode=aggregated" in text and "routes for" not in text
    plan = json.loads(pdtool("plan", *args, "--json").stdout)
    assert [i["bootstrap_port"] for i in plan["instances"]] == [None] * 4
    p = pdtool("validate", "+recipe=deepseek-r1", "prefill.bootstrap_port=30000")
    assert p.returncode == 1 and "prefill.bootstrap_port" in p.stdout  # disaggregated: it does


def test_validate_states_the_gpu_memory_path():
    p = pdtool("validate", "+recipe=deepseek-r1")
    assert p.returncode == 0, p.stdout
    text = " ".join(p.stdout.split())  # rich wraps long lines
    # efa may or may not register CUDA memory on the node: each rank's registration decides
    assert ("GPU memory: transfer.gpu_memory=auto: undecided (direct if efa on the node "
            "registers the KV pools' GPU memory (FI_HMEM), else staged; each rank tries at "
            "start)") in text
    p = pdtool("validate", "+recipe=deepseek-r1", "transfer.gpu_memory=staged", "--json")
    assert json.loads(p.stdout)["gpu_memory"].startswith("transfer.gpu_memory=staged: staged")
    p = pdtool("validate", "+recipe=tiny-local", "--json")
    assert json.loads(p.stdout)["gpu_memory"].startswith("host memory")
    p = pdtool("validate", "+recipe=deepseek-r1", "transfer=tcp", "transfer.gpu_memory=direct",
               "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 1 and out["gpu_memory"] is None  # the finding says why instead
    (f,) = [f for f in out["findings"] if f["key"] == "transfer.gpu_memory"]
    assert "tcp;ofi_rxm cannot register GPU memory" in f["message"] and "staged" in f["fix"]


def test_plan_shows_the_gpu_memory_path():
    p = pdtool("plan", "+recipe=deepseek-r1", "transfer.gpu_memory=direct",
               "--no-ranks")
    assert p.returncode == 0, p.stdout
    assert "GPU memory: transfer.gpu_memory=direct: direct" in " ".join(p.stdout.split())
    p = pdtool("plan", "+recipe=deepseek-r1", "--json")
    t = json.loads(p.stdout)["transfer"]
    assert t["gpu_memory"] == "auto" and t["gpu_memory_path"].startswith(
        "transfer.gpu_memory=auto: undecided")


def test_validate_errors_exit_1_and_name_the_key():
    p = pdtool("validate", "+recipe=llama-3.1-70b", "decode.tp=3")
    assert p.returncode == 1
    assert "decode.tp" in p.stdout
    p = pdtool("validate", "+recipe=llama-3.1-70b", "decode.tp=3", "--json")
    assert p.returncode == 1
    out = json.loads(p.stdout)
    assert out["ok"] is False
    assert "decode.tp" in [f["key"] for f in out["findings"] if f["severity"] == "error"]


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["model.num_layer=3"], "model.num_layer"),
        (["prefill.tp=eight"], "prefill.tp"),
        (["+recipe=nope"], "recipe"),
        (["+prefill.speed=9"], "prefill.speed"),
        (["decode.instances=1,2"], "decode.instances"),
        (["transfer.provider=tcp;ofi_rxm"], "transfer.provider"),
    ],
)
def test_uncomposable_config_exits_2_with_key(args, key):
    p = pdtool("validate", *args, "--json")
    assert p.returncode == 2
    out = json.loads(p.stdout)
    assert out["composed"] is False
    assert out["findings"][0]["key"] == key
    text = pdtool("validate", *args)
    assert text.returncode == 2
    assert key in text.stdout


def test_multirun_sweep_validate():
    p = pdtool("validate", "-m", "+recipe=tiny-local", "decode.instances=1,2,9", "--json")
    runs = json.loads(p.stdout)
    assert [r["overrides"][-1] for r in runs] == [f"decode.instances={n}" for n in (1, 2, 9)]
    assert [r["ok"] for r in runs] == [True, True, False]
    assert p.returncode == 1  # the worst run decides
    p = pdtool("validate", "--multirun", "+recipe=tiny-local", "decode.instances=1,2")
    assert p.returncode == 0
    assert p.stdout.count("valid") == 2 and "run 1:" in p.stdout
    # each run's header says what it resolved, not the recipe's description (2 decode both)
    assert "1 prefill (TP1) : 1 decode (TP1)" in p.stdout.split("run 1:")[0]
    assert "1 prefill (TP1) : 2 decode (TP1)" in p.stdout.split("run 1:")[1]


def test_plan_shows_the_draft_kv_in_its_counts():
    p = pdtool("plan", "+recipe=llama-3.1-70b", "engine.extra_args=[--speculative-algorithm,"
               "EAGLE3]", "model.draft_layers=1", "--no-ranks", "--tokens", "300")
    assert p.returncode == 0, p.stdout
    out = " ".join(p.stdout.split())
    assert "draft KV (model.draft_layers=1): 2 more buffers after the target's" in out, out
    assert "+ the draft's buffers + 10 aux" in out and "1,630" in out, out  # 1,610 + 20
    p = pdtool("plan", "+recipe=llama-3.1-70b", "engine.extra_args=[--speculative-algorithm,"
               "EAGLE3]", "--no-ranks")
    assert p.returncode == 1 and "model.draft_layers" in p.stdout


def test_plan_table_and_json():
    p = pdtool("plan", "+recipe=llama-3.1-70b", "--tokens", "1000")
    assert p.returncode == 0
    for text in (
        "prefill-0",
        "decode-1",
        "rdmap147s0",
        "reconstructs",
        "routes for a 1000",
        "dp/tp",
    ):
        assert text in p.stdout, text
    p = pdtool("plan", "+recipe=deepseek-r1", "--no-ranks")
    assert "any of prefill ranks 0-7 (8 replicas)" in p.stdout
    assert "dp/tp" not in p.stdout  # --no-ranks leaves out the per-rank table
    p = pdtool("plan", "+recipe=deepseek-r1", "--json", "--tokens=100")
    assert p.returncode == 0
    plan = json.loads(p.stdout)
    assert plan["version"] == 1 and plan["transfer"]["tokens"] == 100
    route = plan["transfer"]["routes"][0]
    assert route["slices"][0]["src_candidates"] == list(range(8))
    # engine=sglang sends every prompt token: ceil(100 / 64) pages x 61 layers + one row of each
    # of SGLang's 10 metadata buffers (what its decoder counts, tests/test_geometry.py)
    assert route["writes_per_request"] == 2 * 61 + 10


def test_plan_refuses_invalid_config():
    p = pdtool("plan", "+recipe=deepseek-r1", "decode.instances=5")
    assert p.returncode == 1
    assert "cluster.nodes" in p.stdout
    p = pdtool("plan", "--tokens", "0")
    assert p.returncode == 2


def test_plan_multirun_json():
    p = pdtool("plan", "-m", "+recipe=deepseek-r1", "decode.instances=1,2,3", "--json")
    assert p.returncode == 0
    runs = json.loads(p.stdout)
    assert [r["plan"]["nodes"] for r in runs] == [2, 3, 4]


def test_recipes_listing():
    p = pdtool("recipes", "--json")
    assert p.returncode == 0
    rows = {r["name"]: r["description"] for r in json.loads(p.stdout)}
    for name in ("tiny-local", "deepseek-r1", "deepseek-r1-dp-attention", "qwen3-coder-480b"):
        assert rows[name]
    p = pdtool("recipes")
    assert "llama-3.1-70b" in p.stdout


def test_validate_path_imports_no_heavy_modules():
    """`pdtool validate` must stay fast: torch, SGLang and the fabric binding stay unloaded."""
    code = (
        "import sys; from pdtool.cli import main; "
        "rc = main(['validate', '+recipe=deepseek-r1']); "
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'sglang', 'numpy', 'cffi', 'zmq', 'cuda', 'pycuda', 'cupy')"
        " or m.startswith('transfer._fabric') or m == 'transfer.fabric']; "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stdout, p.stdout


@pytest.mark.slow
def test_installed_wheel_finds_conf_and_recipes(tmp_path):
    """A built wheel (not the editable checkout) ships conf/ and recipes/ and runs validate."""
    root = Path(__file__).resolve().parent.parent
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(root)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (whl,) = wheels.glob("pdtool-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(whl)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    code = (
        "import sys, pdtool, pdtool.paths as p; print('AT', pdtool.__file__, p.data_root()); "
        "from pdtool.cli import main; sys.exit(main(['validate', '+recipe=deepseek-r1']))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"AT {target}/pdtool/__init__.py {target}/pdtool/_data" in p.stdout
    assert "valid" in p.stdout


def test_render_to_a_folder_it_cannot_write_names_out():
    p = pdtool("render", "--out", "/proc/no-such/job")
    assert p.returncode == 2, p.stderr
    assert "--out" in p.stderr and "cannot write the job folder" in p.stderr
    assert "internal error" not in p.stderr and "Traceback" not in p.stderr


def test_a_gpu_preset_on_launcher_local_is_compared_with_this_machine(tmp_path):
    """cluster=p5 (8 GPUs, CPUs 0-191) validated clean on this 2-core, GPU-less machine and
    then died in numactl; validate and launch now compare the preset with the machine."""
    args = ("+recipe=llama-3.1-70b", "launcher=local", "decode.instances=1", "prefill.tp=4")
    p = pdtool("validate", *args, "--json")
    found = {f["key"]: f for f in json.loads(p.stdout)["findings"]}
    assert p.returncode == 1 and "use cluster=local" in found["cluster"]["fix"], p.stdout
    assert "has 8 GPUs per node; this machine has 0" in found["cluster"]["message"]
    assert "0-191" in found["cluster.numa_cpus"]["message"]
    p = pdtool("launch", *args, "--out", str(tmp_path / "job"))
    assert p.returncode == 1 and "not started" in p.stderr and "use cluster=local" in p.stderr
    assert not (tmp_path / "job").exists()  # refused before its folder and secret are written
    assert pdtool("validate", "+recipe=tiny-local").returncode == 0  # the local preset fits


def test_a_model_folder_missing_on_this_machine_is_refused_before_launch(tmp_path):
    """A local model.path that does not exist failed in every worker after it started; a Hub
    id (org/name) is left to download."""
    p = pdtool("validate", "+recipe=sglang-local", "model.path=/no/such/checkpoint", "--json")
    found = {f["key"]: f for f in json.loads(p.stdout)["findings"]}
    assert p.returncode == 1
    assert found["model.path"]["message"] == "/no/such/checkpoint does not exist on this machine"
    p = pdtool("validate", "+recipe=sglang-local", "model.path=org/some-model", "--json")
    assert "model.path" not in {f["key"] for f in json.loads(p.stdout)["findings"]}


@pytest.mark.slow
def test_config_prints_the_resolved_config_and_every_key():
    import json

    p = pdtool("config", "+recipe=tiny-local", "decode.instances=3",
               "+launcher.env.all.HF_TOKEN=hf_do_not_print")
    assert p.returncode == 0 and "instances: 3" in p.stdout
    assert "hf_do_not_print" not in p.stdout and "REDACTED" in p.stdout
    keys = json.loads(pdtool("config", "decode.instances=3", "--keys", "decode.", "--json").stdout)
    row = next(k for k in keys if k["key"] == "decode.instances")
    assert row["value"] == 3 and row["type"] == "int" and "prefill:decode ratio" in row["meaning"]
    assert all(k["key"].startswith("decode.") for k in keys)
    bad = pdtool("config", "--keys", "decod.")
    assert bad.returncode == 2 and "no key starts with 'decod.'" in bad.stdout + bad.stderr
    # the unknown-key fix points at it
    tpp = pdtool("validate", "prefill.tpp=2")
    assert "did you mean prefill.tp?" in tpp.stdout + tpp.stderr
    assert "pdtool config --keys prefill." in " ".join((tpp.stdout + tpp.stderr).split())


def test_launch_refuses_ports_another_process_holds(tmp_path):
    """A second deployment on the same ports answered its health checks with the first one's
    servers and was benchmarked in its place; launch now names the taken port and its key,
    before anything starts, while validate (of a running deployment's config) stays clean."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = ("+recipe=tiny-local", f"decode.http_port={port}")
        p = pdtool("launch", *args, "--out", str(tmp_path / "job"))
        assert p.returncode == 1 and "not started" in p.stderr, p.stderr
        assert f"port {port}" in p.stderr and "decode.http_port" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
        assert not (tmp_path / "job").exists()
        assert pdtool("validate", *args).returncode == 0

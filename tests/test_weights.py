"""launcher.model_cache: a Hub model fetched once per job into a shared folder, then read
offline by every worker. No test reaches the Hub: the cache is laid out here the way
huggingface_hub leaves it after a download (helpers.hf_checkpoints.hub_cache), and the real
servers that load a Hub id from it offline are tests/test_sglang_servers.py's oracle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hf_checkpoints import hub_cache
from helpers.pdtool_cfg import assert_error, assert_warning, findings_for, recipe
from helpers.rendered import check_script, launcher_overrides

from pdtool.checkpoints import ensure
from pdtool.launch.shell import display
from pdtool.launch.weights import FetchError, fetch, stage
from pdtool.render import render

MODEL = "acme/tiny-llama"


def test_a_cached_snapshot_is_found_without_the_network(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = hub_cache(tmp_path / "cache", MODEL, Path(ensure("builtin:tiny-llama")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch(MODEL, tmp_path / "cache") == (snapshot, False)


def test_a_model_missing_offline_is_named_without_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FetchError, match="HF_HUB_OFFLINE is set here"):
        fetch(MODEL, tmp_path)
    res = subprocess.run([sys.executable, "-m", "pdtool.launch.weights", "--cache",
                          str(tmp_path), MODEL], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert f"launcher.model_cache: {MODEL} is not in {tmp_path / 'hub'}" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_the_job_fetches_once_before_any_worker_and_workers_read_offline(
        launcher: str, tmp_path: Path) -> None:
    over = [*launcher_overrides("sglang-local", launcher), f"model.path={MODEL}",
            "launcher.model_cache=/fsx/hf-cache"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    check_script(rendered.script)
    # the supervisor (what the script hands over to) runs it before any worker
    assert display(rendered.spec.fetch).endswith(
        f"-m pdtool.launch.weights --cache /fsx/hf-cache {MODEL}"), rendered.spec.fetch
    for p in rendered.spec.procs:
        assert "HF_HOME=/fsx/hf-cache" in p.argv and "HF_HUB_OFFLINE=1" in p.argv, p.name
    # without the key nothing is fetched and the workers reach the Hub themselves
    rendered, _ = render([*over[:-1]], tmp_path / "plain")
    assert rendered.spec.fetch == [] and rendered.spec.stage == []
    assert not [a for p in rendered.spec.procs for a in p.argv if str(a).startswith("HF_HOME=")]


def test_a_missing_cache_stops_the_local_launch_before_any_worker(tmp_path: Path) -> None:
    """The supervisor fetches before it starts a process: an empty cache with the Hub out
    of reach ends the launch at once, naming the key, and no SGLang server was started."""
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=sglang-local",
         f"model.path={MODEL}", f"launcher.model_cache={tmp_path / 'cache'}", "--out",
         str(tmp_path / "job")], capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert f"launcher.model_cache: {MODEL} is not in" in out and "Traceback" not in out
    assert "started " not in out, "a worker was started"


def test_model_cache_rules() -> None:
    cfg = recipe("sglang-local", f"model.path={MODEL}", "launcher.model_cache=hf-cache")
    assert_error(cfg, "launcher.model_cache", "not an absolute folder path")
    cfg = recipe("tiny-local", "launcher.model_cache=/fsx/hf-cache")
    assert_error(cfg, "launcher.model_cache", "the reference engine downloads nothing")
    cfg = recipe("sglang-local", "launcher.model_cache=/fsx/hf-cache")
    assert_warning(cfg, "launcher.model_cache", "is not a Hub id")
    gated = ("model.path=meta-llama/Llama-3.1-8B-Instruct", "launcher.model_cache=/fsx/hf-cache")
    assert_warning(recipe("sglang-local", *gated), "launcher.model_cache", "gated", "no HF_TOKEN")
    assert findings_for(recipe("sglang-local", *gated, "launcher.secret_env=[HF_TOKEN]"),
                        "launcher.model_cache") == []
    assert findings_for(recipe("sglang-local", f"model.path={MODEL}",
                               "launcher.model_cache=/fsx/hf-cache"),
                        "launcher.model_cache") == []


def test_a_container_must_see_the_cache_at_the_hosts_path() -> None:
    over = ("launcher.container_image=img", "model.path=deepseek-ai/DeepSeek-R1",
            "launcher.model_cache=/fsx/hf-cache",
            "launcher.setup=[pip install /fsx/wheels/pdtool.whl]")
    e = assert_error(recipe("deepseek-r1", *over), "launcher.model_cache",
                     "no launcher.container_mounts entry puts it at the same path")
    assert "'/fsx/hf-cache:/fsx/hf-cache'" in e.fix
    assert_error(recipe("deepseek-r1", *over, "launcher.container_mounts=[/fsx/hf-cache:/hf]"),
                 "launcher.model_cache", "at the same path")
    assert findings_for(recipe("deepseek-r1", *over, "launcher.container_mounts=[/fsx:/fsx]"),
                        "launcher.model_cache") == []


def _staged(tmp_path: Path) -> tuple[Path, Path]:
    """A shared cache holding the tiny checkpoint, and the node's own folder."""
    hub_cache(tmp_path / "shared", MODEL, Path(ensure("builtin:tiny-llama")))
    return tmp_path / "shared", tmp_path / "local"


def test_staging_copies_the_snapshot_verified_and_once(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    shared, local = _staged(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, copied = stage(MODEL, shared, local)
    assert copied > 0 and folder.is_relative_to(local / "hub")
    # the copy is a cache of its own: transformers loads it offline, equal to the original
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL, cache_dir=local / "hub",
                                                 local_files_only=True)
    ref = AutoModelForCausalLM.from_pretrained(ensure("builtin:tiny-llama"))
    assert all((a == b).all() for a, b in zip(model.state_dict().values(),
                                              ref.state_dict().values(), strict=True))
    AutoTokenizer.from_pretrained(MODEL, cache_dir=local / "hub", local_files_only=True)
    assert stage(MODEL, shared, local) == (folder, 0)  # a verified copy is there
    # a copy that lost a file is made whole again
    blob = next((local / "hub").rglob("blobs/*"))
    blob.unlink()
    assert stage(MODEL, shared, local)[1] > 0 and blob.exists()


def test_a_damaged_file_is_refused_naming_it(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    shared, local = _staged(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    weights = max((shared / "hub").rglob("blobs/*"), key=lambda b: b.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(FetchError, match=f"{weights} copied to .* does not match its hash"):
        stage(MODEL, shared, local)
    # nothing half-copied is left to be taken for the weights
    assert not list(local.rglob(weights.name)) and not list(local.rglob("*.tmp"))
    assert not list(local.rglob(".pdtool-staged-*"))


def test_jobs_sharing_a_node_stage_the_model_once(tmp_path: Path) -> None:
    """Two processes (two jobs, or the emulated nodes of one shared disk) stage at once:
    both end with the verified copy, one of them made it."""
    shared, local = _staged(tmp_path)
    cmd = [sys.executable, "-m", "pdtool.launch.weights", "--cache", str(shared),
           "--stage-to", str(local), MODEL]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = sorted(o for o, _ in outs)
    assert "GiB copied to" in said[0] and "verified" in said[0]
    assert "verified copy found in" in said[1]


def test_stage_to_rules() -> None:
    hub = (f"model.path={MODEL}", "launcher.model_cache=/fsx/hf-cache")
    assert findings_for(recipe("sglang-local", *hub, "launcher.stage_to=/local/hf"),
                        "launcher.stage_to") == []
    assert_error(recipe("sglang-local", *hub, "launcher.stage_to=local"), "launcher.stage_to",
                 "not an absolute folder path")
    assert_error(recipe("sglang-local", "launcher.stage_to=/local/hf"), "launcher.stage_to",
                 "launcher.model_cache holds")
    assert_error(recipe("sglang-local", *hub, "launcher.stage_to=/fsx/hf-cache/"),
                 "launcher.stage_to", "is launcher.model_cache itself")
    box = ("launcher=slurm", "cluster.nodes=2", "transfer=tcp", "cluster.one_host=true",
           "launcher.container_image=img", "launcher.container_mounts="
           "[/fsx/hf-cache:/fsx/hf-cache]", "launcher.setup=[pip install pdtool]")
    assert_error(recipe("sglang-local", *hub, *box, "launcher.stage_to=/local/hf"),
                 "launcher.stage_to", "at the same path in the container")


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_the_job_stages_after_the_fetch_and_workers_read_the_copy(launcher: str,
                                                                  tmp_path: Path) -> None:
    over = [*launcher_overrides("sglang-local", launcher), f"model.path={MODEL}",
            "launcher.model_cache=/fsx/hf-cache", "launcher.stage_to=/local_nvme/hf"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    check_script(rendered.script)
    staging = display(rendered.spec.stage)  # run by the supervisor after the fetch
    assert staging.endswith(
        f"-m pdtool.launch.weights --cache /fsx/hf-cache --stage-to /local_nvme/hf {MODEL}")
    if launcher == "slurm":  # one task on each node of the job
        assert f"srun --export=ALL --nodes={rendered.plan.nodes} --ntasks-per-node=1" in staging
    assert "HF_HUB_OFFLINE=1" in staging
    for p in rendered.spec.procs:
        assert "HF_HOME=/local_nvme/hf" in p.argv and "HF_HUB_OFFLINE=1" in p.argv, p.name


def test_every_node_of_the_job_stages_as_the_spec_says(slurm, tmp_path: Path) -> None:
    """The staging line of a rendered job (what its supervisor runs), run by real srun in an
    allocation of the plan's nodes: one task on each node, all of them done before the line
    returns (the emulated nodes share this disk, so one copies and the others find its
    verified copy)."""
    shared, local = _staged(tmp_path)
    over = [*launcher_overrides("sglang-local", "slurm"), f"model.path={MODEL}",
            f"launcher.model_cache={shared}", f"launcher.stage_to={local}"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    line = display(rendered.spec.stage)
    nodes = rendered.plan.nodes
    batch = tmp_path / "stage.sh"
    batch.write_text(f"#!/bin/bash\nexport PDTOOL_PYTHON={sys.executable}\n{line}\n")
    log = tmp_path / "stage.out"
    job = slurm.run("sbatch", "--parsable", f"--nodes={nodes}", "--ntasks-per-node=1",
                    f"--output={log}", str(batch)).strip()
    assert slurm.wait_job(job, timeout=180) == ("COMPLETED", "0:0"), log.read_text()
    said = [ln for ln in log.read_text().splitlines() if ln.startswith("model weights on ")]
    assert len(said) == nodes, log.read_text()
    assert sum("GiB copied to" in ln for ln in said) == 1
    assert sum("verified copy found in" in ln for ln in said) == nodes - 1

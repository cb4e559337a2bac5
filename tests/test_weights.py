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
from pdtool.launch.weights import FetchError, fetch
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
    text = rendered.script.read_text()
    fetch_line = f"-m pdtool.launch.weights --cache /fsx/hf-cache {MODEL}"
    assert text.count(fetch_line) == 1
    assert text.index(fetch_line) < text.index("\nstart_group ")
    for p in rendered.spec.procs:
        assert "HF_HOME=/fsx/hf-cache" in p.argv and "HF_HUB_OFFLINE=1" in p.argv, p.name
    # without the key nothing is fetched and the workers reach the Hub themselves
    rendered, _ = render([*over[:-1]], tmp_path / "plain")
    assert "pdtool.launch.weights" not in rendered.script.read_text()
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

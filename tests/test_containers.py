"""launcher.container_cache: the registry image imported once into a shared folder as squashfs,
which the job's container setup step unpacks on every node; the setup step runs as root in the
image when launcher.setup installs packages. What runs here without enroot: the rendered job,
the cache found, the error when an import is needed and enroot is missing, the rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.pdtool_cfg import assert_error, findings_for, recipe
from helpers.rendered import check_script, launcher_overrides

from pdtool.launch.containers import ContainerError, ensure, sqsh_name
from pdtool.render import render

IMAGE = "lmsysorg/sglang:v0.5.23-cu129"
BOX = (f"launcher.container_image={IMAGE}", "launcher.container_mounts=[/fsx:/fsx]",
       "model.path=/fsx/models/r1", "launcher.setup=[pip install /fsx/wheels/pdtool.whl]")


def test_the_job_imports_once_and_every_node_unpacks_the_file(tmp_path: Path) -> None:
    over = [*launcher_overrides("deepseek-r1", "slurm"), *BOX,
            "launcher.container_cache=/fsx/enroot"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    check_script(rendered.script)
    text = rendered.script.read_text()
    sqsh = f"/fsx/enroot/{sqsh_name(IMAGE)}"
    imports = f"-m pdtool.launch.containers --cache /fsx/enroot {IMAGE}"
    assert text.count(imports) == 1
    (setup,) = [ln for ln in text.splitlines() if "--job-name=container-setup" in ln]
    assert text.index(imports) < text.index(setup)
    assert f"--container-image={sqsh}" in setup and text.count("--container-image=") == 1
    assert "--container-remap-root" in setup  # launcher.setup installs into the image
    # without the key: the registry image, and no import
    rendered, _ = render(over[:-1], tmp_path / "plain")
    text = rendered.script.read_text()
    assert "pdtool.launch.containers" not in text and f"--container-image={IMAGE}" in text


def test_no_root_in_the_image_when_nothing_is_installed(tmp_path: Path) -> None:
    over = [*launcher_overrides("deepseek-r1", "slurm"), *BOX[:3],
            "launcher.container_image=/fsx/images/sglang-pdtool.sqsh"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    assert "--container-remap-root" not in rendered.spec.job.container_setup


def test_an_image_in_the_cache_is_used_as_it_is(tmp_path: Path) -> None:
    (tmp_path / sqsh_name(IMAGE)).write_bytes(b"hsqs")
    assert ensure(IMAGE, tmp_path) == (tmp_path / sqsh_name(IMAGE), False)
    assert sqsh_name("nvcr.io#nvidia/pytorch:24.01") == "nvcr.io+nvidia+pytorch+24.01.sqsh"


def test_an_import_without_enroot_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "enroot"
    with pytest.raises(ContainerError, match="enroot is not installed on"):
        ensure(IMAGE, cache)
    res = subprocess.run([sys.executable, "-m", "pdtool.launch.containers", "--cache",
                          str(cache), IMAGE], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "launcher.container_cache: enroot is not installed" in res.stderr
    assert f"enroot import --output {cache / sqsh_name(IMAGE)} docker://{IMAGE}" in res.stderr
    assert not list(cache.glob("*.sqsh")) and not list(cache.glob("*.tmp"))


def test_container_cache_rules() -> None:
    slurm = ("launcher=slurm",)
    assert findings_for(recipe("deepseek-r1", *slurm, *BOX, "launcher.container_cache=/fsx/e"),
                        "launcher.container_cache") == []
    assert_error(recipe("deepseek-r1", *slurm, *BOX, "launcher.container_cache=enroot"),
                 "launcher.container_cache", "not an absolute folder path")
    assert_error(recipe("deepseek-r1", *slurm, "launcher.container_cache=/fsx/e"),
                 "launcher.container_cache", "this job runs none")
    assert_error(recipe("deepseek-r1", *slurm, *BOX, "launcher.container_image=/fsx/i.sqsh",
                        "launcher.container_cache=/fsx/e"),
                 "launcher.container_cache", "is a file already")

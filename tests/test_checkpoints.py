"""The builtin checkpoints (pdtool.checkpoints) and the model presets that describe them: a
preset's keys are what the plan sizes memory and routes from, so they must be the checkpoint's
own (read from its config.json the way `model.path=DIR` is read)."""

from __future__ import annotations

import pytest
from helpers.pdtool_cfg import recipe

from pdtool.arch import plan_fields, read_arch
from pdtool.checkpoints import ensure


@pytest.mark.parametrize("recipe_name", ["sglang-local"])
def test_the_preset_is_the_builtin_checkpoints_config(recipe_name: str) -> None:
    model = recipe(recipe_name).model
    got = plan_fields(read_arch(ensure(model.path)))
    assert {k: getattr(model, k) for k in got} == pytest.approx(got, rel=1e-2)


def test_a_builtin_checkpoint_is_built_once_and_the_same_each_time(tmp_path) -> None:
    from pdtool.checkpoints import make_checkpoint

    a = make_checkpoint(tmp_path / "a", "llama")
    b = make_checkpoint(tmp_path / "b", "llama")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert ensure("builtin:tiny-llama") == ensure("builtin:tiny-llama")

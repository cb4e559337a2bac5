"""Helpers for the foundation tests: composed configs (cached) and rule assertions."""

from __future__ import annotations

import copy
from functools import cache

from pdtool.compose import load_config
from pdtool.rules import Finding, validate
from pdtool.schema import Config


@cache
def _composed(overrides: tuple[str, ...]) -> Config:
    cfg, problems = load_config(list(overrides))
    assert cfg is not None, problems
    return cfg


def compose(*overrides: str) -> Config:
    """A fresh (mutable) typed config for these overrides; composition is cached."""
    return copy.deepcopy(_composed(tuple(overrides)))


@cache
def _tiny_checkpoint() -> str:
    import tempfile
    from pathlib import Path

    from helpers.hf_checkpoints import make_checkpoint

    return str(make_checkpoint(Path(tempfile.mkdtemp(prefix="pdtool-ckpt-")) / "qwen3", "qwen3"))


def recipe_args(name: str) -> list[str]:
    """What a recipe needs on the command line (hf-local: model.path=DIR, a tiny checkpoint
    built once per session), so the tests that walk every recipe can compose it."""
    return [f"model.path={_tiny_checkpoint()}"] if name == "hf-local" else []


def option_args(group: str, option: str) -> list[str]:
    """The same for a group option (model=hf-local reads its keys from model.path)."""
    return recipe_args("hf-local") if (group, option) == ("model", "hf-local") else []


def recipe(name: str, *overrides: str) -> Config:
    return compose(f"+recipe={name}", *recipe_args(name), *overrides)


def findings_for(cfg: Config, key: str) -> list[Finding]:
    return [f for f in validate(cfg) if f.key == key]


def assert_error(cfg: Config, key: str, *fragments: str) -> Finding:
    """validate(cfg) has an error naming `key` whose message contains every fragment."""
    found = validate(cfg)
    hits = [f for f in found if f.key == key and f.severity == "error"]
    assert hits, f"no error for {key}; got {found}"
    f = hits[0]
    for frag in fragments:
        assert frag in f.message, f"{frag!r} not in {f.message!r}"
    assert f.fix, f"error for {key} has no fix"
    return f


def assert_warning(cfg: Config, key: str, *fragments: str) -> Finding:
    found = validate(cfg)
    assert not [f for f in found if f.severity == "error"], found
    hits = [f for f in found if f.key == key and f.severity == "warning"]
    assert hits, f"no warning for {key}; got {found}"
    for frag in fragments:
        assert frag in hits[0].message, f"{frag!r} not in {hits[0].message!r}"
    return hits[0]

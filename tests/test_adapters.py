"""One adapter per engine: every engine validate accepts has its plan half, its launch half
and its worker entry, and the toolkit asks them instead of testing the engine's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdtool import worker
from pdtool.adapters import ADAPTERS, UnknownEngine, engine_adapter
from pdtool.launch.engines import LAUNCHES
from pdtool.rules import ENGINE_STAGES
from pdtool.schema import ENGINES

ROOT = Path(__file__).resolve().parents[1] / "pdtool"


def test_every_engine_has_each_half() -> None:
    assert set(ADAPTERS) == set(LAUNCHES) == set(worker.ENGINES) == set(ENGINES) \
        == set(ENGINE_STAGES)


def test_an_unknown_engine_is_named_with_the_known_ones() -> None:
    with pytest.raises(UnknownEngine, match=r"engine.kind: unknown engine 'vllm' \(reference"):
        engine_adapter("vllm")


def test_nothing_outside_the_adapters_branches_on_the_engine_name() -> None:
    """Code outside the adapters asks them (or runs the engine's own rules); naming the
    engine is left to messages and records."""
    test = re.compile(r"(engine\.kind|plan\.engine|spec\.engine)\s*(==|!=|in |not in )")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(ROOT.rglob("*.py"))
             if not p.is_relative_to(ROOT / "adapters")
             for i, line in enumerate(p.read_text().splitlines(), 1) if test.search(line)]
    assert found == []


def test_validate_names_an_unknown_engine_before_any_rule_asks_its_adapter() -> None:
    from pdtool.compose import load_config
    from pdtool.rules import validate

    # a builtin checkpoint: a first-stage rule asks whether the engine loads checkpoints
    cfg, _ = load_config(["+recipe=sglang-local", "engine.kind=vllm"])
    assert [(f.key, f.severity) for f in validate(cfg)] == [("engine.kind", "error")]

"""Validation rules: pure functions from a typed `Config` to `Finding` values.

`validate(cfg)` runs them in stages, each assuming the previous passed, so no rule ever sees
a value it cannot compute with (tp=0, an unknown provider, an impossible placement):

1. values     single settings: ranges and choices             (rules.values)
              launcher.benchmark's `pdtool bench` arguments      (rules.benchmark)
2. shards     head split, prefill/decode TP, pages, chunking  (rules.shards)
   budgets    timers that must fit inside each other          (rules.budgets)
   arithmetic GPUs per instance vs nodes, launcher, engine     (rules.topology.ARITHMETIC)
   experts    expert parallelism, FP8 MoE blocks              (rules.moe)
   GPU memory direct/staged/auto for the engine and provider   (rules.gpu_memory)
3. placed     idle GPUs, provider/NIC kinds, NIC per rank, ports, memory fit, NHD write count,
              what a Slurm job asks for                       (rules.launch)

Each stage then runs the engine's own rules (`ENGINE_STAGES`): what the reference CPU engine
can run (rules.reference), what SGLang and pdtool's backend in it accept (rules.sglang).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pdtool.rules import (
    benchmark,
    budgets,
    gpu_memory,
    launch,
    memfit,
    moe,
    ports,
    reference,
    sglang,
    shards,
    topology,
    values,
)
from pdtool.rules.finding import Finding, error, has_errors, warning
from pdtool.schema import Config

Rule = Callable[[Config], list[Finding]]

STAGES: tuple[tuple[Rule, ...], ...] = (
    values.ALL + benchmark.ALL,
    shards.ALL + budgets.ALL + topology.ARITHMETIC + moe.ALL + gpu_memory.ALL,
    topology.PLACED + ports.ALL + memfit.ALL + (shards.check_nhd_writes,) + launch.ALL,
)
#: each engine's own rules, run after the common ones of the same stage (an unknown
#: engine.kind is refused by the first stage's values)
ENGINE_STAGES: dict[str, tuple[tuple[Rule, ...], ...]] = {
    "reference": (reference.VALUES, reference.SHAPES, reference.PLACED),
    "sglang": (sglang.VALUES, sglang.SHAPES, sglang.PLACED),
}


def run(rules: Iterable[Rule], cfg: Config) -> list[Finding]:
    out: list[Finding] = []
    for rule in rules:
        out.extend(rule(cfg))
    return out


def stages(kind: str) -> list[tuple[Rule, ...]]:
    """The rules `validate` runs for engine `kind`, stage by stage."""
    own = ENGINE_STAGES.get(kind, ((),) * len(STAGES))
    return [common + mine for common, mine in zip(STAGES, own, strict=True)]


def validate(cfg: Config) -> list[Finding]:
    """Every finding for `cfg`, errors first. No errors means `build_plan(cfg)` succeeds."""
    found: list[Finding] = []
    for stage in stages(cfg.engine.kind):
        found.extend(run(stage, cfg))
        if has_errors(found):
            break
    return sorted(found, key=lambda f: f.severity != "error")


__all__ = ["STAGES", "Finding", "error", "has_errors", "validate", "warning"]

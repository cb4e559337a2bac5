"""What pdtool's reference CPU engine can run, for validate (only for `engine.kind=reference`).

The checks live in `pdtool.reference_limits` (torch-free; rules import no engine code,
tests/test_layers.py) and also guard the engine's workers at start-up; here they become
findings, so `validate` rejects a deployment the engine would refuse before anything is
launched.
"""

from __future__ import annotations

from pdtool.reference_limits import instance_problems, model_problems
from pdtool.rules.finding import Finding, error
from pdtool.schema import ROLES, Config, kv_dtype, role


def check_reference_limits(cfg: Config) -> list[Finding]:
    if cfg.engine.kind != "reference":
        return []
    problems: dict[str, str] = {}  # one finding per key (the model is checked once per role)
    for name in ROLES:
        rc = role(cfg, name)
        for key, msg in model_problems(cfg.model, kv_dtype(cfg.model, rc), name):
            problems.setdefault(key, msg)
        for key, msg in instance_problems(cfg.model, rc, name):
            problems.setdefault(key, msg)
    fix = "change it, or use engine=sglang for this model"
    out = [error(key, f"engine=reference: {msg}", fix) for key, msg in problems.items()]
    for key, argv in (("engine.extra_args", cfg.engine.extra_args),
                      *((f"{name}.extra_args", role(cfg, name).extra_args) for name in ROLES)):
        if argv:
            out.append(error(key, f"engine=reference: {list(argv)} would be read by nothing "
                             "(extra_args are appended to SGLang's launch lines; the reference "
                             "engine takes its settings from the config keys)",
                             f"drop {key}, or use engine=sglang"))
    return out


ALL = (check_reference_limits,)

"""Fitting the model's efficiencies to measurements: published ones, or `pdtool bench`'s.

A measurement is a `Point`: a deployment, a workload, what was measured and its value. Four
kinds, each computed by the model the same way as the prediction it checks:

* `prefill_tokens_per_s_node`: a saturated prefill instance's input tokens/s per node;
* `decode_tokens_per_s_node`: a decode instance's output tokens/s per node at a given batch
  per GPU and KV length;
* `ttft_ms`, `tpot_ms`, `tokens_per_s_gpu`: the mean figures of `concurrency` closed-loop
  users, or of Poisson arrivals at `rate` (`pdtool bench --concurrency` / `--rate`);
* `max_tokens_per_s_gpu`: output tokens/s per GPU at the rate the deployment saturates.

`fit` moves the named constants to minimise the sum of squared log ratios (model over
measured), by a pattern search in log space: each constant stays positive, a ratio of 2
counts as much as one of 1/2, and no optimiser library is needed for a handful of constants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdtool.sizing.hardware import Hardware
from pdtool.sizing.model import (
    Deployment,
    Workload,
    _nic_gbps,
    closed_loop,
    decode_step_seconds,
    predict,
    prefill_seconds,
    saturation_rate,
)

KINDS = ("prefill_tokens_per_s_node", "decode_tokens_per_s_node", "ttft_ms", "tpot_ms",
         "tokens_per_s_gpu", "max_tokens_per_s_gpu")


@dataclass(frozen=True)
class Point:
    name: str
    dep: Deployment
    workload: Workload
    kind: str
    measured: float
    batch_per_gpu: float = 0.0  # decode_tokens_per_s_node
    context: float = 0.0  # decode_tokens_per_s_node: KV tokens per request
    concurrency: int = 0  # ttft_ms, tpot_ms: closed-loop users ...
    rate: float = 0.0  # ... or Poisson arrivals, requests/s

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.measured <= 0:
            raise ValueError(f"{self.name}: measured value must be > 0, got {self.measured}")


def model_value(p: Point, hw: Hardware) -> float:
    """What the model says of point `p`'s measured quantity."""
    dep, cfg = p.dep, p.dep.cfg
    if p.kind == "prefill_tokens_per_s_node":
        side = dep.sides["prefill"]
        n, _ = p.workload.isl[0]
        s, _ = prefill_seconds(cfg, side, hw, n, _nic_gbps(dep, "prefill", hw))
        return n / s / max(role_nodes(dep, "prefill"), 1)
    if p.kind == "decode_tokens_per_s_node":
        side = dep.sides["decode"]
        batch = p.batch_per_gpu * side.gpus
        step = decode_step_seconds(cfg, side, hw, batch, p.context, _nic_gbps(dep, "decode", hw))
        return batch / step / max(role_nodes(dep, "decode"), 1)
    if p.kind == "max_tokens_per_s_gpu":
        return saturation_rate(dep, p.workload, hw) * p.workload.osl / dep.gpus
    pred = predict(dep, p.workload, hw, p.rate) if p.rate > 0 else \
        closed_loop(dep, p.workload, hw, p.concurrency)
    return {"ttft_ms": pred.ttft_ms, "tpot_ms": pred.tpot_ms,
            "tokens_per_s_gpu": pred.tokens_per_s_gpu}[p.kind]


def role_nodes(dep: Deployment, role_name: str) -> int:
    from pdtool.schema import role

    return role(dep.cfg, role_name).nodes


def error(points: Sequence[Point], hw: Hardware) -> float:
    """Sum of squared log ratios, model over measured."""
    total = 0.0
    for p in points:
        v = model_value(p, hw)
        if not v > 0 or math.isinf(v):
            return math.inf
        total += math.log(v / p.measured) ** 2
    return total


#: where each fitted constant may go (a share of a peak stays within (0, 1])
BOUNDS = {"prefill_mfu": (1e-4, 1.0), "decode_mbu": (1e-4, 1.0), "decode_mfu": (1e-4, 1.0),
          "prefill_overhead_ms": (1e-3, 1e5), "step_overhead_ms": (1e-3, 1e5),
          "write_us": (1e-3, 1e5), "comm_eff": (1e-3, 1.0), "nic_eff": (1e-3, 1.0),
          "overlap": (1e-3, 1.0)}


def fit(points: Sequence[Point], hw: Hardware, names: Sequence[str]) -> tuple[Hardware, float]:
    """(the hardware with `names` refitted, the remaining error)."""
    unknown = [n for n in names if n not in BOUNDS]
    if unknown:
        raise ValueError(f"cannot fit {unknown}: fitted constants are {sorted(BOUNDS)}")
    best = hw
    best_err = error(points, best)
    step = math.log(4.0)
    while step > 1e-4:
        improved = False
        for name in names:
            lo, hi = BOUNDS[name]
            for sign in (1, -1):
                value = min(max(getattr(best, name) * math.exp(sign * step), lo), hi)
                trial = best.with_fit(**{name: value})
                e = error(points, trial)
                if e < best_err - 1e-12:
                    best, best_err, improved = trial, e, True
        if not improved:
            step /= 2
    return best, best_err

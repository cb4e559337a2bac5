"""The deployments `pdtool size` weighs: variations of the config's parallelism and instance
counts that validate cleanly, each with the override line that reproduces it.

A candidate changes only the keys below on the composed config (prefill.* and decode.*: tp,
dp, dp_attention, ep, nodes, instances; mode), so `pdtool validate <the user's overrides>
<the candidate's>` is the same check as `pdtool.rules.validate` on the candidate here, and a
suggestion is validate-clean by construction.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from pdtool.rules import validate
from pdtool.schema import Config, RoleConfig, deployment_gpus

#: instances of a role a candidate may have
MAX_INSTANCES = 8


@dataclass(frozen=True)
class Shape:
    """One instance's parallelism."""

    tp: int
    dp: int = 1
    dp_attention: bool = False
    ep: int = 1
    nodes: int = 1

    def overrides(self, role: str, base: RoleConfig) -> list[str]:
        """The keys this shape sets that differ from `base`."""
        return [f"{role}.{k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in dataclasses.asdict(self).items() if getattr(base, k) != v]

    def apply(self, rc: RoleConfig, instances: int) -> RoleConfig:
        return dataclasses.replace(rc, tp=self.tp, dp=self.dp, dp_attention=self.dp_attention,
                                   ep=self.ep, nodes=self.nodes, instances=instances)

    def text(self) -> str:
        if self.dp_attention:
            return f"TP{self.tp} DP-attn{self.dp} EP{self.ep}" + \
                (f" x{self.nodes} nodes" if self.nodes > 1 else "")
        return f"TP{self.tp}" + (f" EP{self.ep}" if self.ep > 1 else "") + \
            (f" x{self.nodes} nodes" if self.nodes > 1 else "")


def shapes(cfg: Config) -> list[Shape]:
    """Instance shapes for this model and node: TP 1..node size; a MoE model also its experts
    over the instance (EP = TP), and DP attention over 1, 2 or 4 whole nodes."""
    per_node = max(cfg.cluster.gpus_per_node, 1)
    tps = [t for t in (1, 2, 4, 8, 16) if t <= per_node]
    out = [Shape(tp=t) for t in tps]
    if cfg.model.num_experts > 0:
        out += [Shape(tp=t, ep=t) for t in tps if t > 1]
        out += [Shape(tp=per_node * n, dp=per_node * n, dp_attention=True, ep=per_node * n,
                      nodes=n) for n in (1, 2, 4) if per_node * n > 1]
    return out


@dataclass(frozen=True)
class Candidate:
    cfg: Config
    overrides: tuple[str, ...]
    text: str  # "prefill 1 x TP8 : decode 3 x TP8"

    @property
    def aggregated(self) -> bool:
        return self.cfg.mode == "aggregated"


def candidates(cfg: Config, max_gpus: int | None = None) -> Iterator[Candidate]:
    """Every clean candidate within `max_gpus` (and the cluster's nodes): disaggregated pairs
    of shapes and instance counts, and aggregated instances of each shape."""
    limit = max_gpus or cfg.cluster.nodes * cfg.cluster.gpus_per_node
    seen: set[tuple[str, ...]] = set()
    prefix: tuple[str, ...] = ()
    if max_gpus:  # the GPUs to rent, in whole nodes
        need = -(-max_gpus // max(cfg.cluster.gpus_per_node, 1))
        if need > cfg.cluster.nodes:
            cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nodes=need))
            prefix = (f"cluster.nodes={need}",)
    for ps, ds in itertools.product(shapes(cfg), repeat=2):
        for p, d in itertools.product(range(1, MAX_INSTANCES + 1), repeat=2):
            c = _candidate(cfg, "disaggregated", ps, p, ds, d, limit, seen, prefix)
            if c is not None:
                yield c
    for s in shapes(cfg):
        for n in range(2, 2 * MAX_INSTANCES + 1):
            c = _candidate(cfg, "aggregated", s, 1, s, n - 1, limit, seen, prefix)
            if c is not None:
                yield c


def _candidate(cfg: Config, mode: str, ps: Shape, p: int, ds: Shape, d: int, limit: int,
               seen: set[tuple[str, ...]], prefix: tuple[str, ...]) -> Candidate | None:
    c = dataclasses.replace(cfg, mode=mode, prefill=ps.apply(cfg.prefill, p),
                            decode=ds.apply(cfg.decode, d))
    if deployment_gpus(c) > limit:
        return None
    over = tuple(o for o in (
        *prefix, f"mode={mode}" if mode != cfg.mode else "", *ps.overrides("prefill", cfg.prefill),
        f"prefill.instances={p}" if p != cfg.prefill.instances else "",
        *ds.overrides("decode", cfg.decode),
        f"decode.instances={d}" if d != cfg.decode.instances else "") if o)
    if over in seen or any(f.severity == "error" for f in validate(c)):
        return None
    seen.add(over)
    text = (f"aggregated {p + d} x {ds.text()}" if mode == "aggregated" else
            f"prefill {p} x {ps.text()} : decode {d} x {ds.text()}")
    return Candidate(cfg=c, overrides=over, text=text)

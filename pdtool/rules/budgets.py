"""Timers that contradict each other (pdtool.budgets lays them out): an error naming the key
that holds the limit and every key that must fit inside it."""

from __future__ import annotations

from pdtool.budgets import budgets, parts_text, seconds
from pdtool.rules.finding import Finding, error
from pdtool.schema import Config


def check_budgets(cfg: Config) -> list[Finding]:
    """One error per limit key: the first budget it does not hold (the restarts' budget
    contains the start's, so a short launcher.time is said once)."""
    out: list[Finding] = []
    for b in budgets(cfg):
        if b.fits or any(f.key == b.key for f in out):
            continue
        out.append(error(b.key, f"{b.name}: {seconds(b.limit_s)} is less than "
                         f"{parts_text(b)}; {b.why}", b.fix))
    return out


ALL = (check_budgets,)

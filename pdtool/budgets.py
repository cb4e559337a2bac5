"""Time budgets that must agree with each other, written down once.

A deployment has many timers, each owned by a different key, and a hang or a cut request is
often two of them disagreeing: a router that gives up on a request before SGLang's own
bootstrap and waiting timers would have reported why; a benchmark client that abandons a
request the deployment was still allowed to finish; a Slurm time limit that signals the job
to stop before its health wait can end; restarts whose back-off alone outlasts the job.
`budgets(cfg)` lays each of them out as a limit (one key) against what the other keys add up
to; `pdtool validate` prints the table and refuses a contradiction naming the keys
(`pdtool.rules.budgets`). Pure: no launch code, so the launchers take `stop_lead_s` from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdtool.adapters import adapter
from pdtool.schema import Config

#: sglang-router's --request-timeout-secs, and the reference front's request limit
REQUEST_KEY = "router.request_timeout_s"
#: `pdtool bench --timeout` (pdtool.bench.args) when launcher.benchmark does not set it
BENCH_TIMEOUT_DEFAULT_S = 300.0


def stop_lead_s(stop_grace_s: int) -> int:
    """Slurm signals the batch script this long before the time limit: the three stop groups'
    grace (launcher.stop_grace_s each) and a margin, so the ordered stop ends before Slurm's
    own kill at the limit."""
    return 3 * stop_grace_s + 30


_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


def slurm_seconds(limit: str) -> float | None:
    """Seconds in a Slurm time limit (sbatch(1) --time: MM, MM:SS, HH:MM:SS, D-HH,
    D-HH:MM, D-HH:MM:SS); None for `infinite`/`UNLIMITED` or a value that is not one
    (rules.values refuses those)."""
    m = _SLURM_TIME.match(limit.strip())
    if m is None:
        return None
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = [*parts, 0, 0][:3]
        return float(((int(days) * 24 + h) * 60 + mi) * 60 + s)
    if len(parts) == 1:  # MM
        return float(parts[0] * 60)
    if len(parts) == 2:  # MM:SS
        return float(parts[0] * 60 + parts[1])
    h, mi, s = parts
    return float((h * 60 + mi) * 60 + s)


@dataclass(frozen=True)
class Budget:
    """One limit against the sum of the timers that must fit inside it."""

    name: str  # what is being timed
    key: str  # the key holding the limit
    limit_s: float | None  # None: no limit (an unlimited Slurm time)
    parts: tuple[tuple[str, float], ...]  # (key, seconds) that must fit in the limit
    why: str  # what goes wrong when they do not
    fix: str

    @property
    def need_s(self) -> float:
        return sum(s for _, s in self.parts)

    @property
    def fits(self) -> bool:
        return self.limit_s is None or self.need_s <= self.limit_s


def bench_timeout_s(benchmark_args: list[str]) -> float | None:
    """The `--timeout` launcher.benchmark gives `pdtool bench` (None when absent: the job
    picks `in_job_bench_timeout_s`); the arguments are checked by rules.benchmark, so a bad
    value reads as absent here."""
    args = [str(a) for a in benchmark_args]
    for i, a in enumerate(args):
        value = a.split("=", 1)[1] if a.startswith("--timeout=") else (
            args[i + 1] if a == "--timeout" and i + 1 < len(args) else None)
        if value is not None:
            try:
                return float(value)
            except ValueError:
                break
    return None


def in_job_bench_timeout_s(cfg: Config) -> float:
    """The in-job benchmark's --timeout when launcher.benchmark sets none: the bench default,
    or the deployment's transfer budget when that is longer (a DeepSeek recipe keeps SGLang's
    300 s timers: 600 s), so the client never gives up before the deployment would say why."""
    return max(BENCH_TIMEOUT_DEFAULT_S, sum(s for _, s in transfer_parts(cfg)))


def transfer_parts(cfg: Config) -> tuple[tuple[str, float], ...]:
    """How long a request may legitimately wait on its KV before the deployment reports a
    failure: with engine=sglang SGLang's bootstrap timer (transfer.connect_timeout_s) and then
    its waiting timer (transfer.timeout_s, pdtool.launch.backends); the reference engine
    connects once at start, so only the transfer's own limit counts per request."""
    return adapter(cfg).transfer_timers(cfg)


def client_budget(cfg: Config, timeout_s: float, key: str = "--timeout") -> Budget:
    """A benchmark client's request timeout (`pdtool bench --timeout`; key: where it is set)
    against the deployment's own transfer timers."""
    return Budget(
        "the benchmark client's --timeout", key, timeout_s, transfer_parts(cfg),
        "the benchmark abandons a request the deployment is still allowed to finish, and "
        "counts a client timeout instead of the deployment's own error",
        "give the benchmark a larger --timeout, or lower the transfer timeouts")


def budgets(cfg: Config) -> list[Budget]:
    """Every budget that applies to `cfg` (values already range-checked by rules.values)."""
    out: list[Budget] = []
    lc = cfg.launcher
    if cfg.mode == "disaggregated":
        parts = transfer_parts(cfg)
        out.append(Budget(
            "a request waiting on its KV", REQUEST_KEY, cfg.router.request_timeout_s, parts,
            "the router cuts a request whose KV is late before the engine reports why (the "
            "client sees a bare timeout, and decode holds the request's pages until its own "
            "timer fires)",
            f"raise {REQUEST_KEY} to at least the sum, or lower the transfer timeouts"))
        timeout = bench_timeout_s(list(lc.benchmark))
        if lc.benchmark and timeout is not None:
            out.append(client_budget(cfg, timeout, "launcher.benchmark"))
    if lc.kind == "slurm":
        limit = slurm_seconds(lc.time)
        lead = ("the stop signal's lead, 3 x launcher.stop_grace_s + 30 s",
                float(stop_lead_s(lc.stop_grace_s)))
        start = (("launcher.health_timeout_s", float(lc.health_timeout_s)), lead)
        out.append(Budget(
            "the job's start", "launcher.time", limit, start,
            "Slurm signals the job to stop before its health wait can end: a slow model load "
            "is stopped instead of reported",
            "raise launcher.time, or lower launcher.health_timeout_s"))
        if lc.restart == "on-failure" and lc.max_restarts > 0:
            backoff = lc.restart_backoff_s * (2 ** lc.max_restarts - 1)
            out.append(Budget(
                "restart back-offs", "launcher.time", limit,
                (*start, (f"launcher.restart_backoff_s x (2^{lc.max_restarts} - 1)", backoff)),
                "the back-off before the last restarts outlasts the job: launcher.max_restarts "
                "can never be reached",
                "lower launcher.max_restarts or launcher.restart_backoff_s, or raise "
                "launcher.time"))
    if lc.watchdog_s > 0:
        out.append(Budget(
            "one watchdog probe", "launcher.watchdog_s", lc.watchdog_s,
            (("launcher.probe_timeout_s", lc.probe_timeout_s),),
            "a probe still waiting when the next one is due: misses pile up faster than "
            "launcher.watchdog_s says",
            "make launcher.probe_timeout_s at most launcher.watchdog_s"))
    return out


def parts_text(b: Budget) -> str:
    """`key 120 s + key 60 s = 180 s` (the sum only when there is one)."""
    text = " + ".join(f"{key} {seconds(s)}" for key, s in b.parts)
    return f"{text} = {seconds(b.need_s)}" if len(b.parts) > 1 else text


def seconds(value: float | None) -> str:
    """A budget figure for the table: 90 s, 25 min, 2.0 h, unlimited."""
    if value is None:
        return "unlimited"
    if value < 600:
        return f"{value:g} s"
    if value < 3 * 3600:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"

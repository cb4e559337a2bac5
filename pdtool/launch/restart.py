"""launcher.restart: what the launchers do when a process of a serving deployment fails.

One process exiting (or hanging, seen by the watchdog) used to end the whole deployment,
although its peers cope with a missing instance: the reference front routes around a dead
decode instance, and decode fails the transfers of a silent prefill fast. With `on-failure`
the launcher (the local supervisor, or the Slurm/local script) stops the failed process's whole
instance (every rank: an instance's ranks share one process group, gloo or NCCL, which cannot
take a new member), waits, starts it again with the same command lines, and waits for its
health; its peers then accept the restarted instance — new control address, new session, new
memory keys — on their own (docs/failure-model.md "Restarts", docs/slurm.md). Each instance is
restarted at most `max_restarts` times; the wait doubles each time from `restart_backoff_s`,
so a process that fails at once on every start (a bad flag, a full disk) ends the deployment
within a bounded time instead of looping. `never` keeps the old behaviour, which benchmarks and
`--smoke` use: a figure measured across a restart would not be the deployment's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ON_FAILURE, NEVER = "on-failure", "never"


@dataclass(frozen=True)
class RestartPolicy:
    mode: str = NEVER
    max_restarts: int = 3
    backoff_s: float = 5.0

    @classmethod
    def of(cls, launcher: Any) -> RestartPolicy:
        """From schema.LauncherConfig's restart keys."""
        return cls(launcher.restart, int(launcher.max_restarts),
                   float(launcher.restart_backoff_s))

    @property
    def enabled(self) -> bool:
        return self.mode == ON_FAILURE and self.max_restarts > 0

    def delay(self, n: int) -> float:
        """Seconds to wait before the n-th restart (1-based) of one instance."""
        return self.backoff_s * 2 ** (n - 1)


def group_of(name: str) -> str:
    """The restart unit a process belongs to: its instance ("decode-1" for "decode-1.r0",
    every rank of it), or the router."""
    return name.split(".", 1)[0]

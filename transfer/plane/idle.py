"""How a data plane's C waits idle while their polls keep finding nothing.

A wait for writes (a decoder counting them, a sender waiting for its completions) first polls,
then yields, then sleeps between polls: from `POLL_SLEEP_S`, doubling while the polls stay
empty, up to `POLL_BACKOFF_S`; any poll that finds work starts over. Without the sleeps a
waiting thread spins a core. On a box with fewer cores than busy threads that core is the
one the engine's compute needs. Measured on a 2-core box with SGLang's CPU engine: the
decode's progress thread took half the box while it counted writes, and a 64-token prefill
ran at a quarter of its speed. See docs/benchmark.md.

On tcp the receiver's polls move the bytes, and a receiver asleep mid-stream makes the sender
wake it at each burst. A receiving endpoint there polls `TCP_STREAM_SPINS` times (about 2 ms)
before it sleeps on the CQ's wait fd (the endpoint's default is 64): at 1 MiB pages the gaps
between bursts outlast 256 polls, 4,700-8,700 sleeps per 2 GiB; 1,024 polls bridge them
(120-300 sleeps), and the prefill spent 0.255-0.26 CPU s/GiB instead of 0.29-0.305
(docs/benchmark-rounds.md, "Ninth round")."""

from __future__ import annotations

from typing import Any

POLL_SLEEP_S = 20e-6     # first sleep of an empty stretch of polls
POLL_BACKOFF_S = 0.0005  # the longest one
TCP_STREAM_SPINS = 1024  # tcp receivers: empty polls before the first sleep


def idle_options(provider: str, backoff_s: float = POLL_BACKOFF_S, *,
                 receiver: bool = False) -> dict[str, Any]:
    """`fabric.Endpoint` options for waits that sleep by the backoff above (`backoff_s`: its
    longest sleep; 0: yield only, never sleep)."""
    if not backoff_s:
        return {}
    options: dict[str, Any] = {"idle_sleep_s": min(POLL_SLEEP_S, backoff_s),
                               "idle_max_sleep_s": backoff_s}
    if receiver and provider.startswith("tcp"):
        options["idle_spins"] = TCP_STREAM_SPINS
    return options

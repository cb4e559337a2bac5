"""Unsticking an shm sender whose writes a dead peer holds.

libfabric's shm provider (1.17) retires a sender's writes from one response queue, in order. A
write to a peer that died (or hangs) with writes in flight stays at the head of that queue: no
write to any other peer completes after it, the queue fills, and every later write times out.
The provider has no call that drops it; closing the endpoint does (`fabric.Endpoint.reset`,
which reports each write it cancels as a failed write on its tag). Other providers fail the
writes of a peer that went away themselves, and are left alone.

`StallWatch` is the rule both prefill data planes apply: an shm sender that had writes in
flight and saw none of them settle for `after_s` is reset. The planes pass the time their
control plane allows a silent peer's writes (the messenger's 2 × `peer_timeout_s`, SGLang's
heartbeat window), so a live but slow decode is given as long as a live peer is
anywhere else. The writes to live peers that the reset cancels fail their requests, which are
answered with an error and may be retried: a failed request instead of a prefill that never
moves KV again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from transfer.fabric import Endpoint

logger = logging.getLogger(__name__)


class StallWatch:
    """Watches the shm endpoints of `eps`; `check(now)` resets each one stalled for `after_s`."""

    def __init__(self, eps: Sequence[Endpoint], after_s: float) -> None:
        if after_s <= 0:
            raise ValueError(f"after_s must be > 0 seconds, got {after_s!r}")
        self.eps = [ep for ep in eps if ep.provider == "shm"]
        self.after_s = after_s
        self._seen = [(-1, 0.0)] * len(self.eps)  # (completions, when they last moved)
        self.resets = 0

    def check(self, now: float) -> int:
        """Reset every watched endpoint with writes in flight and no write settled in the last
        `after_s` seconds; returns how many were reset (their cancelled writes are in their
        `errors`)."""
        reset = 0
        for i, ep in enumerate(self.eps):
            done = ep.completions
            if ep.inflight == 0 or done != self._seen[i][0]:
                self._seen[i] = (done, now)
                continue
            if now - self._seen[i][1] < self.after_s:
                continue
            stuck = ep.inflight
            ep.reset(f"cancelled: no write on shm settled for {self.after_s:.0f} s (a peer "
                     f"died or hangs with writes in flight, holding every other peer's)")
            logger.warning("pdtool: %d writes on shm settled none for %.0f s: a peer died or "
                           "hangs with writes in flight; endpoint reset, its writes cancelled "
                           "(their requests fail)", stuck, self.after_s)
            self._seen[i] = (ep.completions, now)
            reset += 1
        self.resets += reset
        return reset

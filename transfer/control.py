"""Former home of the messenger's signed control plane, now `transfer.wire` (one envelope for
every control plane; PROTOCOL.md lists the messages). Only names other modules still import
from here are kept, each an alias of its one definition in transfer.wire, plus the wall-clock
`ReplayGuard` that transfer/sglang/conn.py's own frames use until they move onto
`transfer.wire.sglang.Frames` — delete both then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .wire.channel import FAULTS_ENV, ControlFaults, check_bind_host, env_faults
from .wire.fields import WireError as ControlError
from .wire.secret import MIN_SECRET_BYTES, check_secret, generate_secret, read_secret, write_secret

__all__ = ["FAULTS_ENV", "MIN_SECRET_BYTES", "ControlError", "ControlFaults", "ReplayGuard",
           "check_bind_host", "check_secret", "env_faults", "generate_secret", "read_secret",
           "write_secret"]


@dataclass
class ReplayGuard:
    """Legacy (SGLang frames of protocol version 1 only): refuses timestamps outside
    `window_s` of this host's clock and nonces seen within it. Needs the hosts' clocks to
    agree; transfer.wire's sessions do not."""

    window_s: float = 30.0
    _seen: dict[bytes, float] = field(default_factory=dict)
    _last_prune: float = 0.0

    def check(self, ts: float, nonce: bytes, now: float) -> None:
        if abs(now - ts) > self.window_s:
            raise ControlError(f"ts: message is {now - ts:+.1f} s old, outside the "
                               f"{self.window_s:.0f} s window (replay or clock skew)")
        if nonce in self._seen:
            raise ControlError("nonce: already seen (replayed message)")
        self._seen[nonce] = ts
        if now - self._last_prune > self.window_s / 4 or len(self._seen) > 1 << 20:
            cutoff = now - self.window_s
            self._seen = {n: t for n, t in self._seen.items() if t >= cutoff}
            self._last_prune = now

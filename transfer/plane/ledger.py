"""The send ledger: what a prefill rank owes each destination, counted on one fabric tag.

Both control planes (the reference messenger and the SGLang backend) send a request's KV to
each decode rank under its own fabric tag, and both must know when the source pages are no
longer read: when every operation issued on the tag has settled. An operation settles when the
tag's local completion counter moves (`send_done[tag]`, summed over the rails), when its
completion error arrives (`Endpoint.errors`, one entry per failed operation: counted in
`errored`), or when it is known complete by other means (a bounce buffer whose writes all
completed: `credited`).

A tag is handed out again only after its account closed with every operation settled; an
account given up while writes may still complete (a peer that stopped answering) retires its
tag for good (`leaked`), so a late completion is never credited to another request. Counters
are read relative to `base`, the tag's count when the account opened, because they only grow.

Engine-neutral: this module knows tags and counts, nothing of rooms, requests or peers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar


@dataclass(kw_only=True)
class Account:
    """One (request, destination)'s operations on one fabric tag. Control planes subclass it
    with what they route by; the ledger reads and writes only these fields."""

    tag: int
    base: int          # the tag's completion count when the account opened
    issued: int = 0    # operations submitted (what the decoder counts)
    errored: int = 0   # operations that completed with an error
    credited: int = 0  # operations known complete otherwise (bounce buffers, staging)


A = TypeVar("A", bound=Account)


class LedgerFull(RuntimeError):
    """Every tag is in use: more transfers in flight than the ledger was sized for."""


class SendLedger:
    """Fabric tags `0..num_tags-1` and the open account on each. `send_done(tag)` is the
    tag's local completion count (one endpoint's `send_done[tag]`, or the sum over rails)."""

    def __init__(self, num_tags: int, send_done: Callable[[int], int]) -> None:
        self.num_tags = num_tags
        self._send_done = send_done
        self._free: deque[int] = deque(range(num_tags))
        self._open: dict[int, Account] = {}
        self.leaked = 0  # tags retired for good (a completion may still come on them)

    @property
    def free(self) -> int:
        return len(self._free)

    def open(self, build: Callable[..., A]) -> A:
        """Take a free tag and open an account on it: `build(tag=..., base=...)` makes it."""
        if not self._free:
            raise LedgerFull(f"more than {self.num_tags} transfers in flight")
        tag = self._free.popleft()
        account = build(tag=tag, base=int(self._send_done(tag)))
        self._open[tag] = account
        return account

    def owner(self, tag: int) -> Account | None:
        return self._open.get(tag)

    def completed(self, a: Account) -> int:
        """Operations of `a` settled so far, successfully or not."""
        return int(self._send_done(a.tag)) - a.base + a.errored + a.credited

    def in_flight(self, a: Account) -> int:
        return a.issued - self.completed(a)

    def drained(self, a: Account) -> bool:
        """Every operation issued on `a` settled: its source memory is no longer read."""
        return self.completed(a) >= a.issued

    def failed(self, tag: int) -> Account | None:
        """One operation on `tag` completed with an error: counted on its account, which is
        returned (None for a tag with no open account, e.g. one closed or another owner's)."""
        a = self._open.get(tag)
        if a is not None:
            a.errored += 1
        return a

    def give_up(self, a: Account) -> None:
        """Count every operation of `a` not yet completed as failed (its peer is gone and the
        decoder quarantines the pages anyway); close with `leak=True` afterwards."""
        done = int(self._send_done(a.tag)) - a.base + a.credited
        a.errored = max(a.errored, a.issued - done)

    def close(self, a: Account, leak: bool = False) -> None:
        """The account is finished. Its tag is free again unless `leak`: a completion may still
        come on it, so it is never handed out again."""
        if self._open.pop(a.tag, None) is None:
            return
        if leak:
            self.leaked += 1
        else:
            self._free.append(a.tag)

"""Decoder transfer slots: (slot, generation) allocation, expected counts and quarantine.

A transfer slot names one in-flight request on one decode rank; every write for it carries
`encode_imm(slot, gen)` and the fabric's poll loop counts it in `recv_counts[slot]` only while
`recv_gen[slot] == gen`. Two fences follow:

* counting: a slot gets a new generation each time it is handed out, so a late write of an
  earlier owner lands in `stale_writes`, never in the new owner's count;
* bytes: the generation cannot stop bytes from landing. A failed transfer's destination pages
  (and its aux row, which is the slot's row) are therefore QUARANTINED: the slot keeps its
  generation (late writes keep being counted into it) until every prefill rank of the transfer
  either confirmed ABORTED — "I issued `issued` writes for you, all completed locally, I will
  issue no more" — and that many writes have been counted here (so even a transmit-complete
  provider's bytes have landed), or is known dead and its liveness lease has run out. Only then
  do the pages go back to the engine and the slot back to the free list (with a new generation).
  A confirmed peer whose writes never show up (a write that failed on the wire) is waited for
  `grace_s` at most, then released with a warning: the writes it reported are lost, not late.

Owned and touched by the messenger thread only (it also owns the fabric endpoint whose arrays
are passed in), so no locking.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Quarantine:
    """What a failed transfer's slot waits for before its pages may be reused."""

    rid: str
    waiting: set[Hashable]                # prefill peers that have not confirmed ABORTED yet
    dead_until: dict[Hashable, float] = field(default_factory=dict)  # peer -> lease end
    required: int = 0                     # writes the confirmed peers said they issued
    confirmed_at: float | None = None


class SlotTable:
    """Slots [0, capacity) over the endpoint's `recv_counts` / `recv_gen` arrays."""

    def __init__(self, capacity: int, recv_counts: np.ndarray, recv_gen: np.ndarray,
                 grace_s: float = 5.0) -> None:
        if not 0 < capacity <= len(recv_counts):
            raise ValueError(f"max_inflight must be in [1, {len(recv_counts)}], got {capacity}")
        self.capacity = capacity
        self.counts = recv_counts
        self.gens = recv_gen
        self.grace_s = grace_s
        self.expected = np.zeros(capacity, dtype=np.uint32)
        self._free = list(range(capacity - 1, -1, -1))
        self._next_gen = np.ones(capacity, dtype=np.uint32)
        self._active = np.zeros(capacity, dtype=bool)
        self.quarantined: dict[int, Quarantine] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def busy(self) -> bool:
        """Writes may still land: a transfer is being counted or a slot is quarantined."""
        return bool(self.quarantined) or bool(self._active.any())

    def allocate(self, expected: int) -> tuple[int, int] | None:
        """A fresh (slot, gen) armed to count `expected` writes; None when all are in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        gen = int(self._next_gen[slot]) & 0xFFFF
        self._next_gen[slot] = gen + 1
        self.gens[slot] = gen
        self.counts[slot] = 0
        self.expected[slot] = expected
        self._active[slot] = True
        return slot, gen

    def first_active(self) -> int:
        """Some slot still being counted, or -1."""
        i = int(self._active.argmax())
        return i if self._active[i] else -1

    def received(self, slot: int) -> int:
        return int(self.counts[slot])

    def completed(self) -> np.ndarray:
        """Active slots whose count reached the expected number (one vectorised compare)."""
        n = self.capacity
        return np.flatnonzero(self._active & (self.counts[:n] >= self.expected))

    def finish(self, slot: int) -> None:
        """The transfer succeeded: stop watching the slot (it is released later)."""
        self._active[slot] = False

    def release(self, slot: int) -> None:
        """Back to the free list; the generation moves on so any straggler is stale."""
        self._active[slot] = False
        self.quarantined.pop(slot, None)
        self.gens[slot] = int(self._next_gen[slot]) & 0xFFFF
        self._free.append(slot)

    # -- quarantine -------------------------------------------------------------------------
    def quarantine(self, slot: int, rid: str, ranks: set[Hashable]) -> Quarantine:
        self._active[slot] = False
        q = Quarantine(rid, set(ranks))
        self.quarantined[slot] = q
        return q

    def confirm(self, slot: int, rank: Hashable, issued: int, now: float) -> None:
        q = self.quarantined.get(slot)
        if q is None or rank not in q.waiting:
            return
        q.waiting.discard(rank)
        q.dead_until.pop(rank, None)
        q.required += issued
        q.confirmed_at = now

    def peer_dead(self, rank: Hashable, lease_end: float) -> None:
        for q in self.quarantined.values():
            if rank in q.waiting:
                q.dead_until[rank] = lease_end

    def ready_to_release(self, now: float) -> list[int]:
        """Quarantined slots whose pages can no longer be written by anyone."""
        out = []
        for slot, q in self.quarantined.items():
            if any(r not in q.dead_until or now < q.dead_until[r] for r in q.waiting):
                continue
            if int(self.counts[slot]) >= q.required:
                out.append(slot)
            elif q.confirmed_at is not None and now - q.confirmed_at > self.grace_s:
                log.warning("transfer %s: %d of %d confirmed writes never arrived; releasing "
                            "its pages after %.1f s", q.rid, int(self.counts[slot]), q.required,
                            self.grace_s)
                out.append(slot)
            elif q.confirmed_at is None:
                out.append(slot)  # every peer dead and past its lease
        return out

"""Decode-side data plane of the SGLang backend: transfer slots counted in C.

The same pieces as the reference messenger's decoder (`transfer.messenger.decode`): a
`transfer.plane.slots.SlotTable` over the endpoint's `recv_counts`/`recv_gen`, its `expected` array
watched by the C poll loop (`Endpoint.watch_targets`), and one progress thread that waits in C
(`Endpoint.wait_complete`, the GIL released) until a watched slot reaches its count or the
doorbell rings. So the backend and the messenger share one data plane.

Why the scheduler thread never waits: `allocate`/`set_expected`/`release` (called from SGLang's
`send_metadata` and `clear`) only take this plane's own lock for a few microseconds and never
touch the endpoint, whose lock the progress thread holds while it polls. Handing a slot out
without the endpoint lock is safe because a released slot already carries the generation its
next owner gets (`SlotTable.release`): nothing can count into it before its META is sent.

Several NICs (`rails.py`): the rank's further endpoints are receive lanes of `ep`
(`Endpoint.share_counts`), each drained by its own C thread and counting into the same slots,
so a slot completes (and wakes this thread's C wait) whichever NIC carried its operations.
This thread tells them when transfers are being counted (`set_active`): they poll eagerly
then and sleep between polls otherwise.

A slot may be armed before its count is known (the prefill instance has not answered the
registration yet: PEER, `decode_side.py` `_on_peer`): it counts from the start and completes once
`set_expected` gives the number.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from transfer.plane.slots import SlotTable
from transfer.sglang.metrics import NO_METRICS
from transfer.wakeups import CommandQueue

logger = logging.getLogger(__name__)

UNKNOWN = 0xFFFFFFFF  # expected count of a slot whose prefill geometry is not known yet
# longest C wait: arming a slot, its count and close ring the bell, which ends the wait at
# once, so the slice bounds only a release's switch of the lanes to their idle polling. Each
# return costs a Python round, and on tcp each new wait polls 1,024 times before it sleeps
# (transfer.plane.idle): at 2 ms a decoder counting writes spun most of a core.
POLL_SLICE_S = 0.02
IDLE_WAIT_S = 0.05    # nothing being counted: sleep on the doorbell this long per round


class DecodePlane:
    """Slots of one decode rank and the thread that counts them. `on_done(room, reason)` is
    called from the progress thread: reason None = every expected write landed."""

    def __init__(self, ep, on_done: Callable[[int, str | None], None],
                 on_death: Callable[[str], None], lanes: bool = False,
                 metrics: Any = NO_METRICS) -> None:
        self.ep = ep
        self.metrics = metrics  # slots in use (transfer.sglang.metrics)
        self._lanes = lanes
        self._active = False
        self.slots = SlotTable(ep.max_slots, ep.recv_counts, ep.recv_gen)
        ep.watch_targets(self.slots.expected)
        self._on_done = on_done
        self._on_death = on_death
        self._lock = threading.Lock()
        self._rooms: dict[int, int] = {}  # slot -> room
        self._armed: dict[int, tuple[float, str]] = {}  # room -> (armed at, prefill peer)
        self._bell = CommandQueue()
        if ep.has_wait_fd:  # tcp: the C waits' sleeps end when bytes arrive or a command comes
            ep.set_wake_fd(self._bell.wake_fd)
        self._stop = threading.Event()
        self.problem = ""  # why the plane stopped; new transfers are refused with it
        self._thread = threading.Thread(target=self._run, name="pdtool-decode-progress",
                                        daemon=True)
        self._thread.start()

    # -- scheduler thread -------------------------------------------------------------------
    def allocate(self, room: int, expected: int | None, peer: str = "") -> tuple[int, int]:
        """A fresh (slot, gen) counting writes for `room` from the prefill rank `peer`;
        RuntimeError when none is free or the plane stopped (the text says why)."""
        with self._lock:
            if self.problem:
                raise RuntimeError(self.problem)
            got = self.slots.allocate(UNKNOWN if expected is None else expected)
            if got is None:
                raise RuntimeError(f"more than {self.slots.capacity} transfers in flight")
            self._rooms[got[0]] = room
            self._armed[room] = (time.monotonic(), peer)
            self.metrics.slots_in_use(self.slots.capacity - self.slots.free)
        self._bell.append(None)  # the progress thread switches from its idle wait to C waits
        return got

    def set_expected(self, slot: int, room: int, expected: int) -> None:
        """The count of a slot armed with an unknown one (still owned by `room`)."""
        with self._lock:
            if self._rooms.get(slot) == room:
                self.slots.expected[slot] = expected
        self._bell.append(None)

    def release(self, slot: int) -> None:
        """Back to the free list; writes still in flight for it become stale."""
        with self._lock:
            room = self._rooms.pop(slot, None)
            self._armed.pop(room, None)
            self.slots.release(slot)
            self.metrics.slots_in_use(self.slots.capacity - self.slots.free)

    def armed_for(self, room: int) -> tuple[float, str] | None:
        """(seconds since `room`'s slot was armed, the prefill peer it counts writes from);
        None when it has no slot: what the metrics record when the room ends."""
        armed = self._armed.get(room)
        return None if armed is None else (time.monotonic() - armed[0], armed[1])

    def received(self, slot: int) -> int:
        return self.slots.received(slot)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"slots_free": self.slots.free, "slots_total": self.slots.capacity,
                    "counting": len(self._rooms)}

    def close(self) -> None:
        self._stop.set()
        self._bell.append(None)
        self._thread.join(timeout=5)

    # -- progress thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                active = self.slots.first_active() >= 0
                if self._lanes and active != self._active:
                    self.ep.set_active(active)
                    self._active = active
                if active:
                    self.ep.wait_complete(self._bell.bell, int(self._bell.bell[0]), POLL_SLICE_S)
                else:
                    self.ep.poll()  # late writes of finished slots still need progress
                    select.select([self._bell.wake_fd], [], [], IDLE_WAIT_S)
                self._bell.drain_wakeups()
                self._bell.clear()
                self._settle()
        except Exception as exc:  # any death must fail the rooms with a reason
            if self._stop.is_set():
                return
            reason = f"pdtool decode progress thread died: {exc!r}"
            logger.exception("%s", reason)
            with self._lock:
                self.problem = reason
            self._on_death(reason)

    def _settle(self) -> None:
        done: list[tuple[int, str | None]] = []
        with self._lock:
            for slot in self.slots.completed():
                slot = int(slot)
                got, want = self.slots.received(slot), int(self.slots.expected[slot])
                self.slots.finish(slot)
                room = self._rooms.get(slot)
                if room is not None:
                    done.append((room, None if got == want else
                                 f"pdtool: received {got} writes, expected {want} "
                                 f"(protocol error)"))
        for room, reason in done:
            self._on_done(room, reason)

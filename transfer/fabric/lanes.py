"""Receive lanes and progress threads: more endpoints in one domain counting into one owner's
slots, each drained by a C thread of its own (on shm the receiver does the copies, so one
thread per lane is one core's copy speed each). A part of `Endpoint`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .native import check, ffi, lib

if TYPE_CHECKING:
    from .domain import Domain
    from .endpoint import Endpoint, MemoryRegion


class Lanes:
    """Endpoint's lanes and progress thread (mixed into `Endpoint`)."""

    _lock: threading.Lock
    _h: Any
    _domain: Domain
    _owner: Endpoint | None
    _progress: bool
    _lane_mrs: dict[int, MemoryRegion]
    provider: str
    max_slots: int
    mr_endpoint: bool

    def _calls(self) -> Any: ...
    def _live(self) -> Any: ...
    def register(self, addr: int, length: int, **kw: Any) -> MemoryRegion: ...

    # ----------------------------------------------------------------- receive lanes
    def share_counts(self, owner: Endpoint) -> None:
        """Make this endpoint a receive lane of `owner`: CQ data arriving here is counted in
        `owner`'s slots (`recv_counts`, its watched targets, `wait_complete`), atomically,
        so several lanes and the owner can count the same transfer from different threads.
        Why lanes: on shm the RECEIVER performs every copy (process_vm_readv inside its CQ
        poll), so one receiving thread caps a decoder at one core's copy speed; a sender that
        spreads operations over lanes (`write_batch` with several peers) gets one copying
        thread per lane."""
        if owner is self or owner._owner is not None:
            raise ValueError("share_counts: the owner must be another, non-lane endpoint")
        if owner.max_slots != self.max_slots:
            raise ValueError(f"share_counts: owner has {owner.max_slots} slots, this endpoint "
                             f"{self.max_slots}")
        with self._lock:
            lib.pd_share_counts(self._calls(), owner._live())
        self._owner = owner  # keeps the owner's arrays alive while C may count into them

    def open_lane(self, **kw: Any) -> Endpoint:
        """A receive lane of this endpoint: a new endpoint (own CQ and address, drained by its
        own thread once `start_progress` is called) in this endpoint's fabric and DOMAIN,
        counting into this endpoint's slots (`share_counts`). Memory registered here serves
        the lane too (`lane_region`): one domain and one registration for all lanes.
        `kw`: Endpoint options for the lane (idle/cq settings); slots follow the owner."""
        lane = type(self)(self._domain.provider_arg, same_domain_as=self,
                        max_slots=self.max_slots, **kw)
        try:
            lane.share_counts(self)
        except Exception:
            lane.close()
            raise
        return lane

    def lane_region(self, mr: MemoryRegion) -> MemoryRegion:
        """The registration a sender must use to write `mr`'s memory through THIS endpoint:
        `mr` itself when it belongs to this endpoint's domain (the registration is the
        domain's). Only providers with FI_MR_ENDPOINT tie a registration to one endpoint:
        there the memory is registered again for this endpoint, once. Call before
        `start_progress`."""
        if mr.closed:
            raise ValueError("lane_region: the MemoryRegion is closed")
        if mr._ep._domain is not self._domain:
            raise ValueError("lane_region: the MemoryRegion belongs to another domain")
        if not self.mr_endpoint or mr._ep is self:
            return mr
        own = self._lane_mrs.get(id(mr))
        if own is None or own.closed:
            own = self.register(mr.addr, mr.length, iface=mr.iface)
            self._lane_mrs[id(mr)] = own
        return own

    @property
    def domain_handle(self) -> int:
        """Identity of the C domain this endpoint lives in (equal for an endpoint and its
        lanes): for checks and logs, not a libfabric object to pass anywhere."""
        return int(ffi.cast("uintptr_t", lib.pd_ep_domain(self._live())))

    def start_progress(self, sleep_s: float = 20e-6) -> None:
        """Drain this endpoint's CQ (and so, on shm, perform its copies) from a C thread of its
        own until `stop_progress`/`close`. Register memory and insert peers BEFORE: while the
        thread runs, calls into the provider are refused (the endpoint is single-threaded).
        When a poll finds nothing the thread yields, then sleeps `sleep_s` per poll while
        the owner's transfers are active (`set_active`) and 50x that while not."""
        if not 0 < sleep_s < 0.05:
            raise ValueError(f"sleep_s must be in (0, 0.05) seconds, got {sleep_s!r}")
        with self._lock:
            ret = lib.pd_progress_start(self._calls(), int(sleep_s * 1e9))
        check(ret, "start progress thread", self.provider)
        self._progress = True

    def stop_progress(self, timeout: float = 2.0) -> bool:
        """Stop the progress thread (idempotent); the endpoint is callable again. False when
        the thread did not come back within `timeout` s (stuck inside the provider): it keeps
        running and the endpoint stays its own."""
        if self._progress and self._h is not None:
            with self._lock:
                if lib.pd_progress_stop(self._h, int(timeout * 1e9)):
                    return False
        self._progress = False
        return True

    @property
    def progress_stalled_s(self) -> float:
        """Seconds the progress thread has been inside its current poll (0 when it is not in
        one). Polls are short; a large value means the provider does not return."""
        if not self._progress or self._h is None:
            return 0.0
        return int(lib.pd_progress_stalled_ns(self._h)) / 1e9

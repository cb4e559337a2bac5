"""pdtool's KV transfer metrics from inside SGLang's processes, on SGLang's own `/metrics`.

SGLang started with `--enable-metrics` runs prometheus_client in multiprocess mode: before its
scheduler processes start, the launcher sets PROMETHEUS_MULTIPROC_DIR; each process writes its
samples to files there, and the HTTP server's `/metrics` merges them. The backend's KV manager
lives in a scheduler process, so the counters it makes there appear on the server's `/metrics`
beside SGLang's own: counters and the histogram summed over the processes that share a label
set, the gauge summed over the live ones. Without `--enable-metrics` nothing is made
(`for_manager` returns `NO_METRICS`, whose calls do nothing).

Names and help are `transfer.plane.metrics`' table, the reference engine's too. Labels: `rank`
(the scheduler's attention-TP rank: every rank's writes are counted, not only a lead's); on the
prefill side `nic` (the endpoint that carried the operation, one per NIC with several NICs per
GPU, `rails.py`) and `peer` (the decode rank's control address, `ip:port`); on the decode side
`peer` (the prefill rank the transfer counted writes from, `ip:port`). The counts are
taken where the plane counts for itself (`PrefillPlane.posted`, the failed-write loop, the
decode manager's status changes), once per submission or transfer, never per page; and how
each of the scheduler's idle waits for its rooms ended (`idle_wait.py`), both roles.
"""

from __future__ import annotations

import os
from typing import Any

from transfer.plane.metrics import (
    DECODE_COUNTERS,
    IDLE_WAITS,
    PREFILL_COUNTERS,
    SLOTS_IN_USE,
    TRANSFER_S_BOUNDS,
    TRANSFER_SECONDS,
)


class NoMetrics:
    """What a backend without `--enable-metrics` counts into: nothing."""

    def posted(self, nic: str, peer: str, ops: int, writes: int, nbytes: int) -> None:
        pass

    def write_failed(self, peer: str) -> None:
        pass

    def transfer_ended(self, ok: bool, seconds: float | None, peer: str,
                       timed_out: bool = False) -> None:
        pass

    def slots_in_use(self, n: int) -> None:
        pass

    def idle_wait(self, ended: str) -> None:
        pass


NO_METRICS = NoMetrics()


class BackendMetrics(NoMetrics):
    """One scheduler process's transfer metrics (multiprocess mode: no registry is needed,
    the samples go to PROMETHEUS_MULTIPROC_DIR's files, which SGLang's `/metrics` reads)."""

    def __init__(self, prefill: bool, rank: int) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.rank = str(rank)
        self._idle_waits = Counter(*IDLE_WAITS, ["rank", "ended"], registry=None)
        if prefill:
            labels = ["rank", "nic", "peer"]
            self._ops = Counter(*PREFILL_COUNTERS["ops_issued"], labels, registry=None)
            self._writes = Counter(*PREFILL_COUNTERS["writes_issued"], labels, registry=None)
            self._bytes = Counter(*PREFILL_COUNTERS["bytes_issued"], labels, registry=None)
            self._errors = Counter(*PREFILL_COUNTERS["write_errors"], ["rank", "peer"],
                                   registry=None)
        else:
            labels = ["rank", "peer"]
            self._ok = Counter(*DECODE_COUNTERS["transfers_ok"], labels, registry=None)
            self._failed = Counter(*DECODE_COUNTERS["transfers_failed"], labels,
                                   registry=None)
            self._timed_out = Counter(*DECODE_COUNTERS["transfers_timed_out"], labels,
                                      registry=None)
            self._seconds = Histogram(*TRANSFER_SECONDS, labels, buckets=TRANSFER_S_BOUNDS,
                                      registry=None)
            self._slots = Gauge(*SLOTS_IN_USE, ["rank"], multiprocess_mode="livesum",
                                registry=None)
            self.slots_in_use(0)  # on /metrics from the start, before any transfer

    def posted(self, nic: str, peer: str, ops: int, writes: int, nbytes: int) -> None:
        """Operations of `writes` page writes (landing units on the staged path) and
        `nbytes` went to `peer` over `nic`."""
        if ops:
            self._ops.labels(self.rank, nic, peer).inc(ops)
            self._writes.labels(self.rank, nic, peer).inc(writes)
            self._bytes.labels(self.rank, nic, peer).inc(nbytes)

    def write_failed(self, peer: str) -> None:
        self._errors.labels(self.rank, peer).inc()

    def transfer_ended(self, ok: bool, seconds: float | None, peer: str,
                       timed_out: bool = False) -> None:
        """A decode room reached Success or Failed (`seconds`: since its slot was armed,
        counting writes from the prefill rank `peer`; "" when it never was; `timed_out`: a
        failure by SGLang's waiting timeout, counted among the failed too)."""
        if not ok:
            self._failed.labels(self.rank, peer).inc()
            if timed_out:
                self._timed_out.labels(self.rank, peer).inc()
            return
        self._ok.labels(self.rank, peer).inc()
        if seconds is not None:
            self._seconds.labels(self.rank, peer).observe(seconds)

    def slots_in_use(self, n: int) -> None:
        self._slots.labels(self.rank).set(n)

    def idle_wait(self, ended: str) -> None:
        """The scheduler slept while its rooms were in flight (`idle_wait.py`), until
        `ended` (news, request, timeout)."""
        self._idle_waits.labels(self.rank, ended).inc()


def for_manager(prefill: bool, rank: int) -> Any:
    """The metrics of a KV manager: real when SGLang exports metrics (--enable-metrics set
    PROMETHEUS_MULTIPROC_DIR before this process started), else `NO_METRICS`."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return NO_METRICS
    try:
        return BackendMetrics(prefill, rank)
    except ImportError:  # prometheus_client is SGLang's own dependency; without it, nothing
        return NO_METRICS

"""The names of the KV transfer metrics, one table for both control planes.

The reference engine's instance leads export them from their messenger's `stats()` at scrape
time (`pdtool.engines.reference.metrics`); SGLang's processes export them from inside pdtool's
backend through SGLang's own `/metrics` (`transfer.sglang.metrics`). A dashboard written for
one deployment reads the other: same names, same help, the transfer-time histogram with the
same buckets.
"""

from __future__ import annotations

#: upper bounds (seconds) of the decode side's transfer-time histogram
TRANSFER_S_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0)

#: prefill side: stats key -> (metric, help); monotonic counts
PREFILL_COUNTERS = {
    "ops_issued": ("pdtool_kv_write_operations", "KV and aux RMA operations issued (what the "
                   "decoders count)"),
    "writes_issued": ("pdtool_kv_page_writes", "page writes issued (grouped into operations)"),
    "bytes_issued": ("pdtool_kv_sent_bytes", "bytes the issued operations carry"),
    "write_errors": ("pdtool_kv_write_errors", "operations that completed with an error"),
    "leaked_tags": ("pdtool_kv_retired_tags", "fabric tags retired for good (a dead peer's "
                    "writes never completed)"),
    "stall_resets": ("pdtool_kv_stall_resets", "shm endpoint resets after a stalled peer"),
}
#: decode side: stats key -> (metric, help)
DECODE_COUNTERS = {
    "transfers_ok": ("pdtool_kv_transfers_succeeded", "transfers whose every write landed"),
    "transfers_failed": ("pdtool_kv_transfers_failed", "transfers that failed (any reason)"),
    "transfers_timed_out": ("pdtool_kv_transfers_timed_out", "failed transfers that ran past "
                            "transfer.timeout_s"),
    "stale_writes": ("pdtool_kv_stale_writes", "writes of an old transfer that landed after "
                     "its slot was reused (counted, never credited)"),
}
TRANSFER_SECONDS = ("pdtool_kv_transfer_seconds", "from submit to the transfer's last counted "
                    "write (successful transfers)")
SLOTS_IN_USE = ("pdtool_kv_slots_in_use", "transfer slots counting writes or quarantined")
#: SGLang's schedulers only (`transfer.sglang.idle_wait`; the reference engine's loops sleep on
#: their doorbells already), both roles, by how each wait ended
IDLE_WAITS = ("pdtool_scheduler_idle_waits", "waits of a scheduler with nothing to run while "
              "its rooms were in flight, by what ended them (news: a room changed, request, "
              "timeout)")

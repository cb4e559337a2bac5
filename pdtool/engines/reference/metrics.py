"""Prometheus metrics of the reference engine: `/metrics` on the front and on every instance
lead's side door.

The front counts what a client sees: requests by HTTP status, time to first token, time per
output token and end-to-end latency (histograms), prompt and output tokens, requests in
flight, decode instances up. Instance leads export their KV messenger's counters, read at
scrape time from the messenger's `stats()` (nothing is added to the hot path but one dict
entry per write call): a prefill lead the operations and bytes it issued (by `nic` and decode
`peer`), its page writes, failed writes, retired tags and stall resets; a decode lead its
transfers that succeeded, failed and timed out and their time from submit to the last counted
write (a histogram), by prefill instance (`peer`), its stale writes and transfer slots in
use. Each process has a registry of its own, so the names below are the whole of what it
exports. The transfer metrics' names are `transfer.plane.metrics`' table, which pdtool's
SGLang backend exports too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from transfer.plane.metrics import (
    DECODE_COUNTERS,
    PREFILL_COUNTERS,
    SLOTS_IN_USE,
    TRANSFER_S_BOUNDS,
    TRANSFER_SECONDS,
)

#: latency buckets (seconds) of the front's histograms: a CPU engine's milliseconds up to a
#: long generation's minute
LATENCY_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FrontMetrics:
    """What the OpenAI front observes, one registry per front."""

    def __init__(self, inflight: Callable[[], int], up: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdtool_requests", "requests answered, by HTTP status",
                                ["status"], registry=r)
        self.ttft = Histogram("pdtool_time_to_first_token_seconds",
                              "from the request's arrival to its first output token",
                              buckets=LATENCY_S, registry=r)
        self.tpot = Histogram("pdtool_time_per_output_token_seconds",
                              "mean time between output tokens of one request",
                              buckets=LATENCY_S, registry=r)
        self.e2e = Histogram("pdtool_request_seconds", "from arrival to the last token",
                             buckets=LATENCY_S, registry=r)
        self.prompt_tokens = Counter("pdtool_prompt_tokens", "prompt tokens of answered "
                                     "requests", registry=r)
        self.output_tokens = Counter("pdtool_output_tokens", "tokens generated", registry=r)
        Gauge("pdtool_requests_running", "requests in flight", registry=r).set_function(inflight)
        Gauge("pdtool_decode_instances_up", "decode instances the front sends to",
              registry=r).set_function(up)

    def answered(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    def served(self, prompt: int, output: int, seconds: float, ttft_s: float | None,
               tpot_s: float | None) -> None:
        """One request answered 200: its tokens and timings."""
        self.prompt_tokens.inc(prompt)
        self.output_tokens.inc(output)
        self.e2e.observe(seconds)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


#: prefill counts kept per decode peer too (the messenger's `sent_to`: [operations, bytes])
BY_PEER = {"ops_issued": 0, "bytes_issued": 1}
#: decode counts kept per prefill instance (the messenger's `by_prefill`)
TALLIED = ("transfers_ok", "transfers_failed", "transfers_timed_out")


class MessengerCollector(Collector):
    """The KV messenger's counters of one instance lead, from `stats()` at scrape time
    (`stats()` returns {} when the rank has no messenger: an aggregated instance)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], role: str) -> None:
        self.stats = stats
        self.role = role

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        if not s:
            return
        if self.role == "prefill":
            for key, (name, doc) in PREFILL_COUNTERS.items():
                if key in BY_PEER and "sent_to" in s:  # one series per NIC and decode peer
                    family = CounterMetricFamily(name, doc, labels=["nic", "peer"])
                    for peer, sent in sorted(s["sent_to"].items()):
                        family.add_metric([s["nic"], peer], sent[BY_PEER[key]])
                    yield family
                elif key in s:
                    yield CounterMetricFamily(name, doc, value=s[key])
            return
        # decode: the transfers per prefill instance (peer), stale writes and slots in all
        by_peer = s.get("by_prefill", {})
        for key, (name, doc) in DECODE_COUNTERS.items():
            if key in TALLIED:
                family = CounterMetricFamily(name, doc, labels=["peer"])
                for peer, tally in sorted(by_peer.items()):
                    family.add_metric([peer], tally[key])
                yield family
            elif key in s:
                yield CounterMetricFamily(name, doc, value=s[key])
        seconds = HistogramMetricFamily(*TRANSFER_SECONDS, labels=["peer"])
        for peer, tally in sorted(by_peer.items()):
            cumulative, total = [], 0
            for bound, n in zip((*map(str, TRANSFER_S_BOUNDS), "+Inf"),
                                tally["transfer_s_buckets"], strict=True):
                total += n
                cumulative.append((bound, total))
            seconds.add_metric([peer], cumulative, tally["transfer_s_sum"])
        yield seconds
        if "slots_total" in s:
            yield GaugeMetricFamily(*SLOTS_IN_USE, value=s["slots_total"] - s["slots_free"])


def messenger_metrics(stats: Callable[[], dict[str, Any]],
                      role: str) -> Callable[[], tuple[bytes, str]]:
    """An instance lead's `/metrics`: its messenger's counters in a registry of their own."""
    registry = CollectorRegistry()
    registry.register(MessengerCollector(stats, role))
    return lambda: (generate_latest(registry), CONTENT_TYPE_LATEST)

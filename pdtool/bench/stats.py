"""What a load run measured, as pure functions over the request records (no I/O, no clocks).

Definitions (the ones SGLang's and vLLM's serving benchmarks use, so figures compare):
* TTFT: request sent -> first chunk carrying a token, on the client.
* TPOT: per request, (end-to-end - TTFT) / (output tokens - 1); requests of one token have none.
* ITL: every gap between two consecutive token-carrying chunks, pooled over requests.
* E2E: request sent -> last chunk.
* Throughputs divide by the run's wall time: first send -> last end of each round the target
  ran, summed (a comparison interleaves targets round by round: the other targets' rounds are
  not this one's time).
* Goodput: requests per second that finished without error AND met every SLO given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass
class Record:
    """One request as the client saw it. Times are seconds on one monotonic clock."""

    start: float
    input_tokens: int
    stamps: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    tokens: list[int] = field(default_factory=list)  # tokens each of those chunks carried
    end: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.stamps) and self.end is not None

    @property
    def output_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.start if self.stamps else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.end is not None else None

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if not self.ok or n < 2:
            return None
        return (self.stamps[-1] - self.stamps[0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds."""
    out: dict[str, float | None] = {
        "mean": (1000 * sum(values_s) / len(values_s)) if values_s else None}
    for q in PERCENTILES:
        v = percentile(values_s, q)
        out[f"p{q}"] = None if v is None else 1000 * v
    return out


class SloError(ValueError):
    """A --slo value that does not parse; the text names the key and the expected form."""


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft_ms=200,tpot_ms=50` -> {"ttft_ms": 200.0, "tpot_ms": 50.0}."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in SLO_KEYS:
            raise SloError(f"--slo: expected KEY=MILLISECONDS with KEY one of "
                           f"{', '.join(SLO_KEYS)}, got {part.strip()!r}")
        try:
            ms = float(value)
        except ValueError:
            raise SloError(f"--slo {key}: expected milliseconds, got {value.strip()!r}") from None
        if not ms > 0:
            raise SloError(f"--slo {key}: expected a positive number of milliseconds, got {ms}")
        out[key] = ms
    return out


def meets(r: Record, slo: dict[str, float]) -> bool:
    """Finished without error and within every SLO (TPOT/ITL vacuous for one-token outputs)."""
    if not r.ok:
        return False
    checks = {"ttft_ms": [r.ttft], "e2e_ms": [r.e2e], "tpot_ms": [r.tpot], "itl_ms": r.itls}
    for key, limit in slo.items():
        if any(v is not None and 1000 * v > limit for v in checks[key]):
            return False
    return True


def busy_instance_seconds(intervals: Iterable[tuple[float, float]], instances: int) -> float:
    """Instance-seconds of work: the integral over time of min(open intervals, instances).

    A stage of `instances` instances with k requests in it keeps min(k, instances) of them busy
    (the router spreads requests over the least loaded): one request at a time keeps one
    instance busy, not all of them."""
    edges = sorted([(a, 1) for a, b in intervals] + [(b, -1) for a, b in intervals])
    total, open_, last = 0.0, 0, None
    for t, step in edges:
        if last is not None:
            total += min(open_, instances) * (t - last)
        open_ += step
        last = t
    return total


def wall_time(rounds: Sequence[Sequence[Record]]) -> float:
    """Seconds the target ran: per round, its first send to its last end, summed."""
    total = 0.0
    for records in rounds:
        if records:
            t0 = min(r.start for r in records)
            total += max((r.end for r in records if r.end is not None), default=t0) - t0
    return total


def summarize(rounds: Sequence[Sequence[Record]], slo: dict[str, float] | None = None) -> dict:
    """Every figure of one target at one load point (JSON-ready), from its `rounds` (one list
    of records per round it ran; a run without comparison is one round)."""
    slo = slo or {}
    records = [r for rnd in rounds for r in rnd]
    ok = [r for r in records if r.ok]
    wall = max(wall_time(rounds), 1e-9)
    itls = [x for r in ok for x in r.itls]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            why = r.error or "no tokens"
            errors[why] = errors.get(why, 0) + 1
    good = sum(meets(r, slo) for r in records)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": wall if records else 0.0,
        "input_tokens": sum(r.input_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / wall if records else 0.0,
        "input_throughput": sum(r.input_tokens for r in ok) / wall if records else 0.0,
        "output_throughput": sum(r.output_tokens for r in ok) / wall if records else 0.0,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution(itls),
        "e2e_ms": distribution([r.e2e for r in ok]),
        "slo": slo,
        "goodput": good / wall if records else 0.0,
        "good_requests": good,
    }


def per_gpu(summary: dict, gpus: int) -> dict:
    """`summary` with the rates a deployment is sized by: output tokens/s per GPU it occupies
    (`gpus`; worker slots on a CPU cluster) and one user's tokens/s (1 / mean TPOT)."""
    tpot = summary["tpot_ms"]["mean"]
    return {**summary, "gpus": gpus,
            "output_throughput_per_gpu": summary["output_throughput"] / gpus if gpus else None,
            "user_tokens_s": 1000 / tpot if tpot else None}


def ttft_added(records: Sequence[Record], baseline: Sequence[Record]) -> dict:
    """TTFT of `records` minus `baseline`'s, request by request: both ran the same prompts in
    the same order (a comparison), so each pair differs only by the deployment and the moment.
    The median of those differences is what one deployment adds over the other; it is steadier
    on a shared machine than the difference of the two medians. Milliseconds, and the median
    difference relative to the baseline's median TTFT; pairs where either failed are left out."""
    pairs = [(a.ttft, b.ttft) for a, b in zip(records, baseline, strict=False)
             if a.ok and b.ok]
    diffs = [a - b for a, b in pairs]
    base = percentile([b for _, b in pairs], 50)
    mid = percentile(diffs, 50)
    return {"pairs": len(pairs), **distribution(diffs),
            "baseline_ttft_p50_ms": None if base is None else 1000 * base,
            "relative_p50": None if mid is None or not base else mid / base}


@dataclass(frozen=True)
class Rates:
    """Per-instance rates measured while the stage had work, for the measured lengths."""

    prefill_tokens_s: float  # input tokens one prefill instance processed per busy second
    decode_tokens_s: float  # output tokens one decode instance generated per busy second
    mean_input: float
    mean_output: float


def stage_rates(records: Sequence[Record], prefill_instances: int,
                decode_instances: int) -> Rates | None:
    """Rates per instance from the client's view of each request's two stages.

    A request is in prefill from its send to its first token and in decode from there to its
    last token. A stage's busy time is `busy_instance_seconds` of those intervals, so queueing
    under load counts as busy time, as it should: a saturated stage's rate is then its
    capacity, and a lightly loaded one's the rate a single request sees. The first token is
    produced by the decoder's first step, so a little decode time is in the prefill figure
    (one step against a whole prompt)."""
    ok = [r for r in records if r.ok and r.output_tokens > 1]
    if not ok or prefill_instances < 1 or decode_instances < 1:
        return None
    pre = busy_instance_seconds([(r.start, r.stamps[0]) for r in ok], prefill_instances)
    dec = busy_instance_seconds([(r.stamps[0], r.stamps[-1]) for r in ok], decode_instances)
    if pre <= 0 or dec <= 0:
        return None
    inp = sum(r.input_tokens for r in ok)
    out = sum(r.output_tokens - 1 for r in ok)  # the first token is counted with prefill
    return Rates(inp / pre, out / dec,
                 inp / len(ok), out / len(ok))


@dataclass(frozen=True)
class RatioAdvice:
    decode_per_prefill: float  # decode instances that keep up with one prefill instance
    prefill_instances: int
    decode_instances: int  # for the configured prefill instances, at least 1
    override: str
    # lowest and highest decode_per_prefill over consecutive slices of the run (ratio_spread);
    # None: too few requests to say
    spread: tuple[float, float] | None = None


#: slices of a run the advice is recomputed on, and the usable requests each needs
SPREAD_SLICES, SPREAD_MIN_REQUESTS = 4, 8


def ratio_spread(records: Sequence[Record], prefill_instances: int,
                 decode_instances: int) -> tuple[float, float] | None:
    """How far the advice moves within one run: decode_per_prefill recomputed on each of
    SPREAD_SLICES consecutive slices of the requests (in send order), lowest and highest. A
    run of a few requests gives advice that flips from one run to the next; this says by how
    much before anyone sizes a cluster on it. None with fewer than SPREAD_MIN_REQUESTS usable
    requests per slice."""
    ok = sorted((r for r in records if r.ok and r.output_tokens > 1), key=lambda r: r.start)
    size = len(ok) // SPREAD_SLICES
    if size < SPREAD_MIN_REQUESTS:
        return None
    ratios = []
    for k in range(SPREAD_SLICES):
        rates = stage_rates(ok[k * size:(k + 1) * size], prefill_instances, decode_instances)
        if rates is None:
            return None
        ratios.append(ratio_advice(rates, prefill_instances).decode_per_prefill)
    return min(ratios), max(ratios)


def ratio_advice(rates: Rates, prefill_instances: int) -> RatioAdvice:
    """The prefill:decode instance ratio at which both stages sustain the same request rate.

    One prefill instance finishes prefill_tokens_s / mean_input requests per second; one decode
    instance decode_tokens_s / mean_output. Equal request rates need
    decode / prefill = (prefill_tokens_s * mean_output) / (decode_tokens_s * mean_input)."""
    per = (rates.prefill_tokens_s * rates.mean_output) / (
        rates.decode_tokens_s * max(rates.mean_input, 1e-9))
    n = max(1, round(per * prefill_instances))
    return RatioAdvice(per, prefill_instances, n, f"decode.instances={n}")

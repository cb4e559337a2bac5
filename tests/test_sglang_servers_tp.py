"""TP mismatch on real SGLang 0.5.23 servers, started by `pdtool launch +recipe=sglang-local-tp`:
a TP2 prefill into a TP1 decode (each decode page assembled from two prefill ranks' head halves,
shm, page 16) and a TP1 prefill into a TP2 decode (one prefill rank splits each page's heads
between two decode ranks, tcp;ofi_rxm, page 1, so page writes are grouped several to an
operation). Greedy tokens must equal transformers' `generate` (which the aggregated SGLang
deployment equals: test_sglang_servers.py), with concurrent requests and prefix-cache hits,
and no transfer may have failed: the router retries a failed request, so equal tokens alone
would hide one (a count mismatch did hide that way before `failures()` was checked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.sglang_servers import Served, metric_totals, plan_writes, transformers_tokens

pytestmark = pytest.mark.sglang_servers


@pytest.fixture(scope="module")
def want() -> dict[tuple[int, ...], list[int]]:
    return transformers_tokens()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    (),  # the recipe: prefill TP2 -> decode TP1 over shm, page 16
    ("prefill.tp=1", "decode.tp=2", "transfer=tcp", "prefill.page_size=1", "decode.page_size=1"),
], ids=["tp2-to-tp1-shm-page16", "tp1-to-tp2-tcp-page1"])
def test_tp_mismatch_is_token_exact(tmp_path: Path, want, overrides: tuple[str, ...]) -> None:
    served = Served(tmp_path, *overrides, "prefill.extra_args=[--enable-metrics]",
                    recipe="sglang-local-tp").start()
    try:
        # one write per page shard: a fresh prompt's page writes, summed over the prefill's
        # ranks on its /metrics, are what the plan says a request of its length writes
        prefill = served.server_urls()["prefill-0"]
        before = metric_totals(prefill).get("pdtool_kv_page_writes_total", 0)
        fresh = [(31 * i + 7) % 290 + 3 for i in range(48)]
        served.generate([277, *fresh[1:]], 2)
        written = metric_totals(prefill)["pdtool_kv_page_writes_total"] - before
        assert written == plan_writes("sglang-local-tp", 48, *overrides)
        prompts = [list(p) for p in want]
        # all at once, twice over: the second round hits the prefill's prefix cache
        got = served.generate_all(prompts * 2, concurrency=8)
        assert got == [want[tuple(p)] for p in prompts * 2]
        assert not served.failures(), served.failures()
        assert "per-layer KV streaming: a forward streamed" in served.logs()["prefill-0.n0"]
    finally:
        served.stop()

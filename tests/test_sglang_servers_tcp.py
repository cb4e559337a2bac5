"""pdtool's SGLang backend over tcp;ofi_rxm at page size 1 (one page per token), on real SGLang
servers started by `pdtool launch +recipe=sglang-local transfer=tcp`, token-exact against
transformers' greedy `generate` (which the aggregated SGLang deployment equals:
test_sglang_servers.py). Its own module, so that each deployment is stopped before the next
starts: three SGLang processes take about 4.7 GB and both cores of a CI box.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_checkpoints import greedy
from helpers.sglang_servers import MAX_NEW, PROMPTS, Served, tokenize

from pdtool.checkpoints import ensure

pytestmark = pytest.mark.sglang_servers


@pytest.mark.slow
def test_pd_over_tcp_at_page_size_1_is_token_exact(tmp_path: Path) -> None:
    folder = Path(ensure("builtin:tiny-llama"))
    prompts = [*PROMPTS, tokenize()]
    want = [greedy(folder, p, MAX_NEW) for p in prompts]
    served = Served(tmp_path, "transfer=tcp", "prefill.page_size=1", "decode.page_size=1",
                    "decode.instances=1").start()
    try:
        assert served.generate_all(prompts, concurrency=4) == want
        assert not served.failures()
        assert "per-layer KV streaming" in served.logs()["prefill-0.n0"]
    finally:
        served.stop()

"""SGLang's own transfer backends on the same real servers: `+recipe=sglang-local
transfer.backend=mooncake` (the non-CUDA wheel over TCP) and `transfer.backend=nixl` (UCX),
with pdtool's `pdtool-cpu` plugin making them run on SGLang's CPU engine
(`pdtool/engines/sglang/cpu_plugin.py`), and mooncake across a TP mismatch too (`+recipe=
sglang-local-tp`: prefill TP2 into decode TP1, as test_sglang_servers_tp.py runs pdtool's
backend). The same prompts give the same greedy tokens as transformers' `generate` (and so as
pdtool's backend: test_sglang_servers.py), concurrently and with prefix-cache hits, and no
transfer failed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.sglang_servers import Served, transformers_tokens

pytestmark = pytest.mark.sglang_servers


@pytest.fixture(scope="module")
def want() -> dict[tuple[int, ...], list[int]]:
    return transformers_tokens()


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "recipe"), [
    ("mooncake", "sglang-local"), ("nixl", "sglang-local"), ("mooncake", "sglang-local-tp"),
], ids=["mooncake", "nixl", "mooncake-tp2-to-tp1"])
def test_sglang_backend_gives_the_same_tokens(tmp_path: Path, want, backend: str,
                                              recipe: str) -> None:
    served = Served(tmp_path, f"transfer.backend={backend}", "decode.instances=1",
                    recipe=recipe).start()
    try:
        prompts = [list(p) for p in want]
        got = served.generate_all(prompts * 2, concurrency=8)
        assert got == [want[tuple(p)] for p in prompts * 2]
        assert not served.failures(), served.failures()
        if backend == "mooncake":  # the plugin's one change, as the prefill logged it
            assert "pdtool-cpu: MooncakeKVSender sends host page ids" in \
                served.logs()["prefill-0.n0"]
    finally:
        served.stop()

"""MLA on real SGLang 0.5.23 servers, started by `pdtool launch +recipe=sglang-local-mla`: a tiny
DeepSeek-V2 checkpoint (one latent cache "head", replicated on every TP rank), pdtool's backend
over shm. Greedy tokens must equal transformers' `generate` at TP1 -> TP1, TP2 -> TP1 (the
recipe: either prefill rank may send the latent) and TP1 -> TP2 (one prefill rank feeds both
decode ranks the same latent), with concurrent requests and prefix-cache hits, and no transfer
may have failed. The CPU engine serves MLA through the `pdtool-cpu` plugin's torch_native
routing (pdtool/engines/sglang/cpu_plugin.py): without it the servers failed their first
prefill (a shape error in torch_native's extend).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.sglang_servers import Served, transformers_tokens

pytestmark = pytest.mark.sglang_servers

EOS = 2  # the builtin tokenizer's end of sequence: transformers' generate stops there


@pytest.fixture(scope="module")
def want() -> dict[tuple[int, ...], list[int]]:
    return transformers_tokens("builtin:tiny-deepseek-v2")


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS)] if EOS in tokens else tokens


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("prefill.tp=1",),
    (),  # the recipe: prefill TP2 -> decode TP1
    ("prefill.tp=1", "decode.tp=2"),
], ids=["tp1-to-tp1", "tp2-to-tp1", "tp1-to-tp2"])
def test_mla_is_token_exact(tmp_path: Path, want, overrides: tuple[str, ...]) -> None:
    served = Served(tmp_path, *overrides, recipe="sglang-local-mla").start()
    try:
        prompts = [list(p) for p in want]
        got = served.generate_all(prompts * 2, concurrency=8)
        assert [_until_eos(g) for g in got] == [want[tuple(p)] for p in prompts * 2]
        assert not served.failures(), served.failures()
    finally:
        served.stop()

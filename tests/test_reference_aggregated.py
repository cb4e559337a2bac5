"""`mode=aggregated`: the same engine as ordinary instances behind the same front, started the
user's way (`pdtool launch +recipe=tiny-local mode=aggregated`).

Every instance (the prefill one too) takes whole requests: it prefills the prompt in chunks
batched with its running requests' decode steps, no KV pages cross processes. The outputs are
the disaggregated ones (the single-process oracle's), token for token.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.reference_served import Served, sample_prompts

from pdtool.engines.reference.local import get_json


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    s = Served("tiny-local", tmp_path_factory.mktemp("aggregated"), ["mode=aggregated"])
    yield s
    s.stop()


@pytest.mark.slow
def test_aggregated_instances_serve_the_oracles_tokens(aggregated):
    s = aggregated
    prompts = [*sample_prompts(24, seed=5, lo=1, hi=140), "x"]
    rng = random.Random(2)
    max_tokens = [rng.randint(1, 10) for _ in prompts]
    with ThreadPoolExecutor(12) as pool:
        bodies = list(pool.map(s.complete, prompts, max_tokens))
    for p, m, b in zip(prompts, max_tokens, bodies, strict=True):
        assert b["pdtool"]["token_ids"] == s.oracle(p, m), p
    # three ordinary instances (the recipe's prefill and two decode ones), all used
    assert {b["pdtool"]["decode_instance"] for b in bodies} == {0, 1, 2}
    stats = s.wait_idle()
    assert [st["role"] for st in stats] == ["aggregated"] * 3
    assert all(st["pages_free"] == st["pages_total"] for st in stats)
    assert max(st["max_batch"] for st in stats) > 1  # prefill chunks batched with decodes
    # each instance ran its own prompts: every prompt token but the last, plus one per request
    assert sum(st["prompt_tokens_seen"] for st in stats) == sum(len(p.encode()) for p in prompts)
    code, health = get_json(f"{s.url}/health")
    assert code == 200 and health["decode_instances"] == 3

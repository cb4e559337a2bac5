"""`transfer.layout` reaches the reference engine: NHD pages (`[pages, page_size, heads,
kv_parts, head_dim]`) in both caches, written by the messenger with NHD's write count.

A partial head run is one write per token in NHD (geometry.writes_per_page), so with prefill TP2
-> decode TP1 every page costs page_size writes per source rank where HND (FlashInfer's
`[pages, 2, heads, page_size, head_dim]`) costs two, its K run and its V run: the count
the decoder waited for equals the route math's NHD count, not the HND one, and the tokens
equal the oracle's (the decoder attends over exactly what arrived: test_reference_serve's
fault test).
"""

from __future__ import annotations

import pytest
from helpers.hf_checkpoints import deployment

from pdtool.engines.reference.local import get_json
from pdtool.engines.reference.model import TinyConfig, TinyModel
from pdtool.engines.reference.oracle import encode, generate
from transfer.geometry import expected_writes
from transfer.routes import ShardSpec, pages_for, routes_for

PROMPTS = ["NHD pages interleave heads inside every token of the page.", "ab", "x" * 70]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "prefill_tp"), [("NHD", 2), ("NHD", 1), ("HND", 2)])
def test_layout_reaches_the_caches_and_the_write_count(tmp_path, layout, prefill_tp):
    cfg = TinyConfig()
    oracle = TinyModel(cfg)
    dep, url, leaders = deployment(None, tmp_path / "dep", prefill_tp, 1, layout=layout)
    try:
        stats = get_json(f"{leaders[1]}/stats")[1]
        assert stats["kv_layout"] == layout
        heads, page = cfg.num_kv_heads, 4
        assert stats["kv_shape"] == ([1024, 2, heads, page, cfg.head_dim] if layout == "HND"
                                     else [1024, page, heads, 2, cfg.head_dim])
        per_op = stats["kv_writes_per_op"]
        src, dst = ShardSpec(heads, prefill_tp), ShardSpec(heads, 1)
        for text in PROMPTS:
            code, body = get_json(f"{url}/v1/completions", {"prompt": text, "max_tokens": 6})
            assert code == 200, body
            assert body["pdtool"]["token_ids"] == generate(cfg, encode(text), 6, oracle)
            n = pages_for(len(encode(text)), page)
            counts = {lay: expected_writes(routes_for(src, dst, 0), src, dst, layout=lay,
                                           page_size=page, num_pages=n,
                                           num_layers=cfg.num_layers, aux_writes=1,
                                           writes_per_op=per_op)
                      for lay in ("HND", "NHD")}
            assert body["pdtool"]["kv_writes"] == counts[layout], (text, counts)
            if prefill_tp == 2 and n * page > per_op:  # partial head runs: per token in NHD
                assert counts["NHD"] > counts["HND"]
    finally:
        dep.stop()

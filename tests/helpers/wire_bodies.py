"""Well-formed bodies of the messenger's control messages, for tests that break them one field
at a time (the schema checks, the fuzzers, the randomized fault test)."""

from __future__ import annotations


def request_body(**over: object) -> dict:
    """A well-formed messenger REQUEST body, `over` replacing fields."""
    body = {
        "rid": "r1", "token_ids": b"\x01\x00\x00\x00" * 3, "num_tokens": 3,
        "dst_pages": b"\x00\x00\x00\x00", "slot": 1, "gen": 2, "aux_row": 1,
        "slices": [{"src_rank": 0, "head_lo": 0, "num_heads": 2, "src_head_off": 0,
                    "dst_head_off": 0}],
        "aux_rank": 0, "expected": [2, 0], "timeout_s": 5.0,
    }
    body.update(over)
    return body


def hello_body(**over: object) -> dict:
    """A well-formed decode HELLO body, `over` replacing fields."""
    body = {
        "role": "decode", "compat": b"c" * 16, "provider": "tcp;ofi_rxm", "rank": 0,
        "num_parts": 1, "spec": {"num_kv_heads": 8, "tp": 2, "dp": 1},
        "peer_spec": {"num_kv_heads": 8, "tp": 4, "dp": 1},
        "layout": {"kind": "HND", "num_pages": 8, "heads_local": 4, "kv_parts": 2,
                   "page_size": 16, "head_dim": 64, "itemsize": 2},
        "num_layers": 2, "buffers_per_layer": 1, "aux_row_bytes": [],
        "fabric_name": b"name", "regions": [{"base": 1, "key": 2, "length": 3}] * 2,
        "aux_regions": [], "lanes": [], "writes_per_op": 4, "error": "",
    }
    body.update(over)
    return body

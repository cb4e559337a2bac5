"""The KV messenger's control protocol (transfer.messenger): its messages and HELLO facts.

Only small messages travel here; KV bytes never do. Per decode rank and prefill rank, the
decode rank opens with HELLO (its static data: sharding, page layout, layers, registered
regions, receive lanes, writes per operation) and the prefill rank answers with its own HELLO
(and `error` when it cannot serve that decode rank, naming the field). Only then does the
decode rank send REQUESTs (to the prefill lead), PINGs and ABORTs, each bound to the prefill
rank's session; a REQUEST carries only what differs per request. See PROTOCOL.md.
"""

from __future__ import annotations

from typing import Any

from .envelope import Protocol
from .fields import (
    Check,
    bytes_field,
    float_field,
    int_field,
    list_field,
    map_field,
    str_field,
)
from .handshake import COMPAT_BYTES

_U16 = int_field(0, 0xFFFF)
_POS = int_field(1, 1 << 31)
_NAT = int_field(0, 1 << 31)
_RID = str_field(256, min_len=1)
_REASON = str_field(1024)
_NAME = bytes_field(1024, min_len=1)
_REGION = map_field({"base": int_field(), "key": int_field(), "length": int_field()})
_AUX_REGION = map_field({"base": int_field(), "key": int_field(), "length": int_field(),
                         "row_bytes": _POS})
_SPEC = map_field({"num_kv_heads": int_field(1, 1 << 16), "tp": int_field(1, 1 << 16),
                   "dp": int_field(1, 1 << 16)})
_LAYOUT = map_field({"kind": str_field(8, ("HND", "NHD")), "num_pages": _POS,
                     "heads_local": _POS, "kv_parts": int_field(1, 2), "page_size": _POS,
                     "head_dim": _POS, "itemsize": int_field(1, 16)})
_SLICE = map_field({"src_rank": _NAT, "head_lo": _NAT, "num_heads": _POS, "src_head_off": _NAT,
                    "dst_head_off": _NAT})

# the static fields of a decode rank: sent once in its HELLO, merged into each of its
# REQUEST parts by the prefill lead (so `PrefillRequest.parts` hold everything, as before)
HELLO_STATIC = ("rank", "num_parts", "layout", "num_layers", "buffers_per_layer",
                "fabric_name", "regions", "lanes", "aux_regions", "writes_per_op")

SCHEMAS: dict[str, Check] = {
    # both ways, once per (decode rank, prefill rank): decode opens, prefill answers (bound);
    # `spec` is the sender's sharding, `peer_spec` the one it expects of the receiver
    "HELLO": map_field({
        "role": str_field(8, ("decode", "prefill")),
        "compat": bytes_field(COMPAT_BYTES, min_len=COMPAT_BYTES),
        "provider": str_field(64),
        "rank": _NAT, "num_parts": _POS,
        "spec": _SPEC, "peer_spec": _SPEC,
        "layout": _LAYOUT, "num_layers": _POS, "buffers_per_layer": int_field(1, 8),
        "aux_row_bytes": list_field(_POS, 64),
        # decode: its receive endpoint and registered KV buffers (prefill sends b"" and [])
        "fabric_name": bytes_field(1024),
        "regions": list_field(_REGION, 8192),
        "aux_regions": list_field(_AUX_REGION, 64),
        # extra receive lanes of this decode rank (the same KV buffers registered on each;
        # KV writes may go to any of them, aux copies go to `fabric_name`)
        "lanes": list_field(map_field({"fabric_name": _NAME,
                                       "regions": list_field(_REGION, 8192)}), 7),
        # decode: page writes grouped into one operation; prefill: the most its provider takes
        "writes_per_op": int_field(1, 64),
        "error": _REASON,  # prefill: why it cannot serve this decode rank ('' = it can)
        # shm: decode: the path of its kick word (transfer.kick, '' = none); prefill: 1 when
        # it mapped that word and kicks it after posting writes
        "kick": str_field(64), "kicks": int_field(0, 1),
    }, optional_keys=frozenset({"kick", "kicks"})),
    # decode rank -> prefill lead: this decode rank's part of a request (messenger.decode)
    "REQUEST": map_field({
        "rid": _RID,
        "token_ids": bytes_field(4 << 20, 4),      # uint32 LE; only decode rank 0's part has them
        "num_tokens": _NAT,
        "dst_pages": bytes_field(4 << 20, 4),      # uint32 LE, page ids in the decoder's buffers
        "slot": _U16, "gen": _U16,
        "aux_row": _NAT,
        "slices": list_field(_SLICE, 4096),        # what each prefill rank sends this rank
        "aux_rank": _NAT,                          # the prefill rank that sends the aux rows
        "expected": list_field(_NAT, 1 << 16),     # operations each prefill rank issues to it
        "timeout_s": float_field(0.001, 86400.0),
    }),
    # decode -> prefill: stop writing for this transfer and confirm with ABORTED
    "ABORT": map_field({"rid": _RID, "slot": _U16, "gen": _U16, "reason": _REASON}),
    # prefill -> decode: no further writes will be issued; `issued` writes were submitted to
    # this decode rank for this transfer and all completed locally (`errored` with an error)
    "ABORTED": map_field({"rid": _RID, "slot": _U16, "gen": _U16, "reason": _REASON,
                          "issued": _NAT, "errored": _NAT}),
    # liveness lease: decode pings each prefill peer, prefill answers (see messenger docs);
    # the lead lists the pinging rank's transfers still queued for a bind (their timeout
    # has not started)
    "PING": map_field({}),
    "PONG": map_field({"queued": list_field(map_field({"slot": _U16, "gen": _U16}),
                                            1 << 16)}, optional_keys=frozenset({"queued"})),
}

MESSENGER = Protocol("messenger", SCHEMAS)


def facts(*, prefill: Any, decode: Any, layout: dict[str, Any], num_layers: int,
          buffers_per_layer: int, provider: str, aux_row_bytes: list[int]) -> dict[str, Any]:
    """The deployment facts both sides must share (hashed into HELLO.compat). `prefill` and
    `decode` are the two roles' ShardSpec-like {num_kv_heads, tp, dp} maps."""
    return {"kv_heads": prefill["num_kv_heads"], "prefill_tp": prefill["tp"],
            "prefill_dp": prefill["dp"], "decode_kv_heads": decode["num_kv_heads"],
            "decode_tp": decode["tp"], "decode_dp": decode["dp"],
            **{f"layout.{k}": layout[k] for k in ("kind", "page_size", "head_dim",
                                                   "kv_parts", "itemsize")},
            "num_layers": num_layers, "buffers_per_layer": buffers_per_layer,
            "provider": provider, "aux_row_bytes": list(aux_row_bytes)}


def hello_facts(h: dict[str, Any]) -> dict[str, Any]:
    """The facts a checked HELLO states, seen from its sender's role."""
    prefill, decode = (h["peer_spec"], h["spec"]) if h["role"] == "decode" else \
        (h["spec"], h["peer_spec"])
    return facts(prefill=prefill, decode=decode, layout=h["layout"], num_layers=h["num_layers"],
                 buffers_per_layer=h["buffers_per_layer"], provider=h["provider"],
                 aux_row_bytes=h["aux_row_bytes"])

"""The SGLang backend's control frames (transfer/sglang/conn.py), in the one envelope.

SGLang's own sockets carry them: a decode rank PUSHes to each prefill rank's bootstrap port,
so the frames travel one way. On the wire a frame is `[TAG, payload, mac]` — the tag lets the
prefill's control loop tell pdtool frames from SGLang's ABORT notifications on the same socket
— and `Frames` seals and opens them (the envelope's `[payload, mac]` behind the tag).

  * HELLO (was REG; decode rank -> each prefill rank, once): the decode rank's static data —
    its endpoint, provider, TP layout, pool geometry, registered KV and aux regions, and
    (`rails`, since version 3) each further endpoint it opened on another NIC with its keys
    for the same memory — and the compatibility hash of the facts both sides must share
    (`facts`).
  * PEER (prefill rank -> decode rank, answering HELLO, bound to the decode rank's session):
    the total KV heads and writes per operation the decode rank's counts need (and how a
    draft model's KV buffers are sharded between the pair), or the reason it cannot be served.
  * META (decode rank -> prefill rank, per request): the room, the decoder's page ids, the
    aux row, the transfer slot and generation, SGLang's destination count and prefix length,
    and, for a request that lands in staging, the landing region and its blocks (and,
    `landing_rails` since version 4, that region's keys on each further endpoint).

Binding: the sockets are one way and SGLang 0.5.23's bootstrap registry keeps only each
prefill rank's address (`PrefillRankInfo`), so a decode rank may not know the prefill rank's
session: META, like HELLO, may go unbound. Unbound frames are still signed, versioned and
refused when replayed within the prefill's run (per-session sequence windows); what binding
adds — refusing a frame captured before the prefill restarted — needs the prefill's
`Frames.session` to reach the decode rank (its bootstrap registration, or a HELLO of the
prefill's own pushed back to the decode rank's port); once it does, pass it as `to`, and a
frame bound to any other session is refused.
"""

from __future__ import annotations

from typing import Any

from .envelope import Envelope, Message, Protocol
from .fields import (
    Check,
    WireError,
    bool_field,
    bytes_field,
    int_field,
    list_field,
    map_field,
    optional,
    str_field,
)
from .handshake import COMPAT_BYTES

TAG = b"PDTOOL"
_NAT = int_field(0, 1 << 31)
_POS = int_field(1, 1 << 31)
_REGION = map_field({"base": int_field(), "key": int_field(), "length": int_field()})
_PEER = str_field(300, min_len=1)

SCHEMAS: dict[str, Check] = {
    "HELLO": map_field({
        "compat": bytes_field(COMPAT_BYTES, min_len=COMPAT_BYTES),
        "peer": _PEER, "ip": str_field(256, min_len=1), "port": int_field(1, 65535),
        "fabric_name": bytes_field(1024, min_len=1), "provider": str_field(64),
        "tp_size": _POS, "tp_rank": _NAT, "gpu": _NAT, "iov_limit": _POS,
        "is_mla": bool_field(), "page_size": _POS,
        # how many of the KV buffers (the last ones) are a draft model's (num_draft_entries)
        "num_draft": _NAT,
        "kv": list_field(_REGION, 1 << 14), "kv_data_lens": list_field(int_field(), 1 << 14),
        "kv_item_lens": list_field(int_field(), 1 << 14),
        "aux": list_field(_REGION, 64), "aux_item_lens": list_field(int_field(), 64),
        # the decode rank's further endpoints, one per NIC: the same memory, its own keys
        "rails": list_field(map_field({
            "fabric_name": bytes_field(1024, min_len=1),
            "kv": list_field(_REGION, 1 << 14), "aux": list_field(_REGION, 64)}), 64),
    }, optional_keys=frozenset({"num_draft"})),  # absent: 0
    # prefill rank -> decode rank, answering its HELLO (bound to its session): the KV heads
    # and writes per operation its counts need, or why it cannot be served; `draft`: how the
    # draft model's buffers are sent (transfer.geometry.KVGroup), nil without them
    "PEER": map_field({"peer": _PEER, "total_kv_heads": _POS, "writes_per_op": _POS,
                       "error": optional(str_field(2048)),
                       "draft": optional(map_field({"count": _POS, "heads": _POS,
                                                    "whole": bool_field()}))}),
    # the landing fields come only with a request that lands in the decode rank's staging
    # area (transfer/sglang/staging_plane.py): its registered region, block and unit sizes,
    # and the int32 ids of the blocks granted to this request
    "META": map_field({
        "peer": _PEER, "room": int_field(0, (1 << 64) - 1),
        "kv_indices": bytes_field(64 << 20, 4),    # int32 page ids, native order
        "aux_index": optional(_NAT), "slot": int_field(0, 0xFFFF), "gen": int_field(0, 0xFFFF),
        "required_dst_info_num": _POS, "is_dummy": bool_field(), "decode_prefix_len": _NAT,
        "landing": _REGION, "landing_block": _POS, "landing_unit": _POS,
        "landing_blocks": bytes_field(64 << 20, 4),
        # the landing area on the decode rank's further endpoints (HELLO `rails` order)
        "landing_rails": list_field(_REGION, 64),
    }, optional_keys=frozenset({"landing", "landing_block", "landing_unit", "landing_blocks",
                                "landing_rails"})),
}

SGLANG = Protocol("sglang", SCHEMAS, unbound=frozenset({"HELLO", "META"}))


def facts(*, provider: str, is_mla: bool, page_size: int, num_kv_buffers: int,
          aux_item_lens: list[int], num_draft: int = 0) -> dict[str, Any]:
    """What prefill and decode must agree on (HELLO.compat). KV heads are not among them:
    SGLang's decode does not know them (the prefill checks the decode's share from its item
    lengths and answers the total in PEER)."""
    return {"provider": provider, "is_mla": is_mla, "page_size": page_size,
            "num_kv_buffers": num_kv_buffers, "aux_item_lens": list(aux_item_lens),
            **({"num_draft": num_draft} if num_draft else {})}


class Frames:
    """The pair SGLang's sockets use: `encode(kind, body, to)` -> `[TAG, payload, mac]` and
    `decode(msg)` -> the verified `Message`; WireError (a ValueError) names what was
    refused. One per manager (its session); construction refuses a missing secret."""

    def __init__(self, secret: bytes, sender: str) -> None:
        self.envelope = Envelope(secret, sender, SGLANG)

    @property
    def session(self) -> bytes:
        return self.envelope.session

    def encode(self, kind: str, body: dict[str, Any], to: bytes = b"") -> list[bytes]:
        return [TAG, *self.envelope.seal(kind, body, to)]

    def decode(self, msg: list[bytes]) -> Message:
        if len(msg) != 3 or msg[0] != TAG:
            raise WireError(f"not a pdtool control frame ({len(msg)} parts)")
        return self.envelope.open(msg[1:])

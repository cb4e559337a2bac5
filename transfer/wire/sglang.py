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

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from transfer.fabric.values import RemoteRegion
from transfer.geometry import KVGroup

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


def _regions(items: list[dict[str, int]]) -> tuple[RemoteRegion, ...]:
    return tuple(RemoteRegion.from_dict(d) for d in items)


def _dicts(regions: tuple[RemoteRegion, ...]) -> list[dict[str, int]]:
    return [r.to_dict() for r in regions]


# --- the frames as typed records: decoded once, after the schema checked the body ---------


@dataclass(frozen=True)
class RailKeys:
    """One further endpoint (NIC) of a decode rank: its name and its keys for the same
    memory as the first endpoint's regions."""

    fabric_name: bytes
    kv: tuple[RemoteRegion, ...]
    aux: tuple[RemoteRegion, ...]


@dataclass(frozen=True)
class Hello:
    """HELLO: a decode rank's static data, sent once to each prefill rank."""

    KIND: ClassVar[str] = "HELLO"
    compat: bytes
    peer: str
    ip: str
    port: int
    fabric_name: bytes
    provider: str
    tp_size: int
    tp_rank: int
    gpu: int
    iov_limit: int
    is_mla: bool
    page_size: int
    num_draft: int
    kv: tuple[RemoteRegion, ...]
    kv_data_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    aux: tuple[RemoteRegion, ...]
    aux_item_lens: tuple[int, ...]
    rails: tuple[RailKeys, ...] = ()

    def body(self) -> dict[str, Any]:
        plain = ("compat", "peer", "ip", "port", "fabric_name", "provider", "tp_size",
                 "tp_rank", "gpu", "iov_limit", "is_mla", "page_size", "num_draft")
        return {**{k: getattr(self, k) for k in plain},
                "kv": _dicts(self.kv), "kv_data_lens": list(self.kv_data_lens),
                "kv_item_lens": list(self.kv_item_lens), "aux": _dicts(self.aux),
                "aux_item_lens": list(self.aux_item_lens),
                "rails": [{"fabric_name": r.fabric_name, "kv": _dicts(r.kv),
                           "aux": _dicts(r.aux)} for r in self.rails]}

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> Hello:
        return cls(
            compat=b["compat"], peer=b["peer"], ip=b["ip"], port=b["port"],
            fabric_name=b["fabric_name"], provider=b["provider"], tp_size=b["tp_size"],
            tp_rank=b["tp_rank"], gpu=b["gpu"], iov_limit=b["iov_limit"], is_mla=b["is_mla"],
            page_size=b["page_size"], num_draft=b.get("num_draft", 0), kv=_regions(b["kv"]),
            kv_data_lens=tuple(b["kv_data_lens"]), kv_item_lens=tuple(b["kv_item_lens"]),
            aux=_regions(b["aux"]), aux_item_lens=tuple(b["aux_item_lens"]),
            rails=tuple(RailKeys(r["fabric_name"], _regions(r["kv"]), _regions(r["aux"]))
                        for r in b["rails"]))


@dataclass(frozen=True)
class PeerAnswer:
    """PEER: a prefill rank's answer to a HELLO — the KV heads and writes per operation the
    decode rank's counts need, how the pair shards a draft model's KV (None: no draft), or
    why that decode rank cannot be served (`error`)."""

    KIND: ClassVar[str] = "PEER"
    peer: str
    total_kv_heads: int
    writes_per_op: int
    error: str | None = None
    draft: KVGroup | None = None

    def body(self) -> dict[str, Any]:
        d = self.draft
        return {"peer": self.peer, "total_kv_heads": self.total_kv_heads,
                "writes_per_op": self.writes_per_op, "error": self.error or None,
                "draft": None if d is None else {"count": d.count, "heads": d.heads,
                                                 "whole": d.whole}}

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> PeerAnswer:
        d = b["draft"]
        return cls(b["peer"], b["total_kv_heads"], b["writes_per_op"], b["error"] or None,
                   None if d is None else KVGroup("draft", d["count"], d["heads"], d["whole"]))


@dataclass(frozen=True)
class LandingArea:
    """Where a request that lands in the decode rank's staging area goes: the registered
    region (and its keys on each further endpoint, HELLO `rails` order), the block and unit
    sizes, and the ids of the blocks granted to this request."""

    region: RemoteRegion
    block: int
    unit: int
    blocks: npt.NDArray[np.int32]
    rails: tuple[RemoteRegion, ...] = ()


@dataclass(frozen=True)
class Meta:
    """META: one decode destination of one request."""

    KIND: ClassVar[str] = "META"
    peer: str
    room: int
    kv_indices: npt.NDArray[np.int32]  # the decoder's page ids
    aux_index: int | None
    slot: int
    gen: int
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int
    landing: LandingArea | None = None  # None: the pages are written in place

    def body(self) -> dict[str, Any]:
        out = {"peer": self.peer, "room": self.room,
               "kv_indices": b"" if self.is_dummy else
               np.asarray(self.kv_indices, np.int32).tobytes(),
               "aux_index": self.aux_index, "slot": self.slot, "gen": self.gen,
               "required_dst_info_num": self.required_dst_info_num, "is_dummy": self.is_dummy,
               "decode_prefix_len": self.decode_prefix_len}
        la = self.landing
        if la is not None:
            out.update(landing=la.region.to_dict(), landing_rails=_dicts(la.rails),
                       landing_block=la.block, landing_unit=la.unit,
                       landing_blocks=np.asarray(la.blocks, np.int32).tobytes())
        return out

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> Meta:
        landing = None
        if b.get("landing") is not None:
            landing = LandingArea(RemoteRegion.from_dict(b["landing"]), b["landing_block"],
                                  b["landing_unit"],
                                  np.frombuffer(b["landing_blocks"], dtype=np.int32),
                                  _regions(b.get("landing_rails", [])))
        return cls(b["peer"], b["room"], np.frombuffer(b["kv_indices"], dtype=np.int32),
                   b["aux_index"], b["slot"], b["gen"], b["required_dst_info_num"],
                   b["is_dummy"], b["decode_prefix_len"], landing)


Record = Hello | PeerAnswer | Meta
RECORDS: dict[str, type[Hello] | type[PeerAnswer] | type[Meta]] = {
    r.KIND: r for r in (Hello, PeerAnswer, Meta)}


class Frames:
    """The pair SGLang's sockets use: `encode(kind, body, to)` -> `[TAG, payload, mac]` and
    `decode(msg)` -> the verified `Message`; WireError (a ValueError) names what was
    refused. `send(record)` / `receive(msg)` do the same with the typed records. One per
    manager (its session); construction refuses a missing secret."""

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

    def send(self, record: Record, to: bytes = b"") -> list[bytes]:
        return self.encode(record.KIND, record.body(), to)

    def receive(self, msg: list[bytes]) -> tuple[Record, bytes]:
        """The verified frame as its record, and its sender's session (a HELLO's answer is
        bound to it)."""
        got = self.decode(msg)
        return RECORDS[got.type].from_body(got.body), got.session

"""The prefill lead's control checks (a part of `prefill.PrefillMessenger`).

`PrefillControl` is a mixin of the messenger's thread class: it checks each decode rank's
HELLO once against this rank (`_check_hello`: a refusal names the field and goes back in our
HELLO's `error`), checks each REQUEST part's per-request fields (`_check_part`: pages, token
ids, aux row, routes, expected counts), assembles a request once every decode rank's part
arrived into the `PrefillRequest` the engine broadcasts, and answers ABORTs. It reads and
writes the messenger thread's state set up in `PrefillMessenger._setup`; the engine never
calls it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..geometry import slice_ops
from ..kick import PeerKick
from ..layout import KVLayout
from ..routes import (
    RouteError,
    ShardSpec,
    Slice,
    pages_for,
    routes_for,
)
from ..wire.handshake import first_difference
from ..wire.messenger import HELLO_STATIC, hello_facts
from .common import WIRE_U32

log = logging.getLogger("transfer.messenger.prefill")


@dataclass(frozen=True)
class PrefillRequest:
    """A request every decode rank's part has arrived for. Picklable: the engine broadcasts it
    to its TP ranks unchanged. `parts[d]` is decode rank d's validated REQUEST body."""

    rid: str
    token_ids: np.ndarray
    num_tokens: int
    num_pages: int
    parts: tuple[dict[str, Any], ...]
    timeout_s: float


@dataclass
class _Assembly:
    parts: dict[int, tuple[bytes, dict[str, Any]]] = field(default_factory=dict)
    first: float = 0.0
    timeout_s: float = 0.0

class _Chosen(random.Random):
    """Replays the source ranks a decoder chose, so its slices can be checked with routes."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(0)
        self._ranks = list(ranks)

    def choice(self, seq: Sequence[Any]) -> Any:
        if not self._ranks:
            raise RouteError("fewer slices than head runs")
        r = self._ranks.pop(0)
        if r not in seq:
            raise RouteError(f"rank {r} does not hold those heads (candidates {list(seq)})")
        return r

def _check_fabric_name(name: bytes, own: bytes, field: str = "fabric_name") -> None:
    """A peer address must look like this provider's (same length; for socket addresses the
    same family; for shm the same scheme): the provider reads a fixed-size address and a failed
    insert can leave its address vector unusable, so nonsense never reaches fi_av_insert."""
    if own.startswith(b"fi_shm://"):
        ok = name.startswith(b"fi_shm://") and name.endswith(b"\0") and len(name) <= 256
    else:
        ok = len(name) == len(own) and (len(own) not in (16, 28) or name[:2] == own[:2])
    if not ok:
        raise ValueError(f"{field}: {name[:32]!r} is not an address of this provider "
                         f"(like {own[:32]!r})")

def _slices(b: dict[str, Any]) -> list[Slice]:
    return [Slice(src_rank=s["src_rank"], dst_rank=b["dst_rank"], head_lo=s["head_lo"],
                  num_heads=s["num_heads"], src_head_off=s["src_head_off"],
                  dst_head_off=s["dst_head_off"]) for s in b["slices"]]


class PrefillControl:
    """The control half of the prefill messenger's thread (see the module docstring)."""

    def _reply_aborted(self, peer: bytes, body: dict[str, Any], reason: str,
                       issued: int = 0, errored: int = 0) -> None:
        self._chan.send("ABORTED", {"rid": body["rid"], "slot": body["slot"],
                                    "gen": body["gen"], "reason": reason[:1024],
                                    "issued": issued, "errored": errored}, peer=peer)

    def _queued_for(self, peer: bytes) -> list[dict[str, int]]:
        """The transfers of decode rank `peer` that wait, whole, to be bound: handed to the
        engine (its queue) or about to be (lead only; other ranks hold none). None while the
        engine has not asked for requests for `peer_timeout_s`: it is not serving its queue
        (stuck), so the decoders' timeouts run again."""
        with self._lock:
            if time.monotonic() - self._engine_seen > self.config.peer_timeout_s:
                return []
            parts = [q for qs in self._handed.values() for q in qs]
            parts += [(p["sender"], p["slot"], p["gen"]) for r in self._ready_q for p in r.parts]
        return [{"slot": slot, "gen": gen} for sender, slot, gen in parts if sender == peer]

    def _on_hello(self, peer: bytes, msg: Any) -> None:
        """Check a decode rank's static data once; answer with our HELLO, bound to it."""
        h = msg.body
        try:
            self._check_hello(h)
        except Exception as exc:  # any refusal (Layout/Route/ValueError) names the field
            error = str(exc)[:1024] or type(exc).__name__
            log.warning("prefill rank %d refused the HELLO of %r: %s", self.config.rank, peer,
                        error)
            self._peer_hello[peer] = error
        else:
            if peer not in self._peer_hello:
                log.info("prefill rank %d: decode rank %d (%r) is compatible", self.config.rank,
                         h["rank"], peer)
            self._peer_hello[peer] = {k: h[k] for k in HELLO_STATIC}
            error = ""
        kicks = int(not error and self._map_kick(peer, h.get("kick", "")))
        self._chan.send("HELLO", {**self._hello, "error": error, "kicks": kicks}, peer=peer,
                        session=msg.session)

    def _map_kick(self, peer: bytes, path: str) -> bool:
        """shm: map decode rank `peer`'s kick word (transfer.kick) to wake it after posting
        writes to it; False (it keeps polling on its own) when there is none or it cannot be
        mapped here."""
        old = self._kicks.pop(peer, None)
        if old is not None:
            old.close()
        if not path or self.config.provider != "shm":
            return False
        try:
            self._kicks[peer] = PeerKick(path)
        except (OSError, ValueError) as exc:
            log.warning("prefill rank %d: cannot map the kick word of %r (it polls instead): "
                        "%s", self.config.rank, peer, exc)
            return False
        return True

    def _check_hello(self, h: dict[str, Any]) -> None:
        """A decode rank's static fields against this rank (ValueError names the field). The
        deployment-wide facts are compared only when the compatibility hashes differ."""
        cfg, lay = self.config, self.layout
        if h["role"] != "decode":
            raise ValueError(f"role: a {h['role']} sent HELLO to a prefill")
        src, dst = ShardSpec(**h["peer_spec"]), ShardSpec(**h["spec"])
        dlay = KVLayout.from_dict(h["layout"])
        if h["compat"] != self._hello["compat"]:
            if src != cfg.spec:
                raise ValueError(f"src_spec: decode assumes prefill sharding {src}, this "
                                 f"prefill runs {cfg.spec}")
            if dst != cfg.peer_spec:
                raise ValueError(f"dst_spec: {dst} differs from this prefill's decode "
                                 f"peer_spec {cfg.peer_spec}")
            lay.check_peer(dlay)
            if h["num_layers"] != self.num_layers or \
                    h["buffers_per_layer"] != cfg.buffers_per_layer:
                raise ValueError(f"num_layers/buffers_per_layer: decode has {h['num_layers']}/"
                                 f"{h['buffers_per_layer']}, prefill {self.num_layers}/"
                                 f"{cfg.buffers_per_layer}")
            if len(h["aux_row_bytes"]) != len(self._aux):
                raise ValueError(f"aux_regions: decode has {len(h['aux_row_bytes'])} aux "
                                 f"buffers, prefill {len(self._aux)}")
            for i, (rb, mine) in enumerate(zip(h["aux_row_bytes"], self._aux, strict=True)):
                if rb != mine.row_bytes:
                    raise ValueError(f"aux_regions[{i}]: row of {rb} bytes (prefill "
                                     f"{mine.row_bytes})")
            diff = first_difference(self._facts, hello_facts(h))
            raise ValueError(diff or "compat: the compatibility hash differs though every "
                                     "field agrees (different pdtool builds?)")
        if h["num_parts"] != dst.attn_tp or h["rank"] >= dst.attn_tp:
            raise ValueError(f"dst_rank/num_parts: {h['rank']}/{h['num_parts']} do not "
                             f"fit decode attention TP {dst.attn_tp}")
        if dlay.heads_local != dst.heads_per_rank:
            raise ValueError(f"layout.heads_local: {dlay.heads_local}, but {dst} holds "
                             f"{dst.heads_per_rank} per rank")
        lanes = [("", h)] + [(f"lanes[{i}].", lane) for i, lane in enumerate(h["lanes"])]
        for where, lane in lanes:
            if len(lane["regions"]) != self.num_layers * cfg.buffers_per_layer:
                raise ValueError(f"{where}regions: {len(lane['regions'])} for "
                                 f"{self.num_layers * cfg.buffers_per_layer} layer buffers")
            for i, r in enumerate(lane["regions"]):
                if r["length"] < dlay.buffer_bytes:
                    raise ValueError(f"{where}regions[{i}].length: {r['length']} < layer "
                                     f"buffer {dlay.buffer_bytes} bytes")
            _check_fabric_name(lane["fabric_name"], self._ep.name, f"{where}fabric_name")
        if len(h["aux_regions"]) != len(self._aux):
            raise ValueError(f"aux_regions: decode has {len(h['aux_regions'])} aux buffers, "
                             f"prefill {len(self._aux)}")
        for i, (r, mine) in enumerate(zip(h["aux_regions"], self._aux, strict=True)):
            if r["row_bytes"] != mine.row_bytes or r["length"] < r["row_bytes"]:
                raise ValueError(f"aux_regions[{i}]: rows of {r['row_bytes']} bytes (prefill "
                                 f"{mine.row_bytes}) in {r['length']} bytes")
        if h["writes_per_op"] > self._ep.iov_limit:
            raise ValueError(f"writes_per_op: decode groups {h['writes_per_op']} writes per "
                             f"operation, this prefill's provider takes at most "
                             f"{self._ep.iov_limit} (set the decoder's writes_per_op)")

    def _on_request(self, peer: bytes, b: dict[str, Any], now: float) -> None:
        rid = b["rid"]
        hello = self._peer_hello.get(peer)
        if not isinstance(hello, dict):
            reason = hello or "no HELLO from this decode rank yet"
            self._reply_aborted(peer, b, f"refused: {reason}")
            return
        b = {**hello, **b, "dst_rank": hello["rank"]}
        try:
            self._check_part(b)
        except (ValueError, RouteError) as exc:  # LayoutError is a ValueError
            log.warning("refused part of %s from %r: %s", rid, peer, exc)
            self._reply_aborted(peer, b, f"refused: {exc}")
            return
        if (rid, peer, b["slot"], b["gen"]) in self._tombstones:
            self._reply_aborted(peer, b, "request was already aborted")
            return
        a = self._assembling.setdefault(rid, _Assembly(first=now, timeout_s=b["timeout_s"]))
        if b["dst_rank"] in a.parts:
            self._reply_aborted(peer, b, f"dst_rank: a part from decode rank {b['dst_rank']} "
                                         f"already arrived")
            return
        a.parts[b["dst_rank"]] = (peer, b)
        a.timeout_s = min(a.timeout_s, b["timeout_s"])
        if len(a.parts) < b["num_parts"]:
            return
        del self._assembling[rid]
        parts = tuple({**a.parts[d][1], "sender": a.parts[d][0]} for d in range(b["num_parts"]))
        lead = parts[0]
        if any(p["num_tokens"] != lead["num_tokens"] for p in parts):
            for p in parts:
                self._reply_aborted(p["sender"], p, "num_tokens: decode ranks disagree")
            return
        tokens = np.frombuffer(lead["token_ids"], dtype=WIRE_U32).copy()
        req = PrefillRequest(rid, tokens, lead["num_tokens"],
                             pages_for(lead["num_tokens"], self.layout.page_size), parts,
                             max(0.001, a.timeout_s - (now - a.first)))
        with self._lock:
            self._ready_q.append(req)
        self.news.ring()

    def _check_part(self, b: dict[str, Any]) -> None:
        """The per-request fields of a decode rank's part, its HELLO data merged in (checked
        at HELLO), against this deployment (ValueError names the field)."""
        cfg, lay = self.config, self.layout
        if cfg.rank != 0:
            raise ValueError(f"REQUEST went to prefill rank {cfg.rank}; send it to rank 0")
        src, dst = cfg.spec, cfg.peer_spec
        dlay = KVLayout.from_dict(b["layout"])
        n = pages_for(b["num_tokens"], lay.page_size)
        if len(b["dst_pages"]) != 4 * n:
            raise ValueError(f"dst_pages: {len(b['dst_pages']) // 4} pages for "
                             f"{b['num_tokens']} tokens, expected {n}")
        pages = np.frombuffer(b["dst_pages"], dtype=WIRE_U32)
        if n and int(pages.max()) >= dlay.num_pages:
            raise ValueError(f"dst_pages: page {int(pages.max())} >= {dlay.num_pages}")
        want_tokens = 4 * b["num_tokens"] if b["dst_rank"] == 0 else 0
        if len(b["token_ids"]) != want_tokens:
            raise ValueError(f"token_ids: {len(b['token_ids']) // 4} ids, expected "
                             f"{want_tokens // 4}")
        for i, r in enumerate(b["aux_regions"]):
            if r["length"] < (b["aux_row"] + 1) * r["row_bytes"]:
                raise ValueError(f"aux_regions[{i}]: row {b['aux_row']} outside the buffer")
        slices = _slices(b)
        want = routes_for(src, dst, b["dst_rank"], _Chosen([s.src_rank for s in slices]))
        if want != slices:
            raise ValueError("slices: not the routes for the chosen source ranks")
        if b["aux_rank"] >= src.attn_tp or len(b["expected"]) != src.attn_tp:
            raise ValueError(f"aux_rank/expected: must index the {src.attn_tp} prefill ranks")
        per = [0] * src.attn_tp
        for s in slices:
            per[s.src_rank] += self.num_layers * cfg.buffers_per_layer * slice_ops(
                s, src, dst, layout=lay.pool, page_size=lay.page_size, num_pages=n,
                writes_per_op=b["writes_per_op"])
        per[b["aux_rank"]] += len(self._aux)
        if per != b["expected"]:
            raise ValueError(f"expected: decode counts {b['expected']} operations per prefill "
                             f"rank, this prefill computes {per}")

    def _on_abort(self, peer: bytes, b: dict[str, Any], now: float) -> None:
        rid, me = b["rid"], (peer, b["slot"], b["gen"])
        x = self._reqs.get(rid)
        if x is not None and me in x.senders:
            self._abort(x, f"aborted by decode: {b['reason']}")
            return  # ABORTED goes to every decode rank once local writes completed
        self._tombstones[(rid, *me)] = now

        def mine(parts: Any) -> bool:
            return any((p["sender"], p["slot"], p["gen"]) == me for p in parts)

        a = self._assembling.get(rid)
        if a is not None and mine({**p, "sender": s} for s, p in a.parts.values()):
            del self._assembling[rid]
            for sender, part in a.parts.values():
                self._reply_aborted(sender, part, "aborted by decode before all parts arrived")
        with self._lock:
            queued = [r for r in self._ready_q if r.rid == rid and mine(r.parts)]
            self._ready_q = [r for r in self._ready_q if r not in queued]
            if me in self._handed.get(rid, ()):
                del self._handed[rid]  # in the engine's queue: its bind meets the tombstone
        for r in queued:
            for p in r.parts:
                self._reply_aborted(p["sender"], p, "aborted by decode while queued")
        issued, errored = self._history.get((rid, *me), (0, 0))
        self._reply_aborted(peer, b, f"aborted: {b['reason']}", issued, errored)

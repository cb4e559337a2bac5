"""The prefill messenger's writes and their accounts (a part of `prefill.PrefillMessenger`).

`PrefillWriter` is a mixin of the messenger's thread class: it binds a request to its
destinations (`_dest`: one account per decode rank on its own fabric tag,
`transfer.plane.ledger`), turns each layer the progress word announces into queued page
writes (`_progress`, `_send_layer`, `_queue_write`) and submits them grouped per operation,
in batches that let the control socket be served between them (`_flush_writes`), then
settles, aborts or gives up each request by its ledger accounts (`_check_requests`,
`_settle`, `_timers`). It runs on the messenger thread alone.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..fabric import FabricError, RemoteRegion, WriteGroup, encode_imm
from ..geometry import slice_ops, writes_per_page
from ..layout import KVLayout, write_plan
from ..plane.ledger import Account, LedgerFull
from ..routes import (
    sendable,
)
from .common import (
    LAYER_MASK,
    PASS_SHIFT,
    WIRE_U32,
    PrefillResult,
)
from .prefill_control import PrefillRequest, _slices

log = logging.getLogger("transfer.messenger.prefill")
_BATCH_BYTES = 64 << 20   # bytes per write_batch call (bounds how long one call can block)
_HISTORY = 1 << 16        # finished transfers remembered (a late ABORT still gets its counts)


@dataclass
class _Dest(Account):
    """What this rank sends to one decode rank for one request: its account on one fabric
    tag (`transfer.plane.ledger`)."""

    sender: bytes
    dst_rank: int
    names: list[bytes]       # the decode rank's receive lanes (the first also takes aux copies)
    fi_addrs: list[int]
    imm: int
    slot: int
    gen: int
    regions: list[list[Any]]  # per layer buffer: its remote region on each lane
    aux_regions: list[Any]
    aux_row: int
    plans: list[_Plan]
    send_aux: bool
    expected: int
    per_op: int              # page writes grouped into one operation (the decoder's choice)

@dataclass
class _Plan:
    """One slice's writes for a request, in page order (`per_page` consecutive writes per page),
    and how many of them each layer has submitted. Operations group `_Dest.per_op` writes from
    the first one on; a chunk that ends inside a group holds those writes back until the next
    chunk of that layer (or the prompt's end), so the decoder's count never depends on how the
    prompt was chunked."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    per_page: int
    sent: np.ndarray  # per layer: writes submitted

@dataclass
class _Req:
    rid: str
    num_pages: int
    dests: list[_Dest]
    deadline: float
    aux_row: int
    senders: list[tuple[bytes, int, int]]  # every decode rank of the request: (id, slot, gen)
    state: str = "sending"  # sending | aborting
    reason: str = ""
    pages_ready: int = 0     # pages whose every layer has been submitted
    finished: bool = False   # engine called finish (aux rows staged)
    aux_sent: bool = False
    aborted_at: float = 0.0

@dataclass
class _Pass:
    pid: int
    chunks: list[tuple[str, int, int]]  # (rid, first page, end page)
    layers: int = 0


class PrefillWriter:
    """The writing half of the prefill messenger's thread (see the module docstring)."""

    def _cmd_bind(self, req: PrefillRequest, src_pages: np.ndarray, row: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._handed.pop(req.rid, None)
        if any((req.rid, p["sender"], p["slot"], p["gen"]) in self._tombstones
               for p in req.parts):
            self._settle_unbound(req, row, "aborted by decode before it was bound")
            return
        dests: list[_Dest] = []
        try:
            for p in req.parts:
                d = self._dest(p, src_pages)
                if d is not None:
                    dests.append(d)
        except Exception as exc:  # bad routing data or a peer name the provider refuses
            for d in dests:
                self._ledger.close(d)
            self._settle_unbound(req, row, f"cannot send: {exc}")
            return
        senders = [(p["sender"], p["slot"], p["gen"]) for p in req.parts]
        # a backstop: the decoder's own timeout (and ABORT) normally fires first
        deadline = now + req.timeout_s + self.config.peer_timeout_s
        self._reqs[req.rid] = _Req(req.rid, req.num_pages, dests, deadline, row, senders)

    def _cmd_refuse(self, req: PrefillRequest, reason: str) -> None:
        with self._lock:
            self._handed.pop(req.rid, None)
        for p in req.parts:
            self._reply_aborted(p["sender"], p, reason)

    def _settle_unbound(self, req: PrefillRequest, row: int, reason: str) -> None:
        for p in req.parts:
            if self.config.rank in {s["src_rank"] for s in p["slices"]} | {p["aux_rank"]}:
                self._reply_aborted(p["sender"], p, reason)
        self._publish(req.rid, PrefillResult(req.rid, False, reason), row)

    def _dest(self, p: dict[str, Any], src_pages: np.ndarray) -> _Dest | None:

        cfg, me = self.config, self.config.rank
        slices = [s for s in _slices(p) if s.src_rank == me]
        send_aux = p["aux_rank"] == me and bool(self._aux)
        if not slices and not send_aux:
            return None
        if p["sender"] in self._clock.dead:
            raise ValueError("its decode rank is not answering")
        dlay = KVLayout.from_dict(p["layout"])
        dpages = np.frombuffer(p["dst_pages"], dtype=WIRE_U32)
        plans, count = [], 0
        src, dst, per_op = cfg.spec, cfg.peer_spec, p["writes_per_op"]
        for s in slices:
            so, do, ln = write_plan(self.layout, dlay, src_pages, dpages, s)
            k = writes_per_page(s, src, dst, self.layout.pool, self.layout.page_size)
            if len(ln) != k * len(src_pages):
                raise ValueError(f"write plan of {len(ln)} writes, routes say {k} per page")
            plans.append(_Plan(so, do, ln, k, np.zeros(self.num_layers, dtype=np.int64)))
            count += self.num_layers * cfg.buffers_per_layer * slice_ops(
                s, src, dst, layout=self.layout.pool, page_size=self.layout.page_size,
                num_pages=len(src_pages), writes_per_op=per_op)
        count += len(self._aux) if send_aux else 0
        if count != p["expected"][me]:
            raise ValueError(f"expected: the decoder counts {p['expected'][me]} operations from "
                             f"rank {me}, this rank would send {count}")
        lanes = [p, *p["lanes"]]
        names = [lane["fabric_name"] for lane in lanes]
        for name in names:
            if name not in self._peers:
                self._peers[name] = self._ep.insert_peer(name)
        regions = [[RemoteRegion.from_dict(lane["regions"][buf]) for lane in lanes]
                   for buf in range(len(p["regions"]))]
        aux_regions = [RemoteRegion.from_dict({k: r[k] for k in ("base", "key", "length")})
                       for r in p["aux_regions"]]
        try:
            return self._ledger.open(partial(
                _Dest, p["sender"], p["dst_rank"], names, [self._peers[n] for n in names],
                encode_imm(p["slot"], p["gen"]), p["slot"], p["gen"], regions, aux_regions,
                p["aux_row"], plans, send_aux, p["expected"][me], per_op))
        except LedgerFull as exc:
            raise ValueError(f"no free fabric tag: {exc} (raise max_requests)") from None

    def _cmd_engine_kicks(self) -> None:
        """The engine writes the progress word through layer_done, which kicks and writes
        the command pipe: the wait for the engine (wait_change) may sleep ENGINE_WAIT_S at
        once, in ppoll on that pipe and the control socket (`Endpoint.set_ctl_fd`). A GPU
        stream writing the word does not kick, so without a layer_done call the wait keeps
        its backoff and its WAIT_SLICE_S."""
        word = getattr(self, "_kick_word", None)
        if word is not None:
            self._ep.set_kick(word, self.ENGINE_WAIT_S, change_only=True)
            self._engine_wait_s = self.ENGINE_WAIT_S

    def _cmd_pass(self, p: _Pass) -> None:
        self._passes.append(p)

    def _cmd_finish(self, rid: str, rows: list[bytes]) -> None:
        x = self._reqs.get(rid)
        if x is None:
            return
        for buf, data in zip(self._aux_raw, rows, strict=True):
            if len(data) != buf.shape[1]:
                self._abort(x, f"finish: aux row of {len(data)} bytes, buffer rows hold "
                               f"{buf.shape[1]}")
                return
            buf[x.aux_row] = np.frombuffer(data, dtype=np.uint8)
        x.finished = True

    def _cmd_abort(self, rid: str, reason: str) -> None:
        x = self._reqs.get(rid)
        if x is not None:
            self._abort(x, reason)

    def _progress(self) -> None:
        """Queue every layer the progress word says is in the cache (`_queue_write`). The
        passes this wake-up covers (several, when the engine announces only every few: the
        reference engine's `ANNOUNCE_BYTES`) go as one range per request and layer, so the
        Python that holds the engine's GIL here grows with requests x layers, not with
        passes (the tiny model's 2,000-token prompt is 125 passes, announced once)."""
        word = int(self.progress[0])
        cur, layers = word >> PASS_SHIFT, min(word & LAYER_MASK, self.num_layers)
        L = self.num_layers
        ends: dict[str, list[int]] = {}  # rid -> per layer, the end page now in the cache
        while self._passes:
            p = self._passes[0]
            level = L if p.pid < cur else (layers if p.pid == cur else 0)
            while p.layers < level:
                for rid, _lo, hi in p.chunks:
                    end = ends.setdefault(rid, [0] * L)
                    end[p.layers] = max(end[p.layers], hi)
                p.layers += 1
            if p.layers < L:
                break
            for rid, _lo, hi in p.chunks:
                x = self._reqs.get(rid)
                if x is not None:
                    x.pages_ready = max(x.pages_ready, hi)
            self._passes.pop(0)
        for rid, end in ends.items():
            x = self._reqs.get(rid)
            if x is not None and x.state == "sending":
                for layer, hi in enumerate(end):
                    if hi:
                        self._send_layer(x, layer, hi)

    def _send_layer(self, x: _Req, layer: int, hi: int) -> None:
        """Pages [0, hi) of `layer` are in the cache: queue every whole operation they
        complete that is not queued yet (all of them at the prompt's end), per destination,
        slice and layer buffer."""
        bpl = self.config.buffers_per_layer
        for d in x.dests:
            for pl in d.plans:
                a = int(pl.sent[layer])
                b = sendable(a, hi * pl.per_page, len(pl.lengths), d.per_op)
                if b <= a:
                    continue
                pl.sent[layer] = b
                for j in range(bpl):
                    buf = layer * bpl + j
                    self._queue_write(x, d, d.fi_addrs, self._kv_mrs[buf], d.regions[buf],
                                      pl.src[a:b], pl.dst[a:b], pl.lengths[a:b], d.per_op)

    def _queue_write(self, x: _Req, d: _Dest, peers: list[int], mr: Any, regions: list[Any],
                     so: np.ndarray, do: np.ndarray, ln: np.ndarray, per_op: int = 1) -> None:
        """Queue writes for `_flush_writes`, cut at operation boundaries into pieces of at most
        `_BATCH_BYTES`. `per_op` writes go in one operation (the last one of the range may
        carry fewer). `peers`/`regions`: the receive lanes to spread over."""

        cuts = [0]
        total = int(ln.sum())
        if len(ln) > per_op and total > _BATCH_BYTES:
            csum = np.cumsum(ln, dtype=np.uint64)
            marks = np.arange(_BATCH_BYTES, int(csum[-1]), _BATCH_BYTES, dtype=np.uint64)
            at = np.searchsorted(csum, marks, side="right") // per_op * per_op
            cuts += sorted({int(i) for i in at} - {0, len(ln)})
        cuts.append(len(ln))
        kick = self._kicks.get(d.sender)
        for a, b in itertools.pairwise(cuts):
            if a < b:
                size = total if len(cuts) == 2 else int(ln[a:b].sum())
                self._queued.append((x, d, size, WriteGroup(
                    peers, mr, regions, so[a:b], do[a:b], ln[a:b], d.imm, d.tag, per_op,
                    None if kick is None else kick.word)))

    def _flush_writes(self) -> None:
        """Submit the queued writes, as many groups per C call as make `_BATCH_BYTES` (one
        call per layer buffer before, each releasing the GIL: see `Endpoint.write_groups`).
        Each call is bounded in time well under the peers' liveness timeout. Once
        `_BATCH_BYTES` went since the control socket was last served, it is served before the
        next call (PINGs answered, REQUESTs assembled, ABORTs seen; `_serve_socket`); an ABORT
        stops its request's remaining writes, and a failed write only its own request's."""

        todo, self._queued = self._queued, []
        i = 0
        while i < len(todo):
            if self._unserved >= _BATCH_BYTES:
                self._serve_socket()
            call, size = [], 0
            while i < len(todo) and size < _BATCH_BYTES:
                if todo[i][0].state == "sending":
                    call.append(i)
                    size += todo[i][2]
                i += 1
            if not call:
                continue
            try:
                self._ep.write_groups([todo[k][3] for k in call],
                                      timeout=self.config.peer_timeout_s / 2)
                whole = call
            except FabricError as exc:
                bad = call[exc.group]
                whole = call[:exc.group]
                x, d, _size, g = todo[bad]
                sent = int(exc.submitted)
                self._count_writes(d, sent, g.per_op, g.kick is not None,
                                   int(g.lengths[:sent].sum()))
                self._abort(x, f"write to decode rank {d.dst_rank} failed: {exc}")
                i = bad + 1  # the groups after it were not submitted: the next call takes them
            for k in whole:
                _x, d, size, g = todo[k]
                self._count_writes(d, len(g.lengths), g.per_op, g.kick is not None, size)
                self._unserved += size

    def _count_writes(self, d: _Dest, writes: int, per_op: int, kicked: bool,
                      nbytes: int) -> None:
        """`writes` page writes (`nbytes` in all) went to `d` (whole operations of `per_op`)."""
        ops = -(-writes // per_op)
        d.issued += ops
        self.ops_issued += ops
        self.writes_issued += writes
        self.bytes_issued += nbytes
        sent = self.sent_to.setdefault(d.sender, [0, 0])
        sent[0] += ops
        sent[1] += nbytes
        if kicked and writes:
            self.kicks_sent += 1  # the C call kicked it: there is something to copy

    def _queue_aux(self, x: _Req) -> None:
        for d in x.dests:
            if not d.send_aux:
                continue
            for i, (mr, spec) in enumerate(zip(self._aux_mrs, self._aux, strict=True)):
                rb = spec.row_bytes
                self._queue_write(x, d, d.fi_addrs[:1], mr, d.aux_regions[i:i + 1],
                                  np.array([x.aux_row * rb], np.uint64),
                                  np.array([d.aux_row * rb], np.uint64),
                                  np.array([rb], np.uint64))
        x.aux_sent = True

    def _check_requests(self) -> None:
        self._stall.check(time.monotonic())  # its cancelled writes are among the errors
        for tag, _errno, msg in self._ep.errors:
            d = self._ledger.failed(tag)
            if d is None:
                continue
            self.write_errors += 1
            x = next((r for r in self._reqs.values() if d in r.dests), None)
            if x is not None:
                self._abort(x, f"write to decode rank {d.dst_rank} failed: {msg}")
        reqs = list(self._reqs.values())
        for x in reqs:
            if x.state == "sending" and x.pages_ready >= x.num_pages and not x.aux_sent and (
                    x.finished or not self._aux):
                self._queue_aux(x)
        # this step's writes, KV (from _progress) and aux rows, in one call; before any
        # request is settled below, which reads the operations issued
        self._flush_writes()
        for x in reqs:
            if x.state != "aborting" and not x.aux_sent:
                continue  # still being prefilled: nothing to settle, so no completion reads
            if not all(self._ledger.drained(d) for d in x.dests):
                continue  # writes still in flight: the source pages are still being read
            if x.state == "aborting":
                self._settle(x, ok=False)
            elif x.aux_sent:
                bad = [d for d in x.dests if d.issued != d.expected]
                if bad:
                    self._abort(x, f"issued {bad[0].issued} writes to decode rank "
                                   f"{bad[0].dst_rank}, expected {bad[0].expected}")
                else:
                    self._settle(x, ok=True)

    def _abort(self, x: _Req, reason: str) -> None:
        if x.state == "sending":
            log.warning("request %s aborted on prefill rank %d: %s", x.rid, self.config.rank,
                        reason)
            x.state, x.reason, x.aborted_at = "aborting", reason, time.monotonic()

    def _settle(self, x: _Req, ok: bool, leak_tags: bool = False) -> None:
        del self._reqs[x.rid]
        total = 0
        by_sender = {d.sender: d for d in x.dests}
        for d in x.dests:
            total += d.issued
            self._history[(x.rid, d.sender, d.slot, d.gen)] = (d.issued, d.errored)
            # with leak_tags a completion may still come: the tag is never handed out again
            self._ledger.close(d, leak=leak_tags)
        if not ok:  # every decode rank of the request learns this rank will write no more
            for sender, slot, gen in x.senders:
                d = by_sender.get(sender)
                self._chan.send("ABORTED", {"rid": x.rid, "slot": slot, "gen": gen,
                                            "reason": x.reason[:1024],
                                            "issued": d.issued if d else 0,
                                            "errored": d.errored if d else 0}, peer=sender)
        while len(self._history) > _HISTORY:
            self._history.popitem(last=False)
        self._publish(x.rid, PrefillResult(x.rid, ok, x.reason, total), x.aux_row)
        self._drop_dead_peers()

    def _publish(self, rid: str, res: PrefillResult, row: int) -> None:
        with self._lock:
            self._results[rid] = res
            if row >= 0:
                self._aux_free.append(row)
        self.news.ring()

    def _timers(self, now: float) -> None:
        for peer in self._clock.newly_dead(now):
            log.warning("decode peer %r silent for %.1f s: aborting its requests", peer,
                        self.config.peer_timeout_s)
            # its HELLO data goes too: a decode rank that lost us sends HELLO again
            self._peer_hello.pop(peer, None)
            kick = self._kicks.pop(peer, None)
            if kick is not None:
                kick.close()
            for x in list(self._reqs.values()):
                if any(d.sender == peer for d in x.dests):
                    self._dead_names.update(n for d in x.dests if d.sender == peer
                                            for n in d.names)
                    self._abort(x, f"decode peer {peer.decode(errors='replace')} silent for "
                                   f"more than {self.config.peer_timeout_s:.1f} s")
            for rid, a in list(self._assembling.items()):
                if any(s == peer for s, _ in a.parts.values()):
                    del self._assembling[rid]
        for x in list(self._reqs.values()):
            if now > x.deadline and x.state == "sending":
                self._abort(x, "timed out on the prefill side")
            elif x.state == "aborting" and now - x.aborted_at > 2 * self.config.peer_timeout_s:
                # writes to a dead peer may never complete: count the missing ones as failed
                # (the decoder quarantines its pages anyway) and free the source pages
                for d in x.dests:
                    self._ledger.give_up(d)
                x.reason += " (some writes never completed)"
                self._settle(x, ok=False, leak_tags=True)
        for rid, a in list(self._assembling.items()):
            if now - a.first > a.timeout_s:
                del self._assembling[rid]
                for sender, part in a.parts.values():
                    self._reply_aborted(sender, part, "timed out waiting for the other decode "
                                                      "ranks' parts")
        horizon = 4 * self.config.timeout_s
        for key, t in list(self._tombstones.items()):
            if now - t > horizon:
                del self._tombstones[key]

    def _drop_dead_peers(self) -> None:
        if not self._dead_names:
            return
        busy = {n for x in self._reqs.values() for d in x.dests for n in d.names}
        for name in list(self._dead_names - busy):
            self._dead_names.discard(name)
            addr = self._peers.pop(name, None)
            if addr is not None:
                self._ep.remove_peer(addr)

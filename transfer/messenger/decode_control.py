"""The decode messenger thread's work (a part of `decode.DecodeMessenger`).

`DecodeControl` is a mixin of the messenger's thread class: it runs the engine's commands
(submit, cancel, reconnect, release), starts waiting transfers once a slot is free and their
prefill instance answered this rank's HELLO (`_begin`: slot, routes, expected count, the
REQUEST part to the lead), checks each prefill rank's HELLO once (`_on_hello`), handles
ABORTED and PONG, and fails, aborts and re-sends on its timers (`_fail`, `_send_aborts`,
`_timers`). `_Xfer` is one transfer as this thread tracks it. It runs on the messenger thread
alone, on the state `DecodeMessenger._setup` made.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ..geometry import expected_writes, slice_ops
from ..routes import Slice, routes_for
from ..wire.channel import Channel
from ..wire.handshake import first_difference
from ..wire.messenger import hello_facts
from .common import (
    MessengerError,
    TransferStatus,
)

log = logging.getLogger("transfer.messenger.decode")


@dataclass
class _Xfer:
    rid: str
    tokens: np.ndarray
    pages: np.ndarray
    peer: int | None
    submitted: float
    status: TransferStatus = TransferStatus.PENDING
    reason: str = ""
    group: int = -1
    slot: int = -1
    gen: int = -1
    expected: int = 0
    confirmed: dict[int, int] = field(default_factory=dict)  # prefill rank -> writes it issued
    last_abort: float = 0.0
    timed_out: bool = False  # failed by this side's timeout (counted apart in the stats)
    # `timeout_s` counts from here: the submit, moved on while the prefill lead's PONGs list
    # the transfer as queued for a bind (so it counts from about the bind)
    clock: float = field(init=False)

    def __post_init__(self) -> None:
        self.clock = self.submitted


_COUNTING = (TransferStatus.PENDING, TransferStatus.TRANSFERRING)
_SETTLED = (TransferStatus.SUCCESS, TransferStatus.FAILED)


_COUNTING = (TransferStatus.PENDING, TransferStatus.TRANSFERRING)
_SETTLED = (TransferStatus.SUCCESS, TransferStatus.FAILED)


def _slice_dict(s: Slice) -> dict[str, int]:
    return {"src_rank": s.src_rank, "head_lo": s.head_lo, "num_heads": s.num_heads,
            "src_head_off": s.src_head_off, "dst_head_off": s.dst_head_off}


class DecodeControl:
    """The work of the decode messenger's thread (see the module docstring)."""

    def _cmd_submit(self, x: _Xfer) -> None:
        groups = len(self.config.prefill_endpoints)
        x.group = x.peer if x.peer is not None else zlib.crc32(x.rid.encode()) % groups
        self._waiting.append(x)

    def _cmd_cancel(self, rid: str, reason: str) -> None:
        x = self._xfers.get(rid)
        if x is not None:
            self._fail(x, reason)
            return
        for w in self._waiting:
            if w.rid == rid:
                self._waiting.remove(w)
                self._set(w, TransferStatus.FAILED, reason)

    def _cmd_reconnect(self, g: int, endpoints: tuple[str, ...]) -> None:
        assert self._ctx is not None
        for ch in self._chans[g]:
            self._poller.unregister(ch.sock)
            ch.close()
        self._chans[g] = [Channel.connect(self._ctx, self._codec, a) for a in endpoints]
        for r, ch in enumerate(self._chans[g]):
            self._poller.register(ch.sock, zmq.POLLIN)
            self._peer_ok[(g, r)] = None  # the new process answers a new HELLO only
            ch.send("HELLO", self._hello, session=b"")
        log.info("prefill %d: reconnecting to %s", g, ", ".join(endpoints))

    def _cmd_release(self, rid: str, slot: int) -> None:
        x = self._xfers.pop(rid, None)
        if x is not None and slot >= 0 and x.status not in _SETTLED:
            self._set(x, TransferStatus.SUCCESS)  # the engine read the full count first
        if x is not None and slot >= 0 and self._by_slot.get(slot) is x:
            del self._by_slot[slot]
            self._slots.release(slot)

    def _group_state(self, g: int) -> str | None:
        """'' when every rank of prefill instance g answered our HELLO and serves us, the first
        refusal if one refused, None while some have not answered yet."""
        states = [self._peer_ok[(g, r)] for r in range(len(self._chans[g]))]
        refused = [s for s in states if s]
        return refused[0] if refused else (None if None in states else "")

    def _start_waiting(self) -> bool:
        """Start waiting transfers in order; True when some wait for a free slot only."""
        keep: list[_Xfer] = []
        for x in self._waiting:
            state = self._group_state(x.group)
            dead = any(g == x.group for g, _ in self._clock.dead)
            if state is None and not dead:
                keep.append(x)  # its prefill instance has not answered HELLO yet
            elif state:
                self._set(x, TransferStatus.FAILED, state)
            elif self._slots.free or dead:
                self._begin(x)
            else:
                keep.append(x)
        self._waiting = keep
        return any(self._group_state(x.group) == "" for x in keep)

    def _begin(self, x: _Xfer) -> None:
        cfg = self.config
        src, dst = cfg.peer_spec, cfg.spec
        dead = sorted(r for g, r in self._clock.dead if g == x.group)
        if dead:  # fail fast: a REQUEST to a silent instance would only wait for timeout_s
            self._set(x, TransferStatus.FAILED, f"prefill {x.group} rank {dead[0]} is not "
                                                f"answering (silent for more than "
                                                f"{cfg.peer_timeout_s:.1f} s)")
            return
        slices = routes_for(src, dst, cfg.rank, self._rng)
        lay, n, k = self.layout, len(x.pages), self._writes_per_op
        per_rank = [0] * src.attn_tp
        for s in slices:
            per_rank[s.src_rank] += self.num_layers * cfg.buffers_per_layer * slice_ops(
                s, src, dst, layout=lay.pool, page_size=lay.page_size, num_pages=n,
                writes_per_op=k)
        aux_rank = slices[0].src_rank
        per_rank[aux_rank] += len(self._aux)
        x.expected = expected_writes(slices, src, dst, layout=lay.pool, page_size=lay.page_size,
                                     num_pages=n, num_layers=self.num_layers,
                                     buffers_per_layer=cfg.buffers_per_layer,
                                     aux_writes=len(self._aux), writes_per_op=k)
        if x.expected != sum(per_rank):  # pragma: no cover - both from geometry.py
            raise MessengerError(f"{x.rid}: expected {x.expected} != per-rank sum {per_rank}")
        alloc = self._slots.allocate(x.expected)
        if alloc is None:  # pragma: no cover - _start_waiting checks free first
            self._waiting.insert(0, x)
            return
        x.slot, x.gen = alloc
        self._xfers[x.rid] = x
        self._by_slot[x.slot] = x
        body = {  # the static fields went once, in our HELLO
            "rid": x.rid,
            "token_ids": x.tokens.tobytes() if cfg.rank == 0 else b"",
            "num_tokens": len(x.tokens),
            "dst_pages": x.pages.tobytes(),
            "slot": x.slot, "gen": x.gen, "aux_row": x.slot,
            "slices": [_slice_dict(s) for s in slices],
            "aux_rank": aux_rank, "expected": per_rank,
            "timeout_s": max(0.001, cfg.timeout_s - (time.monotonic() - x.submitted)),
        }
        self._set(x, TransferStatus.PENDING)
        self._chans[x.group][0].send("REQUEST", body)
        if x.expected == 0:  # nothing to move (a 1-token prompt without aux buffers)
            self._slots.finish(x.slot)
            self._set(x, TransferStatus.SUCCESS)

    def _on_message(self, g: int, r: int, msg: Any) -> None:
        now = time.monotonic()
        if self._clock.heard((g, r), now):
            log.info("prefill %d rank %d is answering again", g, r)
            self._silent = frozenset(g for g, _ in self._clock.dead)
        if msg.type == "HELLO":
            self._on_hello(g, r, msg.body)
            return
        if msg.type == "PONG":
            for q in msg.body.get("queued", ()):  # still in the prefill's queue: no timeout yet
                x = self._by_slot.get(q["slot"])
                if (x is not None and x.group == g and x.gen == q["gen"]
                        and x.status is TransferStatus.PENDING):
                    x.clock = now
            return
        if msg.type != "ABORTED":
            return
        b = msg.body
        x = self._xfers.get(b["rid"])
        if x is None or x.group != g or (x.slot, x.gen) != (b["slot"], b["gen"]):
            return  # an older transfer of that id, already settled
        landed = b["issued"] - b["errored"]
        if x.status is TransferStatus.ABORTING:
            self._slots.confirm(x.slot, (g, r), landed, now)
        elif x.status in (TransferStatus.PENDING, TransferStatus.TRANSFERRING):
            x.confirmed[r] = landed
            self._fail(x, f"prefill {g} rank {r} aborted: {b['reason']}")

    def _on_hello(self, g: int, r: int, h: dict[str, Any]) -> None:
        """A prefill rank's answer to our HELLO: checked once; its static data is not resent."""
        where = f"prefill {g} rank {r}"
        if h["role"] != "prefill" or h["rank"] != r:
            reason = (f"{where}: prefill_endpoints[{g}][{r}] answered as {h['role']} rank "
                      f"{h['rank']}")
        elif h["error"]:
            reason = f"{where} refused this decode rank: {h['error']}"
        elif h["compat"] != self._hello["compat"]:
            diff = first_difference(self._facts, hello_facts(h))
            reason = f"{where} is not compatible: {diff or 'compat: hash differs'}"
        else:
            reason = ""
        if reason:
            log.error("%s", reason)
        elif self._peer_ok[(g, r)] is None:
            log.info("%s: HELLO answered, compatible", where)
        self._peer_ok[(g, r)] = reason
        self._kicked_by[(g, r)] = bool(h.get("kicks"))
        self._tune_kick()

    def _tune_kick(self) -> None:
        """Once every prefill rank kicks this rank after posting writes, its waits may sleep up
        to KICK_SLEEP_S between polls (a kick ends the sleep); while one does not, the short
        poll_backoff_s cap stays (its writes would be noticed that much later)."""
        if self._kick is None:
            return
        every = all(self._kicked_by.get(peer) for peer in self._peer_ok)
        cap = self.KICK_SLEEP_S if every else 0.0
        if cap != getattr(self, "_kick_cap", None):
            self._kick_cap = cap
            for ep in (self._ep, *self._lanes):
                ep.set_kick(self._kick.word, cap)

    def _fail(self, x: _Xfer, reason: str) -> None:
        if x.status not in (TransferStatus.PENDING, TransferStatus.TRANSFERRING):
            return
        now = time.monotonic()
        n_ranks = self.config.peer_spec.attn_tp
        q = self._slots.quarantine(x.slot, x.rid, {(x.group, r) for r in range(n_ranks)})
        for r, landed in x.confirmed.items():
            self._slots.confirm(x.slot, (x.group, r), landed, now)
        for peer in q.waiting:
            if peer in self._clock.dead:
                q.dead_until[peer] = self._clock.last[peer] + 2 * self.config.peer_timeout_s
        log.warning("transfer %s failed: %s", x.rid, reason)
        self._set(x, TransferStatus.ABORTING, reason)
        self._send_aborts(x, now)

    def _send_aborts(self, x: _Xfer, now: float) -> None:
        q = self._slots.quarantined.get(x.slot)
        if q is None:
            return
        x.last_abort = now
        for g, r in q.waiting:
            self._chans[g][r].send("ABORT", {"rid": x.rid, "slot": x.slot, "gen": x.gen,
                                             "reason": x.reason[:1024]})

    def _timers(self, now: float) -> None:
        cfg = self.config
        # a round of this loop longer than a heartbeat (the process descheduled, the GIL held
        # by the engine) read no PONG meanwhile: that time is not the prefill ranks' silence.
        # Without this, a decode process paused for peer_timeout_s failed every transfer
        away, self._timers_at = now - self._timers_at, now
        if away > cfg.heartbeat_s:
            self._clock.excuse(away)
        self._stale = self._ep.stale_writes + sum(lane.stale_writes for lane in self._lanes)
        if now >= self._next_ping:
            self._next_ping = now + cfg.heartbeat_s
            for g, group in enumerate(self._chans):
                for r, ch in enumerate(group):
                    if self._peer_ok[(g, r)] is None:  # not answered (or silent since): HELLO
                        ch.send("HELLO", self._hello, session=b"")
                    else:
                        ch.send("PING", {})
        for peer in self._clock.newly_dead(now):
            g, r = peer
            self._silent = frozenset(g for g, _ in self._clock.dead)
            self._peer_ok[peer] = None  # a restarted prefill rank only answers a new HELLO
            # the peer's lease (it stops writing when it misses our pings) ends one more
            # peer_timeout after it last answered; after that its writes can no longer land
            lease_end = self._clock.last[peer] + 2 * cfg.peer_timeout_s
            self._slots.peer_dead(peer, lease_end)
            for x in list(self._xfers.values()):
                if x.group == g and x.status in (TransferStatus.PENDING,
                                                 TransferStatus.TRANSFERRING):
                    self._fail(x, f"prefill {g} rank {r} silent for more than "
                                  f"{cfg.peer_timeout_s:.1f} s (dead?)")
        for x in list(self._xfers.values()):
            if x.status in (TransferStatus.PENDING, TransferStatus.TRANSFERRING):
                if now - x.clock > cfg.timeout_s:
                    x.timed_out = True
                    got = self._slots.received(x.slot)
                    self._fail(x, f"timed out after {cfg.timeout_s:.1f} s (since the prefill "
                                  f"took the request) with {got} of "
                                  f"{x.expected} writes")
            elif (x.status is TransferStatus.ABORTING
                  and now - x.last_abort > 2 * cfg.heartbeat_s):
                self._send_aborts(x, now)
        for w in list(self._waiting):
            if now - w.submitted > cfg.timeout_s:
                w.timed_out = True
                self._waiting.remove(w)
                why = (f"prefill {w.group} did not answer HELLO" if
                       self._group_state(w.group) is None else "no free transfer slot")
                self._set(w, TransferStatus.FAILED, f"{why} within {cfg.timeout_s:.1f} s")
        for slot in self._slots.ready_to_release(now):
            x = self._by_slot.pop(slot)
            self._slots.release(slot)
            self._xfers.pop(x.rid, None)
            self._set(x, TransferStatus.FAILED)

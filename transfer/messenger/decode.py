"""Decode side of the KV messenger (docs/messenger.md, steps 1 and 5).

Per decode attention rank, one `DecodeMessenger`. For each request whose pages the engine has
allocated (non-evictable), the engine calls `submit`; the messenger

1. takes a transfer slot `(slot, gen)` (transfer.plane.slots) and arms the endpoint to count writes
   carrying `encode_imm(slot, gen)`;
2. picks the prefill instance (the engine's `peer`, else a hash of the request id, so every
   decode rank of the instance picks the same one) and, per head run it needs, the prefill rank
   that sends it (routes.routes_for; where the cache is replicated — MLA, or more TP ranks than
   KV heads — one replica at random, so every prefill GPU and NIC is used, and only that one
   sends the slice because this rank alone decides who sends its slices);
3. (once per prefill rank, at start-up and again after the rank went silent) sends a HELLO with
   its static data — sharding, page layout, layers, registered regions, receive lanes, writes
   per operation, and their compatibility hash (transfer.wire) — and waits for the rank's
   HELLO; a request for an instance not yet answered waits (bounded by its timeout), one that
   refused this rank fails at once with the rank's reason;
4. sends its REQUEST part to the prefill instance's LEAD rank only. Why the lead: the prefill TP
   ranks run one scheduler whose lead broadcasts new requests to the other ranks anyway; the lead
   hands out a request once every decode rank's part arrived, the engine's broadcast carries the
   parts to every prefill rank, and each rank's `bind` picks out what it must send — no extra
   control hop, no race between a request reaching a rank and its routing data. ABORT and PING
   go to every prefill rank directly, because each rank has its own writes in flight;
5. computes how many writes will land here (geometry.expected_writes: pages × layers × buffers ×
   writes per page summed over its source slices, plus one per aux buffer; the prefill groups
   up to `writes_per_op` consecutive page writes of a slice into one RMA operation, which lands
   as one completion, so the count is per operation) and hands the request to the engine
   (`ready()`) exactly when `recv_counts[slot]` reaches it. No completion message. Whichever
   thread counts the last write (a receive lane's, or this messenger's wait, both in C) writes
   the engine's doorbell pipe itself, and `ready()`/`status()` read the count: the messenger
   thread is not on the way to the first token (docs/messenger.md).

Failure handling. A transfer fails on its timeout, on an ABORTED from any prefill rank, on a
prefill rank silent for `peer_timeout_s` (its lease: this side stops being sure it is alive),
or on `cancel`; a request for a prefill instance that is silent right now fails at once (no
REQUEST is sent, no slot taken) until it answers a heartbeat again. A failed transfer goes
ABORTING: an ABORT goes to every prefill rank of the instance
(re-sent until answered), and the destination pages plus the slot's aux row stay
quarantined — see transfer.plane.slots for when they are released. Only then is the request
FAILED and in `failed()`:
the engine must not free or reuse the pages before that. A prefill instance that was restarted
listens on new control addresses: `reconnect` moves its channels there, and the new process
gets this rank's HELLO (with the memory keys it writes with) like any new peer;
`silent_groups` says which instances to look for (the caller knows where they publish).

Thread contract: `submit`, `cancel`, `release`, `status`, `ready`, `failed`, `aux` are called by
the engine's thread; they never block on the network. Everything else runs on the messenger
thread (the only one touching the endpoint and sockets), except the copies of extra receive
lanes (`DecodeConfig.lanes`): each lane endpoint is drained by a C progress thread of its own,
counting into the messenger's slot table (see transfer.fabric `share_counts`).

Modules: this one is the engine's API and the thread's loop; the thread's work on commands,
control messages and timers is `decode_control.py`, a half of the same object.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from ..kick import KickWord
from ..layout import AuxSpec, LayoutError, as_buffer, aux_spec
from ..plane.slots import SlotTable
from ..routes import pages_for
from ..wire.channel import Channel
from ..wire.envelope import Envelope
from ..wire.handshake import compat_hash
from ..wire.messenger import MESSENGER, facts
from .common import (
    WIRE_U32,
    DecodeConfig,
    MessengerThread,
    PeerClock,
    TransferState,
    TransferStatus,
    TransferTally,
)
from .decode_control import _COUNTING, _SETTLED, DecodeControl, _Xfer

log = logging.getLogger("transfer.messenger.decode")


def _landed(st: TransferState, counts: np.ndarray | None) -> bool:
    """Every write a transfer still being counted expects landed: it is SUCCESS from this
    moment for the engine, before the messenger thread settles its slot."""
    return (st.status in _COUNTING and counts is not None and st.slot >= 0
            and int(counts[st.slot]) == st.expected > 0)


class DecodeMessenger(DecodeControl, MessengerThread):
    """See the module docstring. `kv_buffers`: one tensor per layer (or per layer and K/V with
    `buffers_per_layer=2`), all of the documented 5-D `layout`; `aux_buffers`: tensors of
    `[rows >= max_inflight, ...]` receiving context rows (hidden states, logits) — row = slot.
    The caller keeps every buffer alive until `close()`."""

    role = "decode"
    # longest C wait while writes are due: control messages and timers wait at most this
    # (commands ring the bell; a completed transfer rings the engine from C, and the thread
    # settles its slot at its next return). Each return costs a
    # Python round (~0.2 ms of a loaded core) while a prefill computes for the same request
    # on the same cores: at 2 ms that was a tenth of a core per decoder
    POLL_SLICE_S = 0.02

    def __init__(self, config: DecodeConfig, kv_buffers: Sequence[Any], layout: str = "HND",
                 aux_buffers: Sequence[Any] = ()) -> None:
        super().__init__(config)
        self.config: DecodeConfig = config
        self.layout = self._check_kv_buffers(kv_buffers, layout)
        self.num_layers = len(kv_buffers) // config.buffers_per_layer
        self._kv = [as_buffer(b) for b in kv_buffers]
        self._aux_objs = list(aux_buffers)
        self._aux: list[AuxSpec] = [aux_spec(a) for a in aux_buffers]
        for i, a in enumerate(self._aux):
            if a.rows < config.max_inflight:
                raise LayoutError(f"aux_buffers[{i}]: {a.rows} rows, need max_inflight="
                                  f"{config.max_inflight}")
        self._aux_raw = [np.frombuffer(_view(a), dtype=np.uint8).reshape(s.rows, s.row_bytes)
                         for a, s in zip(aux_buffers, self._aux, strict=True)]
        self._keep = (list(kv_buffers), list(aux_buffers))
        self._rng = random.Random(config.seed)
        self._states: dict[str, TransferState] = {}
        self._counts: np.ndarray | None = None
        self._silent: frozenset[int] = frozenset()  # rebuilt by the messenger thread
        self.tally = TransferTally()  # settled transfers, for stats() (metrics)
        self.tally_by_prefill: dict[int, TransferTally] = {}  # the same per prefill instance
        self.identity = config.identity("decode")
        self._start()

    # ================================================================ engine-thread API
    def submit(self, rid: str, token_ids: Sequence[int] | np.ndarray,
               dst_pages: Sequence[int] | np.ndarray, peer: int | None = None) -> None:
        """Engine thread, once per request after allocating its non-evictable pages:
        `dst_pages[i]` receives page i of the prompt (`pages_for(len(token_ids))` pages).
        The request stays blocked until `status(rid)` is SUCCESS (then `ready()` has it)."""
        self._check_alive()
        if not isinstance(rid, str) or not 0 < len(rid) <= 256:
            raise ValueError(f"rid: expected a non-empty string of at most 256 chars, got "
                             f"{rid!r}")
        tokens = check_token_ids(rid, token_ids)
        n = pages_for(len(tokens), self.layout.page_size)
        pages = self.layout.check_pages(np.asarray(dst_pages, dtype=np.int64).reshape(-1),
                                        f"dst_pages of {rid}")
        if len(pages) != n:
            raise ValueError(f"dst_pages of {rid}: {len(pages)} pages for {len(tokens)} tokens; "
                             f"prefill sends pages_for(tokens)={n}")
        if peer is not None and not 0 <= peer < len(self.config.prefill_endpoints):
            raise ValueError(f"peer: prefill instance {peer} does not exist (have "
                             f"{len(self.config.prefill_endpoints)})")
        with self._lock:
            if rid in self._states:
                raise ValueError(f"rid: {rid!r} is already being transferred")
            self._states[rid] = TransferState(rid, TransferStatus.PENDING)
        x = _Xfer(rid, tokens.astype(WIRE_U32), pages.astype(WIRE_U32), peer, time.monotonic())
        self._cmds.append((self._cmd_submit, x))

    def reconnect(self, group: int, endpoints: Sequence[str]) -> None:
        """Prefill instance `group` (a restarted process) listens on `endpoints` now, one per
        rank as in `DecodeConfig.prefill_endpoints`: its channels move there and every rank of
        it gets a new HELLO. Transfers to the old process failed when it went silent."""
        self._check_alive()
        old = self.config.prefill_endpoints
        if not 0 <= group < len(old):
            raise ValueError(f"group: expected 0..{len(old) - 1}, got {group!r}")
        endpoints = tuple(endpoints)
        if len(endpoints) != len(old[group]) or not all(
                isinstance(a, str) and a.startswith("tcp://") for a in endpoints):
            raise ValueError(f"endpoints: expected {len(old[group])} tcp://host:port "
                             f"addresses, got {endpoints!r}")
        self._cmds.append((self._cmd_reconnect, group, endpoints))

    def silent_groups(self) -> frozenset[int]:
        """Prefill instances with a rank silent for more than peer_timeout_s (dead, or
        restarted on new addresses): safe to read from any thread."""
        return self._silent

    def status(self, rid: str) -> TransferState:
        """Any thread: the latest state; `received` is read live from the counters, and a
        transfer whose count reached exactly the expected number is SUCCESS from that moment
        (the messenger thread settles its slot at its next return)."""
        with self._lock:
            st = self._states.get(rid)
        if st is None:
            raise KeyError(f"rid: unknown request {rid!r}")
        counts = self._counts
        if st.slot >= 0 and counts is not None and st.status in _COUNTING:
            received = int(counts[st.slot])
            status = (TransferStatus.SUCCESS if _landed(st, counts) else
                      TransferStatus.TRANSFERRING if received else st.status)
            return TransferState(rid, status, st.reason, received, st.expected, st.slot)
        return st

    def ready(self) -> set[str]:
        """Level-triggered: requests whose every expected write landed (until `release`). The
        thread that counted the last write rang `news` (`Endpoint.set_news_fd`); a count past
        the expected number is a protocol error the messenger thread fails."""
        counts = self._counts
        with self._lock:
            return {r for r, s in self._states.items()
                    if s.status is TransferStatus.SUCCESS or _landed(s, counts)}

    def failed(self) -> set[str]:
        """Level-triggered: failed requests whose pages are safe to free (until `release`)."""
        with self._lock:
            return {r for r, s in self._states.items() if s.status is TransferStatus.FAILED}

    def aux(self, rid: str, index: int) -> np.ndarray:
        """The aux row `index` of a SUCCESS request, as a uint8 view (copy it before
        `release`: the row goes back with the slot)."""
        st = self.status(rid)
        if st.status is not TransferStatus.SUCCESS:
            raise ValueError(f"aux of {rid}: transfer is {st.status.value}, not success")
        return self._aux_raw[index][st.slot]

    def cancel(self, rid: str, reason: str = "cancelled by the engine") -> None:
        """Engine thread: give up on a transfer (client gone). It goes ABORTING, then FAILED
        once its pages are safe; free them only after `failed()` lists it."""
        self.status(rid)
        self._cmds.append((self._cmd_cancel, rid, reason))

    def release(self, rid: str) -> None:
        """Engine thread, once per SUCCESS or FAILED request when it leaves the transfer stage
        (after copying its aux rows): the messenger forgets it and reuses its slot. The engine
        still owns (and frees) the KV pages."""
        st = self.status(rid)
        if st.status not in (TransferStatus.SUCCESS, TransferStatus.FAILED):
            raise ValueError(f"release of {rid}: transfer is {st.status.value}; only success or "
                             f"failed requests can be released (use cancel first)")
        with self._lock:
            self._states.pop(rid, None)
        # quiet: the slot comes back at the thread's next wake-up (a timer at the latest).
        # Waking it here took the GIL from the engine thread right in the request's first
        # decode step, which follows the release
        slot = st.slot if st.status is TransferStatus.SUCCESS else -1
        self._cmds.post((self._cmd_release, rid, slot))

    def stats(self) -> dict[str, float]:
        """Any thread: a snapshot for health checks and tests. Idle means every slot is free
        (none quarantined, none counting) and no request is known."""
        slots = getattr(self, "_slots", None)
        with self._lock:
            known = len(self._states)
        return {"slots_total": self.config.max_inflight,
                "slots_free": slots.free if slots is not None else 0,
                "quarantined": len(slots.quarantined) if slots is not None else 0,
                "requests": known, "stale_writes": self._stale if slots is not None else 0,
                **self.tally.snapshot(),
                # the same per prefill instance ("prefill-N"; "prefill-?" before one was chosen)
                "by_prefill": {f"prefill-{g}" if g >= 0 else "prefill-?": t.snapshot()
                               for g, t in dict(self.tally_by_prefill).items()},
                "stalled_s": round(self.stalled_s(), 3), "lanes": self.config.receive_lanes,
                "longest_round_s": round(self.longest_round_s, 3),
                # shm: its waits sleep up to this between polls (0: poll_backoff_s), since every
                # prefill rank kicks them; and how many sleeps a kick ended
                "kick_sleep_s": getattr(self, "_kick_cap", 0.0),
                "kick_wakes": sum(ep.kick_wakes for ep in self._live_endpoints()),
                # tcp: sleeps that bytes arriving (or a command) ended, on the CQ's wait fd
                "fd_wakes": sum(ep.fd_wakes for ep in self._live_endpoints())}

    def _live_endpoints(self) -> list[Any]:
        eps = (getattr(self, "_ep", None), *getattr(self, "_lanes", []))
        return [ep for ep in eps if ep is not None and not ep.closed]

    @property
    def writes_per_op(self) -> int:
        """Page writes the prefill groups into one counted operation (after start-up)."""
        return self._writes_per_op

    def stalled_s(self) -> float:
        """As MessengerThread.stalled_s, counting the receive lanes' progress threads too: a lane
        stuck inside the provider holds its transfers as surely as a stuck messenger thread."""
        lanes = [lane.progress_stalled_s for lane in getattr(self, "_lanes", [])]
        return max([super().stalled_s(), *lanes])

    @property
    def lane_writes(self) -> list[int]:
        """Completions that arrived on each receive lane (the main endpoint first)."""
        eps = [getattr(self, "_ep", None), *getattr(self, "_lanes", [])]
        return [ep.remote_writes for ep in eps if ep is not None and not ep.closed]

    @property
    def stale_writes(self) -> int:
        """Writes that arrived for a slot generation no longer current (fenced, not counted)."""
        return self._stale

    # ================================================================ messenger thread
    def _setup(self) -> None:
        cfg = self.config
        self._timers_at = time.monotonic()  # the last liveness check (see _timers)
        self._ep = self._open_endpoint(max_slots=max(cfg.max_inflight, 1))
        limit = self._ep.iov_limit
        self._writes_per_op = min(cfg.writes_per_op or limit, limit)
        self._kv_mrs = [self._ep.register(b.addr, b.nbytes) for b in self._kv]
        # extra receive lanes: endpoints of the same domain using the same KV registrations,
        # counted into this endpoint's slots, each drained (on shm: copied) by a C thread
        self._lanes: list[Any] = []
        self._lane_info: list[dict[str, Any]] = []
        # shm: the waits sleep on a kick word the prefill ranks bump after posting writes
        self._kick = KickWord() if cfg.provider == "shm" and cfg.poll_backoff_s else None
        self._kicked_by: dict[tuple[int, int], bool] = {}  # prefill rank -> it kicks us
        if self._kick is None and self._ep.has_wait_fd:
            # tcp: the sleeps end when bytes arrive (the CQ's wait fd) or a command comes (its
            # pipe). A blind backoff sleep stalled the stream: the receiver's polls move it
            self._ep.set_wake_fd(self._cmds.wake_fd)
        else:  # the engine's commands kick it too (a private word without shm)
            self._sleep_on(self._kick.word if self._kick is not None else None)
        for _ in range(cfg.receive_lanes - 1):
            lane = self._ep.open_lane(**self.idle_options())
            self._lanes.append(lane)
            if self._kick is not None:
                lane.set_kick(self._kick.word)
            mrs = [lane.lane_region(m) for m in self._kv_mrs]
            lane.start_progress(**({"sleep_s": self.POLL_SLEEP_S}
                                   if self.config.poll_backoff_s else {}))
            self._lane_info.append({"fabric_name": lane.name,
                                    "regions": [m.descriptor().to_dict() for m in mrs]})
        self._aux_mrs = [self._ep.register(*_addr_len(a)) for a in self._aux_objs]
        self._regions = [m.descriptor().to_dict() for m in self._kv_mrs]
        self._aux_regions = [{**m.descriptor().to_dict(), "row_bytes": s.row_bytes}
                             for m, s in zip(self._aux_mrs, self._aux, strict=True)]
        self._slots = SlotTable(cfg.max_inflight, self._ep.recv_counts, self._ep.recv_gen,
                                cfg.quarantine_grace_s)
        self._ep.watch_targets(self._slots.expected)
        self._ep.set_news_fd(self.news.write_fd)  # a count reaching its target tells the engine
        self._counts = self._ep.recv_counts
        self._stale = 0
        codec = self._codec = Envelope(cfg.secret, self.identity, MESSENGER)
        lay = self.layout
        self._facts = facts(prefill=_spec_dict(cfg.peer_spec), decode=_spec_dict(cfg.spec),
                            layout=lay.to_dict(), num_layers=self.num_layers,
                            buffers_per_layer=cfg.buffers_per_layer, provider=cfg.provider,
                            aux_row_bytes=[a.row_bytes for a in self._aux])
        self._hello = {
            "role": "decode", "compat": compat_hash(self._facts), "provider": cfg.provider,
            "rank": cfg.rank, "num_parts": cfg.spec.attn_tp, "spec": _spec_dict(cfg.spec),
            "peer_spec": _spec_dict(cfg.peer_spec), "layout": lay.to_dict(),
            "num_layers": self.num_layers, "buffers_per_layer": cfg.buffers_per_layer,
            "aux_row_bytes": [a.row_bytes for a in self._aux], "fabric_name": self._ep.name,
            "regions": self._regions, "aux_regions": self._aux_regions,
            "lanes": self._lane_info, "writes_per_op": self._writes_per_op, "error": "",
            "kick": self._kick.path if self._kick is not None else "", "kicks": 0}
        assert self._ctx is not None
        self._chans = [[Channel.connect(self._ctx, codec, addr) for addr in group]
                       for group in cfg.prefill_endpoints]
        # per prefill rank: None until its HELLO came, then "" (it serves us) or its refusal
        self._peer_ok: dict[tuple[int, int], str | None] = {
            (g, r): None for g, group in enumerate(self._chans) for r in range(len(group))}
        for group in self._chans:
            for ch in group:
                ch.send("HELLO", self._hello, session=b"")
        self._poller = zmq.Poller()
        for group in self._chans:
            for ch in group:
                self._poller.register(ch.sock, zmq.POLLIN)
        self._poller.register(self._cmds.wake_fd, zmq.POLLIN)
        now = time.monotonic()
        self._clock = PeerClock(cfg.peer_timeout_s)
        for g, group in enumerate(self._chans):
            for r in range(len(group)):
                self._clock.heard((g, r), now)
        self._next_ping = 0.0
        self._waiting: list[_Xfer] = []      # submitted, no free slot yet
        self._xfers: dict[str, _Xfer] = {}   # holding a slot (active, quarantined or done)
        self._by_slot: dict[int, _Xfer] = {}
        self._bell_seen = int(self._cmds.bell[0])

    def _teardown(self) -> None:
        for group in getattr(self, "_chans", []):
            for ch in group:
                ch.close()
        self._cmds.kick = None
        lanes = getattr(self, "_lanes", [])
        for lane in lanes:
            lane.close()  # stops its thread first; it counts into the main endpoint's arrays
        ep = getattr(self, "_ep", None)
        if ep is not None:
            self._counts = None
            ep.close()
        kick = getattr(self, "_kick", None)
        if kick is not None and all(lane.closed for lane in lanes):
            kick.close()  # else a lane thread stuck in the provider may still sleep on it

    def _on_fatal(self, reason: str) -> None:
        with self._lock:
            for rid, st in list(self._states.items()):
                if st.status not in (TransferStatus.SUCCESS, TransferStatus.FAILED):
                    # the endpoint is going away: nothing can land any more
                    self._states[rid] = TransferState(rid, TransferStatus.FAILED,
                                                      f"messenger died: {reason}")
        self.news.ring()

    def _idle_wait(self, seconds: float) -> None:
        if seconds > 0:
            self._poller.poll(max(1, int(seconds * 1000)))  # sockets + the command doorbell
            self._cmds.drain_wakeups()

    def _set(self, x: _Xfer, status: TransferStatus, reason: str = "") -> None:
        if status in _SETTLED and x.status not in _SETTLED:
            outcome = (status is TransferStatus.SUCCESS, x.timed_out,
                       time.monotonic() - x.submitted)
            self.tally.settled(*outcome)
            self.tally_by_prefill.setdefault(x.group, TransferTally()).settled(*outcome)
        x.status = status
        x.reason = reason or x.reason
        received = self._slots.received(x.slot) if x.slot >= 0 else 0
        with self._lock:
            if x.rid in self._states:
                self._states[x.rid] = TransferState(x.rid, status, x.reason, received,
                                                    x.expected, x.slot)
        if status in (TransferStatus.SUCCESS, TransferStatus.FAILED):
            self.news.ring()  # ready() / failed() changed: wake the engine loop

    def _step(self) -> bool:
        if not self.config.busy_sleep_s and not self._cmds and self._slots.first_active() >= 0:
            # while writes are due, poll in C (the GIL released, an idle loop yields the core)
            # until a transfer completes, the engine sends a command, or a slice passes (control
            # messages and timers wait at most that long): the receiver's polling is what moves
            # bytes on shm (it does the copies), tcp and verbs. It compares the bell with its
            # value from just before the last commands were taken, which any command appended
            # since has changed; read here instead, a command queued in between waited out the
            # slice (and, before the C waits read their clock every round, 64 kicked sleeps:
            # 250-320 ms)
            self._ep.wait_complete(self._cmds.bell, self._bell_seen, self.POLL_SLICE_S)
        else:
            self._ep.poll()
        self._bell_seen = int(self._cmds.bell[0])  # before taking the commands: none is missed
        while self._cmds:
            cmd = self._cmds.popleft()
            handler, *args = cmd  # (bound handler, its arguments): no lookup by name
            handler(*args)
        for g, group in enumerate(self._chans):
            for r, ch in enumerate(group):
                for _peer, msg in ch.recv():
                    self._on_message(g, r, msg)
        slot_wait = self._start_waiting() if self._waiting else False
        for slot in self._slots.completed():
            x = self._by_slot[int(slot)]
            got = self._slots.received(x.slot)
            self._slots.finish(x.slot)
            if got > x.expected:
                self._fail(x, f"received {got} writes, expected {x.expected} (protocol error)")
            else:
                self._set(x, TransferStatus.SUCCESS)
        busy = self._slots.busy
        if self._lanes:
            self._ep.set_active(busy)  # the lanes poll eagerly only while writes may land
        return slot_wait or busy


def check_token_ids(rid: str, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A request's prompt as a 1-D integer array of uint32 ids (ValueError naming `rid`)."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and (not np.issubdtype(tokens.dtype, np.integer)
                                             or tokens.min() < 0 or tokens.max() >= 1 << 32)):
        raise ValueError(f"token_ids of {rid}: expected a list of uint32 token ids")
    return tokens


def _spec_dict(s: Any) -> dict[str, int]:
    return {"num_kv_heads": s.num_kv_heads, "tp": s.tp, "dp": s.dp}


def _addr_len(obj: Any) -> tuple[int, int]:
    b = as_buffer(obj)
    return b.addr, b.nbytes


def _view(obj: Any) -> Any:
    """A writable buffer over a tensor/array's memory (for reading aux rows)."""
    b = as_buffer(obj)
    import ctypes
    return (ctypes.c_uint8 * b.nbytes).from_address(b.addr)

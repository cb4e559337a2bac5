"""Prefill side of the KV messenger (docs/messenger.md, steps 2-5).

One `PrefillMessenger` per prefill attention rank. Every rank answers each decode rank's HELLO
(transfer.wire) once: its static data — sharding, layout, layers, regions, receive lanes,
writes per operation — is checked against this rank's configuration then (equal
compatibility hashes skip the deployment-wide checks; a refusal names the field and goes back
in our HELLO's `error`). The lead (rank 0) receives every decode rank's REQUEST part, checks
what is per request (pages, token ids, aux row, routes, expected counts: a bad part is refused
with an ABORTED naming the field), merges in that rank's HELLO data, and once all parts of a
request arrived hands it to the engine (`poll_requests`). The
engine broadcasts the `PrefillRequest` to its other TP ranks as it broadcasts any new request;
every rank then calls `bind(req, src_pages)` and picks from the parts what it must send.

Per forward pass (chunked prefill, page-aligned chunk boundaries) the engine calls
`begin_pass(chunks)` and then bumps the progress counter after each layer (`layer_done`, or
its CUDA graph writes the word `(pass_id << 16) | layers_done` into `progress` — one int64 so a
reader never sees a torn pass/layer pair). The messenger thread polls that word and, as soon as a
layer is in the cache, submits that layer's writes for every chunk of the pass (one C call per
chunk, layer buffer and destination). After the last chunk, `finish(rid, aux)` copies the
context rows (hidden states/logits) into registered staging rows; they are written to the
decoder's aux rows (counted writes too). When every write of this rank completed locally (per
destination tag, `send_done`), the request is in `done()` and the engine frees its pages.

Failures. The decoder's ABORT (its timeout, or another rank's failure), this side's own timeout,
a completion error, or a decode peer whose PINGs stopped for `peer_timeout_s` (its lease ran
out: it will quarantine our pages on its side) all abort the request: no further write is
issued, and once the writes already issued completed locally, ABORTED goes to every decode rank
of the request carrying how many writes were issued to it — the decoder keeps its pages
quarantined until that many have landed (transfer.plane.slots). An ABORT for a request this rank has
not bound yet leaves a tombstone: a later `bind` fails it at once, with no write. A dead decode
peer is removed from the address vector once nothing of it is in flight; writes to it that never
complete locally are given up after 2 × `peer_timeout_s` (counted as failed, their fabric tags
retired for good so a late completion cannot be credited to another request). On shm such
writes hold every other decode's too: an endpoint that settled none of its writes for
2 × `peer_timeout_s` is reset and its writes cancelled, counted as failed (`transfer.plane.stall`).

Thread contract: `poll_requests`, `bind`, `begin_pass`, `layer_done`, `finish`, `done`,
`result`, `release`, `abort` are called by the engine's thread; the messenger thread alone
touches the endpoint and the socket.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import zmq

from ..fabric import FabricError, RemoteRegion, WriteGroup, encode_imm
from ..geometry import slice_ops, writes_per_page
from ..kick import PeerKick
from ..layout import AuxSpec, KVLayout, LayoutError, as_buffer, aux_spec, write_plan
from ..plane.ledger import Account, LedgerFull, SendLedger
from ..plane.stall import StallWatch
from ..routes import (
    RouteError,
    ShardSpec,
    Slice,
    pages_for,
    routes_for,
    sendable,
)
from ..wire.channel import Channel
from ..wire.envelope import Envelope
from ..wire.handshake import compat_hash, first_difference
from ..wire.messenger import HELLO_STATIC, MESSENGER, facts, hello_facts
from .common import (
    LAYER_MASK,
    PASS_SHIFT,
    MessengerError,
    MessengerThread,
    PeerClock,
    PrefillConfig,
    PrefillResult,
)

log = logging.getLogger("transfer.messenger.prefill")
_U32 = np.dtype("<u4")
_HISTORY = 1 << 16
_BATCH_BYTES = 64 << 20   # bytes per write_batch call (bounds how long one call can block)


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


def peer_name(identity: bytes) -> str:
    """A peer's process name from its routing id (`CommonConfig.identity`: name, pid, nonce),
    e.g. `decode1-r0`: the same across the peer's restarts, so a metric label stays one series."""
    return identity.decode(errors="replace").rsplit("-", 2)[0]


def _by_peer_name(sent_to: dict[bytes, list[int]]) -> dict[str, tuple[int, int]]:
    """[operations, bytes] per routing id, summed per peer name (a restarted peer's ids)."""
    out: dict[str, tuple[int, int]] = {}
    for sender, (ops, nbytes) in sent_to.items():
        o, b = out.get(peer_name(sender), (0, 0))
        out[peer_name(sender)] = (o + ops, b + nbytes)
    return out


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


class PrefillMessenger(MessengerThread):
    """See the module docstring. `kv_buffers`: one tensor per layer (or per layer and K/V),
    all of the 5-D `layout`; `aux_buffers`: staging tensors `[rows, ...]`, one row per request
    bound at once, rows of the same byte size as the decoder's aux rows. The caller keeps the
    buffers alive until `close()`. `progress` is the int64 word the engine (or its graph)
    writes; pass `progress` to share one with other code, else one is allocated."""

    role = "prefill"
    # longest C wait for the engine (or for writes in flight) before control messages are
    # read: the timer period. Each return is a Python round that takes the GIL from the engine
    # thread between two of its torch ops; at 1 ms that was a thousand rounds a second of
    # prefill compute. A REQUEST arriving meanwhile waits at most this, about one forward pass
    # of the engine that would take it.
    WAIT_SLICE_S = MessengerThread.TIMER_S
    # the wait for an engine that announces its layers (`layer_done`) also watches the
    # control socket and the command pipe (`Endpoint.set_ctl_fd`): nothing it serves comes
    # without waking it, so this bounds only the timers, whose deadlines are seconds. At
    # WAIT_SLICE_S, a 2,000-token prefill's thread came back to Python twice per forward
    # pass, and its engine thread spent a tenth of each pass waiting for the GIL; at 50 ms,
    # once the engine announced only every 4 MiB, these returns were most of the thread's
    # rounds, and the engine thread still stalled 5-9 ms per 2,000-token prompt (2-4 ms at
    # 0.25 s; docs/benchmark-rounds.md, "Eighth round").
    ENGINE_WAIT_S = 0.25

    def __init__(self, config: PrefillConfig, kv_buffers: Sequence[Any], layout: str = "HND",
                 aux_buffers: Sequence[Any] = (), progress: np.ndarray | None = None) -> None:
        super().__init__(config)
        self.config: PrefillConfig = config
        self.layout = self._check_kv_buffers(kv_buffers, layout)
        self.num_layers = len(kv_buffers) // config.buffers_per_layer
        if self.num_layers > LAYER_MASK - 1:
            raise LayoutError(f"kv_buffers: at most {LAYER_MASK - 1} layers")
        self._kv = [as_buffer(b) for b in kv_buffers]
        self._aux_objs = list(aux_buffers)
        self._aux: list[AuxSpec] = [aux_spec(a) for a in aux_buffers]
        rows = {a.rows for a in self._aux}
        if len(rows) > 1:
            raise LayoutError(f"aux_buffers: all need the same number of rows, got {rows}")
        self._aux_free = list(range(rows.pop() - 1, -1, -1)) if rows else []
        self._aux_raw = [np.ctypeslib.as_array((ctypes.c_uint8 * b.nbytes).from_address(b.addr))
                         .reshape(s.rows, s.row_bytes)
                         for b, s in zip(map(as_buffer, aux_buffers), self._aux, strict=True)]
        self._keep = (list(kv_buffers), list(aux_buffers))
        if progress is None:
            progress = np.zeros(1, dtype=np.int64)
        if progress.dtype != np.int64 or progress.size < 1:
            raise ValueError("progress: expected an int64 array of at least one element")
        self.progress = progress
        self._pass_id = int(progress[0]) >> PASS_SHIFT
        self._ready_q: list[PrefillRequest] = []
        # lead: requests handed to the engine and not bound yet (its queue), rid -> each
        # decode part's (sender, slot, gen); PONGs list them, so a decoder's transfer
        # timeout counts from the bind, not from its REQUEST (a long prefill queue is not a
        # stuck transfer)
        self._handed: dict[str, tuple[tuple[bytes, int, int], ...]] = {}
        self._engine_kicks = False  # layer_done called: the engine kicks (see below)
        self._engine_seen = time.monotonic()  # the engine's last poll_requests (lead)
        self._bound: dict[str, int] = {}      # rid -> num_tokens (engine-side view)
        self._results: dict[str, PrefillResult] = {}
        self.identity = config.identity("prefill")
        self.address = ""
        self._start()

    # ================================================================ engine-thread API
    def poll_requests(self) -> list[PrefillRequest]:
        """Lead rank, engine thread: requests whose every decode part arrived (each once)."""
        self._check_alive()
        with self._lock:
            self._engine_seen = time.monotonic()
            out, self._ready_q = self._ready_q, []
            for r in out:
                self._handed[r.rid] = tuple((p["sender"], p["slot"], p["gen"])
                                            for p in r.parts)
        return out

    def refuse(self, req: PrefillRequest, reason: str) -> None:
        """Lead rank, engine thread: `req` (from poll_requests) will never be bound (the
        engine cannot hold it): its decoders get ABORTED with `reason` at once instead of
        waiting for their timeout. Other ranks: nothing to do (they answer the decoders'
        ABORTs)."""
        if self.config.rank == 0:
            self._cmds.append((self._cmd_refuse, req, reason))

    def bind(self, req: PrefillRequest, src_pages: Sequence[int] | np.ndarray) -> None:
        """Every rank, engine thread: `req` (from the lead's poll_requests, broadcast by the
        engine) got source pages `src_pages` (page i of the prompt is `src_pages[i]`)."""
        self._check_alive()
        pages = self.layout.check_pages(np.asarray(src_pages, dtype=np.int64).reshape(-1),
                                        f"src_pages of {req.rid}")
        if len(pages) != req.num_pages:
            raise ValueError(f"src_pages of {req.rid}: {len(pages)} pages, the request needs "
                             f"{req.num_pages}")
        with self._lock:
            if req.rid in self._bound or req.rid in self._results:
                raise ValueError(f"rid: {req.rid!r} is already bound")
            if self._aux and not self._aux_free:
                raise ValueError(f"aux_buffers: no free row for {req.rid}; give the aux "
                                 f"buffers as many rows as requests bound at once")
            row = self._aux_free.pop() if self._aux else -1
            self._bound[req.rid] = req.num_tokens
        self._cmds.append((self._cmd_bind, req, pages, row))

    def begin_pass(self, chunks: Sequence[tuple[str, int, int]]) -> int:
        """Every rank, engine thread, before a forward pass: `(rid, first_token, end_token)`
        of each scheduled chunk (tokens of the prompt minus its last token; `first_token` is a
        multiple of the page size, `end_token` too unless it ends the prompt). Resets the
        progress word to (new pass, 0 layers); returns the pass id. Beginning a pass declares
        the previous one complete (every layer of it is in the cache)."""
        self._check_alive()
        P = self.layout.page_size
        out = []
        with self._lock:
            for rid, lo, hi in chunks:
                n = self._bound.get(rid)
                if n is None:
                    raise ValueError(f"chunk of {rid!r}: request is not bound")
                todo = max(n - 1, 0)
                if lo % P or not 0 <= lo < hi <= todo or (hi % P and hi != todo):
                    raise ValueError(f"chunk of {rid!r}: tokens [{lo}, {hi}) must be page-"
                                     f"aligned (page size {P}) within the {todo} prefill tokens")
                out.append((rid, lo // P, math.ceil(hi / P)))
        self._pass_id += 1
        # quiet: the thread needs the pass only once its layers are done, and the progress
        # word that says so wakes it (bind rang, so it waits on that word by now)
        self._cmds.post((self._cmd_pass, _Pass(self._pass_id, out)))
        self.progress[0] = self._pass_id << PASS_SHIFT
        return self._pass_id

    def layer_done(self, layer: int) -> None:
        """Every rank, engine thread: layer `layer` of the current pass is in the cache."""
        self.progress[0] = (self._pass_id << PASS_SHIFT) | (layer + 1)
        if not self._engine_kicks and self._cmds.kick is not None:
            self._engine_kicks = True  # the word's writer is this thread: it kicks (below)
            self._cmds.append((self._cmd_engine_kicks,))
        if self._cmds.kick is not None:
            self._cmds.ring()  # the messenger thread's wait sleeps on its kick word or pipe

    def finish(self, rid: str, aux: Sequence[Any] = (), wake: bool = True) -> None:
        """Every rank, engine thread, after the pass holding the request's last chunk: its
        context rows (one bytes-like/tensor per aux buffer, each exactly one row) are copied
        to staging and written to the decoder after the KV pages. `wake=False`: the engine
        announces the pass's last layer (`layer_done`) right after, which wakes the thread
        anyway; it then writes that layer and the rows in one go."""
        with self._lock:
            if rid not in self._bound:
                raise ValueError(f"finish of {rid!r}: request is not bound")
        if len(aux) != len(self._aux):
            raise ValueError(f"finish of {rid}: {len(aux)} aux rows for {len(self._aux)} aux "
                             f"buffers")
        cmd = (self._cmd_finish, rid, [_row_bytes(a) for a in aux])
        if wake:
            self._cmds.append(cmd)
        else:
            self._cmds.post(cmd)

    def done(self) -> set[str]:
        """Level-triggered: requests whose writes from this rank all completed (or failed):
        the engine may free their source pages, then calls `release`."""
        with self._lock:
            return set(self._results)

    def result(self, rid: str) -> PrefillResult:
        with self._lock:
            r = self._results.get(rid)
        if r is None:
            raise KeyError(f"rid: {rid!r} is not done")
        return r

    def release(self, rid: str) -> None:
        """Engine thread, after freeing the pages of a request from `done()`."""
        with self._lock:
            if self._results.pop(rid, None) is None:
                raise ValueError(f"release of {rid!r}: request is not done")
            self._bound.pop(rid, None)

    def stats(self) -> dict[str, float]:
        """Any thread: a snapshot for health checks and tests. Idle means nothing bound or in
        flight, every aux row and fabric tag back (`leaked_tags` were retired for good)."""
        with self._lock:
            bound, aux_free = len(self._bound), len(self._aux_free)
        ledger = getattr(self, "_ledger", None)
        return {"bound": bound, "sending": len(getattr(self, "_reqs", ())),
                "assembling": len(getattr(self, "_assembling", ())),
                "aux_rows_free": aux_free, "tags_free": ledger.free if ledger else 0,
                "leaked_tags": ledger.leaked if ledger else 0,
                "stall_resets": self._stall.resets if hasattr(self, "_stall") else 0,
                "writes_issued": getattr(self, "writes_issued", 0),
                "ops_issued": getattr(self, "ops_issued", 0),
                "bytes_issued": getattr(self, "bytes_issued", 0),
                "write_errors": getattr(self, "write_errors", 0),
                # [operations, bytes] per decode peer, and the NIC (domain) that carried them
                "sent_to": _by_peer_name(dict(getattr(self, "sent_to", {}))),
                "nic": self._ep.domain if hasattr(self, "_ep") else "",
                "kicks": getattr(self, "kicks_sent", 0),
                "stalled_s": round(self.stalled_s(), 3),
                "longest_round_s": round(self.longest_round_s, 3)}

    def abort(self, rid: str, reason: str = "aborted by the prefill engine") -> None:
        """Engine thread: stop sending a bound request; it shows up in `done()` as failed."""
        self._cmds.append((self._cmd_abort, rid, reason))

    # ================================================================ messenger thread
    def _setup(self) -> None:
        cfg = self.config
        self._ep = self._open_endpoint(max_inflight_bytes=cfg.inflight_bytes)
        self._sleep_on()  # commands and layer_done (the CPU engine's progress) kick its waits
        self._kv_mrs = [self._ep.register(b.addr, b.nbytes, remote_write=False)
                        for b in self._kv]
        self._aux_mrs = [self._ep.register(as_buffer(a).addr, as_buffer(a).nbytes,
                                           remote_write=False) for a in self._aux_objs]
        assert self._ctx is not None
        self._chan = Channel.listen(self._ctx, Envelope(cfg.secret, self.identity, MESSENGER),
                                    cfg.bind_host, cfg.port,
                                    allow_any_interface=cfg.allow_any_interface)
        spec, peer = _spec_dict(cfg.spec), _spec_dict(cfg.peer_spec)
        aux_rows = [a.row_bytes for a in self._aux]
        self._facts = facts(prefill=spec, decode=peer, layout=self.layout.to_dict(),
                            num_layers=self.num_layers, buffers_per_layer=cfg.buffers_per_layer,
                            provider=cfg.provider, aux_row_bytes=aux_rows)
        self._hello = {
            "role": "prefill", "compat": compat_hash(self._facts), "provider": cfg.provider,
            "rank": cfg.rank, "num_parts": cfg.spec.attn_tp, "spec": spec, "peer_spec": peer,
            "layout": self.layout.to_dict(), "num_layers": self.num_layers,
            "buffers_per_layer": cfg.buffers_per_layer, "aux_row_bytes": aux_rows,
            "fabric_name": b"", "regions": [], "aux_regions": [], "lanes": [],
            "writes_per_op": min(self._ep.iov_limit, 64), "error": ""}
        # per decode peer (routing id): its checked HELLO static fields, or why it is refused
        self._peer_hello: dict[bytes, dict[str, Any] | str] = {}
        self._kicks: dict[bytes, PeerKick] = {}  # shm: decode ranks' kick words (transfer.kick)
        self.kicks_sent = 0
        self.address = self._chan.address
        self._idle_poller = zmq.Poller()
        self._idle_poller.register(self._chan.sock, zmq.POLLIN)
        self._idle_poller.register(self._cmds.wake_fd, zmq.POLLIN)
        self._ep.set_wake_fd(self._cmds.wake_fd)
        self._ep.set_ctl_fd(self._chan.sock.getsockopt(zmq.FD))
        self._ledger = SendLedger(min(self._ep.max_slots,
                                      cfg.max_requests * cfg.peer_spec.attn_tp),
                                  lambda tag: int(self._ep.send_done[tag]))
        self._clock = PeerClock(cfg.peer_timeout_s)
        # shm: a decode that died with writes in flight holds every other decode's (stall.py)
        # as long as a dead peer's writes are given at most (see the module docstring)
        self._stall = StallWatch([self._ep], 2 * cfg.peer_timeout_s)
        self._assembling: dict[str, _Assembly] = {}
        self._reqs: dict[str, _Req] = {}
        self._passes: list[_Pass] = []
        self._unserved = 0  # bytes written since the control socket was last served
        self._queued: list[tuple[_Req, _Dest, int, Any]] = []  # for _flush_writes
        # keyed by transfer: (rid, decode sender, slot, gen), so a retried rid is a new one
        self._tombstones: dict[tuple[str, bytes, int, int], float] = {}
        self._history: OrderedDict[tuple[str, bytes, int, int], tuple[int, int]] = \
            OrderedDict()
        self._peers: dict[bytes, int] = {}      # fabric name -> fi_addr
        self._dead_names: set[bytes] = set()
        self.writes_issued = 0  # page writes (iov entries)
        self.ops_issued = 0     # RMA operations: what decoders count
        self.bytes_issued = 0   # KV and aux bytes those operations carry
        self.write_errors = 0   # operations that completed with an error
        # per decode peer (its routing id; `stats` names it): [operations, bytes] sent to it
        self.sent_to: dict[bytes, list[int]] = {}
        self._bell_seen = 0
        self._word_seen = int(self.progress[0])
        self._engine_wait_s = self.WAIT_SLICE_S  # ENGINE_WAIT_S once the engine kicks

    def _teardown(self) -> None:
        ch = getattr(self, "_chan", None)
        if ch is not None:
            ch.close()
        self._cmds.kick = None
        ep = getattr(self, "_ep", None)
        if ep is not None:
            ep.close()
        for kick in getattr(self, "_kicks", {}).values():
            kick.close()

    def _on_fatal(self, reason: str) -> None:
        with self._lock:
            for rid in self._bound:
                self._results.setdefault(rid, PrefillResult(rid, False,
                                                            f"messenger died: {reason}"))
        self.news.ring()

    def _idle_wait(self, seconds: float) -> None:
        if seconds > 0:
            self._idle_poller.poll(max(1, int(seconds * 1000)))  # socket + command doorbell
            self._cmds.drain_wakeups()

    def _step(self) -> bool:
        waiting = bool(self._reqs or self._passes) and not self.config.busy_sleep_s
        if waiting and not self._cmds and self._settling() and self._ep.inflight:
            # writes in flight: poll in C (GIL released, idling by poll_backoff_s) until they
            # all completed, the progress word moved or a command came; before, 0.2 ms slices
            # of wait_idle came back to Python (and the GIL) 5,000 times a second while the
            # engine computed its next pass
            self._ep.wait_idle_or_change(self.progress, self._word_seen, self._cmds.bell,
                                         self._bell_seen, timeout=self.WAIT_SLICE_S)
        elif waiting and not self._cmds and not self._chan.pending():
            # nothing in flight, or nothing waits for its completions (every request is still
            # being prefilled; the polls here drain them): the engine is computing (next
            # layer, pass or finish). Wait in C for the progress word, a command or (once
            # the engine announces its layers) a control message, sleeping between polls. A
            # Python loop of poll() here spun a core the engine needs and contended for its
            # GIL, and so did coming back to Python when a pass's writes completed, which
            # nothing then needed.
            self._ep.wait_change(self.progress, self._word_seen, self._cmds.bell,
                                 self._bell_seen, timeout=self.WAIT_SLICE_S
                                 if self._chan.holding else self._engine_wait_s)
        else:
            self._ep.poll()
        self._bell_seen = int(self._cmds.bell[0])  # before draining: no wake-up is lost
        self._word_seen = int(self.progress[0])    # _progress reads it (again) below
        while self._cmds:
            cmd = self._cmds.popleft()
            handler, *args = cmd  # (bound handler, its arguments): no lookup by name
            handler(*args)
        self._serve_socket()
        if self._passes:
            self._progress()
        if self._reqs:
            self._check_requests()  # submits what _progress queued (only bound requests')
        return bool(self._passes or self._reqs)

    def _serve_socket(self) -> None:
        """Handle the control messages waiting now. Each step does, and so does
        `_flush_writes` once `_BATCH_BYTES` went since: a pass can hold GiBs of writes, and
        PINGs, REQUESTs and ABORTs must not wait for all of it. Not before every write call:
        each receive releases the GIL, and taking it back mid forward pass made the engine
        thread wait."""
        self._unserved = 0
        for peer, msg in self._chan.recv():
            self._on_message(peer, msg)

    def _settling(self) -> bool:
        """Whether a request settles once its writes complete (its aux rows went, or it is
        being aborted): only then must the wait return when nothing is in flight."""
        return any(x.aux_sent or x.state == "aborting" for x in self._reqs.values())

    # -- lead: assembling requests ----------------------------------------------------------
    def _on_message(self, peer: bytes, msg: Any) -> None:
        now = time.monotonic()
        self._clock.heard(peer, now)
        try:
            if msg.type == "PING":
                self._chan.send("PONG", {"queued": self._queued_for(peer)}, peer=peer)
            elif msg.type == "HELLO":
                self._on_hello(peer, msg)
            elif msg.type == "REQUEST":
                self._on_request(peer, msg.body, now)
            elif msg.type == "ABORT":
                self._on_abort(peer, msg.body, now)
        except Exception:  # a well-signed but unforeseen message must not stop the thread
            log.exception("prefill rank %d: dropped a %s from %r", self.config.rank, msg.type,
                          peer)
            self._chan.rejected += 1

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
        tokens = np.frombuffer(lead["token_ids"], dtype=_U32).copy()
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
        pages = np.frombuffer(b["dst_pages"], dtype=_U32)
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

    # -- every rank: binding and sending ----------------------------------------------------
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
        dpages = np.frombuffer(p["dst_pages"], dtype=_U32)
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
        # queued only: _check_requests, next, submits them with any aux rows in one call

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

    # -- timers -----------------------------------------------------------------------------
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


def _spec_dict(s: ShardSpec) -> dict[str, int]:
    return {"num_kv_heads": s.num_kv_heads, "tp": s.tp, "dp": s.dp}


def _slices(b: dict[str, Any]) -> list[Slice]:
    return [Slice(src_rank=s["src_rank"], dst_rank=b["dst_rank"], head_lo=s["head_lo"],
                  num_heads=s["num_heads"], src_head_off=s["src_head_off"],
                  dst_head_off=s["dst_head_off"]) for s in b["slices"]]


def _row_bytes(a: Any) -> bytes:
    if hasattr(a, "detach"):  # torch tensor
        a = a.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy()
    return bytes(memoryview(np.ascontiguousarray(a)).cast("B"))


__all__ = ["MessengerError", "PrefillMessenger", "PrefillRequest"]

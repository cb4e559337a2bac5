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
its CUDA graph writes the word `(pass_id << 32) | layers_done` into `progress` — one int64 so a
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

Modules: this one is the engine's API and the thread's loop; what the thread does lives in two
halves of the same object, `prefill_control.py` (HELLO and REQUEST checks, assembly, ABORTs)
and `prefill_writer.py` (destinations, page writes, their ledger accounts and timers).
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from ..kick import PeerKick
from ..layout import AuxSpec, LayoutError, as_buffer, aux_spec
from ..plane.ledger import SendLedger
from ..plane.stall import StallWatch
from ..routes import (
    ShardSpec,
)
from ..wire.channel import Channel
from ..wire.envelope import Envelope
from ..wire.handshake import compat_hash
from ..wire.messenger import MESSENGER, facts
from .common import (
    LAYER_MASK,
    PASS_SHIFT,
    MessengerError,
    MessengerThread,
    PeerClock,
    PrefillConfig,
    PrefillResult,
)
from .prefill_control import PrefillControl, PrefillRequest, _Assembly
from .prefill_writer import PrefillWriter, _Dest, _Pass, _Req

log = logging.getLogger("transfer.messenger.prefill")


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


class PrefillMessenger(PrefillControl, PrefillWriter, MessengerThread):
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

        # queued only: _check_requests, next, submits them with any aux rows in one call

def _spec_dict(s: ShardSpec) -> dict[str, int]:
    return {"num_kv_heads": s.num_kv_heads, "tp": s.tp, "dp": s.dp}


def _row_bytes(a: Any) -> bytes:
    if hasattr(a, "detach"):  # torch tensor
        a = a.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy()
    return bytes(memoryview(np.ascontiguousarray(a)).cast("B"))


__all__ = ["MessengerError", "PrefillMessenger", "PrefillRequest"]

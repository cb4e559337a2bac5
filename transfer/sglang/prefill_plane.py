"""Prefill-side data plane of the SGLang backend: per-peer queues, grouped writes, accounting.

One writer thread per prefill rank owns the endpoint. SGLang's scheduler hands it chunks
(`PdtoolKVManager.add_transfer_request`); it turns each into writes per decode rank and queues
them on that rank's `PeerQueue`. Then, round-robin over the peers with work:

* each peer has its own budget of bytes in flight (`PEER_BUDGET_BYTES`, estimated from the
  operations submitted and completed on its tags), and each `write_batch` call waits at most
  `SUBMIT_SLICE_S` for the provider's queue: a slow or dead decode keeps its own queue full and
  its own rooms waiting, never the others' (before, one writer blocked up to 30 s on the first
  full queue it met);
* consecutive writes of a (room, decode rank, layer buffer) are grouped `per_op` to one RMA
  operation (one completion on each side), `per_op` being the smaller iov limit of the two
  endpoints, which the decode learns with the PEER reply. Operations start at multiples of
  `per_op` from the room's first write (`transfer.routes.sendable`), so a chunk ending inside
  a group holds those writes back until the next chunk: the decoder's count never depends on
  how the prompt was chunked.

Several NICs (`rails.py`): a rank may have one endpoint per NIC and the decode rank too. Each
submission (a slice of one batch, at most `STRIPE_BYTES` when there are several paths) goes to
the (local rail, remote endpoint) path whose local endpoint has the fewest bytes in flight,
ties in turn; its writes use that rail's registration of the same memory and the decode
endpoint's keys for it. The decoder's endpoints count into one slot table, so an operation is
counted once whichever NIC carried it and the expected count is unchanged. A tag's local
completions are the sum of its `send_done` over the rails. Staged writes (bounce buffers,
landing areas: staging_plane.py) take the same chooser and stripes (`route`) and are counted
the same way (`posted`).

Accounting: every (room, decode rank) has one fabric tag. An operation is settled when its
local completion counts `send_done[tag]` or its completion error arrives (`Endpoint.errors`,
one entry per failed operation). Before, a failed operation was never counted, so its room,
its tag and a deferred abort's ACK waited forever. A room whose writes stop completing for
`stuck_s` (a dead decode) is failed; if they still do not complete within another `stuck_s`,
its tags are retired for good (a late completion must not be credited to another room) and
SGLang is told the room cannot be proven quiescent (`poison_deferred_ack_room`). On shm a
decode that died with writes in flight holds every other decode's too: an endpoint that settled
none of its writes for `stall_s` (SGLang's heartbeat window) is reset, its writes cancelled and
counted as failed (`transfer.plane.stall`). A peer whose writes the provider refuses for as
long with none in flight (rxm over tcp, after the decode died) fails its queued rooms
(`_refusals`).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from transfer import fabric
from transfer.plane.ledger import Account, SendLedger
from transfer.plane.stall import StallWatch
from transfer.routes import sendable
from transfer.sglang.metrics import NO_METRICS
from transfer.wakeups import CommandQueue

logger = logging.getLogger(__name__)

PEER_BUDGET_BYTES = fabric.DEFAULT_MAX_INFLIGHT_BYTES // 4
SUBMIT_SLICE_S = 0.002
IDLE_WAIT_S = 0.05
STRIPE_BYTES = 1 << 20  # largest slice one path takes at a time when a peer has several


@dataclass
class Send(Account):
    """This rank's writes of one room to one decode rank: its account on one fabric tag
    (`transfer.plane.ledger`; bounce buffers whose writes completed are `credited`)."""

    room: int
    peer: str
    imm: int
    per_op: int
    issued_bytes: int = 0
    queued: int = 0           # batches waiting in the peer's queue
    # writes held back per layer-buffer group: (src, dst, len) not yet a whole operation
    tails: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    # layer buffer -> the decoder's page positions already planned: with layer streaming
    # (layer_stream.py) every (page, buffer) is written once, by whichever of the layer part
    # or the chunk reached the writer first (a chunk may come first: then it must mark too)
    planned: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass
class Batch:
    """Writes of one Send into one layer buffer, submitted in slices as the budget allows."""

    send: Send
    fi_addr: int
    mr: Any
    region: fabric.RemoteRegion
    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    at: int = 0


@dataclass
class PeerQueue:
    key: str
    batches: deque[Batch] = field(default_factory=deque)
    sends: set[int] = field(default_factory=set)  # tags with writes (possibly) in flight
    # since when the provider has refused every write to this peer while none of ours was in
    # flight to it (`_refusals`)
    refused_since: float | None = None


@dataclass
class RoomSends:
    """A room's sends on this rank, and what SGLang said about it."""

    room: int
    sends: dict[str, Send] = field(default_factory=dict)
    last_seen: bool = False
    started: float = field(default_factory=time.monotonic)
    progress_at: float = field(default_factory=time.monotonic)  # last completion or submit
    done_seen: int = 0
    failed_at: float | None = None


def _ops(writes: int, per_op: int) -> int:
    return -(-writes // per_op)


class PrefillPlane:
    """Queues, tags and accounting of one prefill rank's writes (writer thread only, except
    `put`, `stats` and the room lock callers). `mgr` is the PdtoolKVManager."""

    def __init__(self, mgr: Any, ep: fabric.Endpoint, max_tags: int, send_timeout_s: float,
                 stuck_s: float, staging: Any, rails: Any = None,
                 stall_s: float | None = None) -> None:
        from transfer.sglang.rails import Rails

        self.mgr = mgr
        self.ep = ep
        self.staging = staging  # staging_plane.PrefillStaging: packed slices, bounce buffers
        self.rails: Rails = rails if rails is not None else Rails([ep], ["default"])
        self.rail_ops = [0] * len(self.rails)  # operations each local rail carried
        # per NIC and decode peer on SGLang's /metrics (--enable-metrics; transfer.sglang.metrics)
        self.metrics = getattr(mgr, "metrics", NO_METRICS)
        self.sends_written = 0  # (room, decode rank) sends that issued an operation
        # chunks and layer parts from SGLang's scheduler and the layer thread; appending
        # writes a byte to its pipe, which ends the writer's sleep (`_wait`)
        self.chunks = CommandQueue()
        self.ledger = SendLedger(max_tags, self.rails.send_done)
        self.rooms: dict[int, RoomSends] = {}
        self.queues: dict[str, PeerQueue] = {}
        self.send_timeout_s = send_timeout_s
        self.stuck_s = stuck_s
        # shm: a decode that died with writes in flight holds every other decode's (stall.py)
        self.stall = StallWatch(self.rails.eps, stall_s or stuck_s)
        self._rr = 0
        self._path_rr = 0

    # -- writer thread: intake ----------------------------------------------------------------
    def take(self, chunk: Any) -> None:
        """One SGLang chunk: wait for the pages it reads, then queue its writes per peer."""
        mgr, room = self.mgr, chunk.room
        # early send of a cached prefix under overlap scheduling: the previous forward may
        # still write these pages; a room that already failed skips the wait
        if chunk.wait_event is not None and \
                mgr.request_status.get(room) not in (None, KVPoll.Failed):
            chunk.wait_event.synchronize()
        if chunk.indices_event is not None:
            chunk.indices_event.synchronize()  # the page ids' device->host copy
        kv = chunk.kv_indices
        if hasattr(kv, "numpy"):
            kv = kv.numpy()
        kv = np.asarray(kv, dtype=np.int32)
        with mgr.room_lock:
            # the status check and the in-flight mark are one step: an ABORT handled in
            # between would be ACKed while these writes then land in released pages
            status = mgr.request_status.get(room)
            if status is None or status == KVPoll.Failed:
                return
            if getattr(chunk, "buffers", None) is not None and \
                    status not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                return  # a layer part after its room finished: the chunks sent it all
            rs = self.rooms.get(room)
            if rs is None:
                rs = self.rooms[room] = RoomSends(room)
                mgr._staging_outstanding[room] = 1
            mgr.update_status(room, KVPoll.Transferring)
        try:
            for target in list(mgr.transfer_infos.get(room, {}).values()):
                if not target.is_dummy:
                    self._plan(rs, chunk, kv, target)
        except (fabric.FabricError, ValueError, RuntimeError) as exc:
            self.fail(room, f"pdtool transfer: {exc}")
        if chunk.is_last:
            rs.last_seen = True

    def _send_of(self, rs: RoomSends, peer: Any, target: Any) -> Send:
        s = rs.sends.get(peer.key)
        if s is None:
            imm = fabric.encode_imm(target.slot, target.gen)
            s = self.ledger.open(partial(Send, room=rs.room, peer=peer.key, imm=imm,
                                         per_op=peer.per_op))
            rs.sends[peer.key] = s
            self.queues.setdefault(peer.key, PeerQueue(peer.key)).sends.add(s.tag)
        return s

    def _plan(self, rs: RoomSends, chunk: Any, kv: np.ndarray, t: Any) -> None:
        mgr = self.mgr
        peer = mgr.peers.get(t.peer)
        if peer is None:  # replaced by a restarted rank since its META arrived
            raise ValueError(f"decode {t.peer} is gone (a new rank registered for its GPU)")
        sent = chunk.index_slice.stop or 0
        if chunk.is_last and sent != len(t.kv_indices):
            # the decoder counts writes for every page it allocated: fail now, not at timeout
            raise ValueError(f"prefill sends {sent} pages but decode {t.peer} allocated "
                             f"{len(t.kv_indices)}; it would never complete")
        fi_addr = self._addr(peer, (0, 0))
        s = self._send_of(rs, peer, t)
        q = self.queues[peer.key]
        if (peer.slice is not None or peer.draft_slice is not None) \
                and (len(kv) or chunk.is_last):
            positions = np.arange(len(t.kv_indices))[chunk.index_slice]
            src_pages = kv[: len(positions)]
            positions = positions[: len(src_pages)]
            # one write per (page, layer buffer): from the pool, or packed into a bounce
            # buffer first where the slice is not a whole page of it (staging_plane); a
            # layer part (layer_stream.py) covers its layer's buffers only; a draft model's
            # buffers (the last ones) with their own slice, or none from this rank
            buffers = getattr(chunk, "buffers", None)
            for i in range(len(mgr.kv_layouts)) if buffers is None else buffers:
                if peer.buffer_slice(i) is None:
                    continue
                # every (page, buffer) is planned once, whichever of a layer part and the
                # chunk after the forward reaches this thread first (either order happens)
                pages, pos = self._unplanned(s, i, len(t.kv_indices), src_pages, positions)
                gather, region, plan = self.staging.writes(peer, t, pages, pos, i)
                so, do, ln = self._with_tail(s, i, plan)
                n = len(ln) if chunk.is_last else sendable(0, len(ln), len(ln) + 1, s.per_op)
                if n < len(ln):
                    s.tails[i] = (so[n:], do[n:], ln[n:])
                if n and gather:  # read from a bounce buffer once packed (staging_plane)
                    self._queue(q, self.staging.batch(s, fi_addr, i, region, peer,
                                                      (so[:n], do[:n], ln[:n])))
                elif n:
                    self._queue(q, Batch(s, fi_addr, mgr.kv_mrs[i], region, so[:n], do[:n],
                                         ln[:n]))
        if chunk.is_last and peer.sends_aux and chunk.aux_index is not None \
                and t.aux_index is not None:
            one = np.ones(1, dtype=np.uint64)
            for mr, region, ilen in zip(mgr.aux_mrs, peer.aux_regions, peer.aux_item_lens,
                                        strict=True):
                b = Batch(s, fi_addr, mr, region, one * (chunk.aux_index * ilen),
                          one * (t.aux_index * ilen), one * ilen)
                self._queue(q, b)

    @staticmethod
    def _unplanned(s: Send, buffer: int, num_pages: int, pages: np.ndarray,
                   positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pages of `positions` not yet planned for `buffer`, now marked planned."""
        done = s.planned.get(buffer)
        if done is None:
            done = s.planned[buffer] = np.zeros(num_pages, dtype=bool)
        keep = ~done[positions]
        done[positions] = True
        return pages[keep], positions[keep]

    def _addr(self, peer: Any, path: tuple[int, int]) -> int:
        """fi_addr of the decode's endpoint path[1] on local rail path[0] (inserted once)."""
        addr = peer.addrs.get(path)
        if addr is None:
            i, j = path
            addr = peer.addrs[path] = self.rails.eps[i].insert_peer(peer.rails[j].fabric_name)
        return addr

    def route(self, b: Any, lengths: np.ndarray, per_op: int
              ) -> tuple[int, fabric.Endpoint, int, Any, fabric.RemoteRegion, int]:
        """Where the next submission of `b` (a Batch or a staging_plane.StagedBatch) goes and
        how many of its next writes (`lengths`) it takes: (local rail, its endpoint, fi_addr,
        local registration, remote region, writes). All of them on one path; with several
        local rails a stripe of at most STRIPE_BYTES (whole operations, at least one), so the
        rest goes to the next path chosen."""
        rail, ep, fi_addr, mr, region = self._route(b)
        n = len(lengths)
        if rail or len(self.rails) > 1:
            csum = np.cumsum(lengths, dtype=np.uint64)
            stripe = int(np.searchsorted(csum, STRIPE_BYTES, side="right"))
            n = min(n, max(per_op, stripe // per_op * per_op))
        return rail, ep, fi_addr, mr, region, n

    def posted(self, s: Send, rail: int, ops: int, nbytes: int, writes: int) -> None:
        """`ops` operations of `s` (`writes` writes, `nbytes` in all) went out on local rail
        `rail`: each is counted once, on the rail that carried it and in what the decoder
        counts."""
        if ops and not s.issued:
            self.sends_written += 1
        s.issued += ops
        s.issued_bytes += nbytes
        self.rail_ops[rail] += ops
        self.metrics.posted(self.rails.labels[rail], s.peer, ops, writes, nbytes)

    def _paths(self, peer: Any) -> list[tuple[int, int]]:
        m, n = len(self.rails), max(1, len(peer.rails))
        return [(k % m, k % n) for k in range(max(m, n))]

    def _route(self, b: Batch) -> tuple[int, fabric.Endpoint, int, Any, fabric.RemoteRegion]:
        """The path for the next slice of `b`: the fewest bytes in flight on its local rail,
        ties in turn; only paths where both sides registered the batch's memory."""
        peer = self.mgr.peers.get(b.send.peer)
        if peer is None or (len(self.rails) == 1 and len(peer.rails) <= 1):
            return 0, self.ep, b.fi_addr, b.mr, b.region
        paths = self._paths(peer)
        best = None
        for turn in range(len(paths)):
            i, j = paths[(self._path_rr + turn) % len(paths)]
            mr, region = self.rails.twin(b.mr, i), peer.remote_twin(b.region, j)
            if mr is None or region is None:
                continue
            load = self.rails.eps[i].inflight_bytes
            if best is None or load < best[0]:
                best = (load, i, j, mr, region)
        if best is None:
            return 0, self.ep, b.fi_addr, b.mr, b.region
        _, i, j, mr, region = best
        self._path_rr += 1
        return i, self.rails.eps[i], self._addr(peer, (i, j)), mr, region

    @staticmethod
    def _with_tail(s: Send, key: Any, plan: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        tail = s.tails.pop(key, None)
        if tail is None:
            return plan
        return tuple(np.concatenate([a, b]) for a, b in zip(tail, plan, strict=True))

    def _queue(self, q: PeerQueue, b: Batch) -> None:
        b.send.queued += 1
        q.batches.append(b)

    # -- writer thread: submission ------------------------------------------------------------
    def _inflight_bytes(self, q: PeerQueue) -> int:
        total = 0
        for tag in q.sends:
            s = self.ledger.owner(tag)
            if s is not None and s.issued:
                total += self.ledger.in_flight(s) * s.issued_bytes // s.issued
        return total

    def submit(self) -> bool:
        """Round-robin over the peers with queued writes; True when something was posted."""
        keys = [k for k, q in self.queues.items() if q.batches]
        if not keys:
            return False
        posted = False
        self._rr = (self._rr + 1) % len(keys)
        for key in keys[self._rr:] + keys[: self._rr]:
            posted |= self._submit_peer(self.queues[key])
        return posted

    def _submit_peer(self, q: PeerQueue) -> bool:
        mgr, posted, refused = self.mgr, False, False
        while q.batches:
            b = q.batches[0]
            s = b.send
            rs = self.rooms.get(s.room)
            if rs is None or rs.failed_at is not None \
                    or mgr.request_status.get(s.room) in (None, KVPoll.Failed):
                q.batches.popleft()  # failed or cleared: issue nothing more for it
                s.queued -= 1
                if getattr(b, "staged", False):
                    self.staging.drop(b)
                continue
            in_flight = self._inflight_bytes(q)
            if in_flight >= PEER_BUDGET_BYTES:
                break
            if getattr(b, "staged", False):  # reads bounce buffers: gathered, then posted
                try:
                    moved, finished = self.staging.step(q.batches, PEER_BUDGET_BYTES
                                                        - in_flight, SUBMIT_SLICE_S, self)
                except (fabric.FabricError, ValueError, RuntimeError) as exc:
                    q.batches.popleft()
                    s.queued -= 1
                    self.staging.drop(b)
                    self.fail(s.room, f"pdtool staged write to decode {s.peer} failed: {exc}")
                    continue
                if moved:
                    posted = True
                    rs.progress_at = time.monotonic()
                if not finished:
                    break  # waiting for a copy, a bounce buffer or the provider
                q.batches.popleft()
                s.queued -= 1
                continue
            k, n_left = s.per_op, len(b.lengths) - b.at
            # as many whole operations as the budget takes (at least one)
            csum = np.cumsum(b.lengths[b.at:], dtype=np.uint64)
            fit = int(np.searchsorted(csum, PEER_BUDGET_BYTES - in_flight, side="right"))
            n = min(n_left, max(k, fit // k * k))
            a, rail = b.at, 0
            try:
                rail, ep, fi_addr, mr, region, n = self.route(b, b.lengths[a:a + n], k)
                nops = ep.write_batch(fi_addr, mr, region, b.src[a:a + n], b.dst[a:a + n],
                                      b.lengths[a:a + n], imm=s.imm, tag=s.tag,
                                      per_op=min(k, n), timeout=SUBMIT_SLICE_S)
                done, err = n, None
            except fabric.FabricError as exc:
                done = int(getattr(exc, "submitted", 0))
                nops, err = _ops(done, k), exc
            except ValueError as exc:  # a region the decode announced does not fit the write
                q.batches.popleft()
                s.queued -= 1
                self.fail(s.room, f"pdtool write to decode {s.peer} refused: {exc}")
                continue
            self.posted(s, rail, nops, int(b.lengths[a:a + done].sum()), writes=done)
            b.at += done
            if done:
                posted = True
                rs.progress_at = time.monotonic()
            if b.at >= len(b.lengths):
                q.batches.popleft()
                s.queued -= 1
            if err is not None:
                if err.errno == 110:  # ETIMEDOUT: this peer's queue is full; serve the others
                    refused = not done and not in_flight
                    break
                self.fail(s.room, f"pdtool write to decode {s.peer} failed: {err}")
        self._refusals(q, refused and not posted)
        return posted

    def _refusals(self, q: PeerQueue, refused: bool) -> None:
        """Fail the queued rooms of a peer whose writes the provider has refused for the
        stall window (`stall.after_s`, SGLang's heartbeat window) with none of ours in flight
        to it. A full queue with nothing in flight is no back-pressure: rxm over tcp answers
        a connection the decode's death closed this way, for every later write, and reports
        no error (measured on libfabric 1.17). Before, those rooms waited `stuck_s` (SGLang's
        waiting timeout, 300 s by default) to fail."""
        now = time.monotonic()
        if not refused:
            q.refused_since = None
        elif q.refused_since is None:
            q.refused_since = now
        elif now - q.refused_since > self.stall.after_s:
            reason = (f"pdtool write to decode {q.key} failed: the provider refused every "
                      f"write to it for {self.stall.after_s:.0f} s with none in flight (its "
                      f"connection is gone: decode dead?)")
            for room in {b.send.room for b in q.batches}:
                self.fail(room, reason)
            q.refused_since = None

    # -- writer thread: settling --------------------------------------------------------------
    def settle(self) -> None:
        mgr = self.mgr
        self.stall.check(time.monotonic())  # its cancelled writes are among the errors below
        for tag, errno, message in self.rails.errors():
            if self.staging.owns_tag(tag):
                s = self.staging.failed_write(tag)
                if s is not None:
                    s.errored += 1
            else:
                s = self.ledger.failed(tag)
            if s is None:
                continue
            self.metrics.write_failed(s.peer)
            self.fail(s.room, f"pdtool write to decode {s.peer} failed: {message} ({errno})")
        self.staging.reclaim()  # bounce buffers whose writes completed credit their Send
        now = time.monotonic()
        for room, rs in list(self.rooms.items()):
            done = sum(self.ledger.completed(s) for s in rs.sends.values())
            if done != rs.done_seen:
                rs.done_seen, rs.progress_at = done, now
            drained = all(self.ledger.drained(s) for s in rs.sends.values())
            status = mgr.request_status.get(room)
            failed = rs.failed_at is not None or status in (None, KVPoll.Failed)
            queued = any(s.queued for s in rs.sends.values())
            if drained and (failed or (rs.last_seen and not queued)):
                self._finish(rs, ok=not failed)
            elif not failed and not rs.last_seen and now - rs.started > self.send_timeout_s:
                self.fail(room, "pdtool: prefill chunks stopped arriving")
            elif (queued or not drained) and now - rs.progress_at > self.stuck_s:
                if not failed:
                    self.fail(room, f"pdtool: writes to decode made no progress for "
                                    f"{self.stuck_s:.0f} s (decode dead?)")
                    rs.progress_at = now
                elif not drained:  # still in flight: give its tags up for good
                    self._finish(rs, ok=False, leak=True)

    def fail(self, room: int, reason: str) -> None:
        rs = self.rooms.get(room)
        if rs is not None and rs.failed_at is None:
            rs.failed_at = time.monotonic()
        if self.mgr.request_status.get(room) not in (None, KVPoll.Failed):
            logger.warning("pdtool room %s: %s", room, reason)
        self.mgr.fail_room(room, reason)

    def _finish(self, rs: RoomSends, ok: bool, leak: bool = False) -> None:
        mgr = self.mgr
        for s in rs.sends.values():
            self.ledger.close(s, leak=leak)
            q = self.queues.get(s.peer)
            if q is not None:
                q.sends.discard(s.tag)
                if not q.sends and not q.batches:
                    del self.queues[s.peer]
            if leak:
                self.staging.leak(s)
        with mgr.room_lock:
            del self.rooms[rs.room]
            mgr._staging_outstanding.pop(rs.room, None)
            if leak:
                mgr.poison_deferred_ack_room(rs.room)
            else:
                mgr._maybe_ack_drained_abort(rs.room)
            if ok and mgr.request_status.get(rs.room) not in (None, KVPoll.Failed):
                mgr.update_status(rs.room, KVPoll.Success)

    def busy(self) -> bool:
        return bool(self.rooms)

    def peer_busy(self, key: str) -> bool:
        return key in self.queues

    def stats(self) -> dict[str, Any]:
        return {"rooms": len(self.rooms), "tags_free": self.ledger.free,
                "leaked_tags": self.ledger.leaked, "stall_resets": self.stall.resets,
                "rail_ops": list(self.rail_ops),
                "sends_written": self.sends_written,
                "queued_batches": sum(len(q.batches) for q in self.queues.values()),
                **self.staging.stats()}

    # -- writer thread: main loop -------------------------------------------------------------
    def run(self, stop: threading.Event, between: Any = None) -> None:
        """Until `stop`: take chunks, submit, poll, settle, then wait (`_wait`) for what comes
        next; `between()` runs once per round (peer upkeep)."""
        idle = 0
        chunks = self.chunks
        while not stop.is_set():
            bell_seen = int(chunks.bell[0])  # before taking: a chunk appended later rings
            chunks.drain_wakeups()
            while chunks:
                self.take(chunks.popleft())
            posted = self.submit()
            n = 0
            if self.rooms:
                n = self.rails.poll()
                self.settle()
            if between is not None:
                between()
            idle = 0 if n or posted else idle + 1
            if not chunks:
                self._wait(idle, bell_seen)

    def _wait(self, idle: int, bell_seen: int) -> None:
        """Wait with the GIL released for what the next round needs. SGLang's scheduler runs
        the forward in this process: a writer that kept polling in Python while its rooms
        waited took the GIL from the forward at every turn (on the CPU engine the prefill's
        forward and send of a 64-token prompt took 85 ms, median, instead of 21;
        docs/benchmark.md).

        * No write queued or in flight (the rooms wait for the engine's next layer or chunk):
          sleep on the chunk queue's pipe.
        * Writes in flight, none queued, one rail: poll in C until they all completed or a
          chunk came (`wait_idle_or_change`, idling by the endpoint's backoff), as the
          messenger's prefill does.
        * Writes queued (waiting for budget, a bounce buffer or a copy), or in flight on
          several rails: short sleeps between Python rounds."""
        queued = self.rooms and any(q.batches for q in self.queues.values())
        flying = [ep for ep in self.rails.eps if ep.inflight] if self.rooms else []
        if not queued and not flying:
            select.select([self.chunks.wake_fd], [], [], IDLE_WAIT_S)
        elif not queued and len(self.rails) == 1:
            self.ep.wait_idle_or_change(self.chunks.bell, bell_seen, timeout=IDLE_WAIT_S)
        elif idle > 64:
            time.sleep(0.0002)

"""Staging in the SGLang backend: packed head slices (TP mismatch) and the staged GPU-memory path.

Both are one mechanism: copy pages into a registered contiguous staging buffer, write it, land
it, scatter it into place before `KVPoll.Success`. Its pieces are `transfer.staging`'s
(`BouncePool`, `LandingPool`, the `_Copier` that runs copies on a side stream — a worker thread
for CPU tensors); this module drives them from the backend's writer and progress threads.

Write units. Every (page, layer buffer, source shard) is ONE write of `page_size × heads × head
bytes` (`geometry.PagePool.packed_slices`, what `pdtool plan` counts), grouped per operation as
before:
  * source: SGLang's pool itself where the slice is a whole page of it (equal TP, MLA) and the
    pool is registered; else the prefill packs the slice, `[tokens, heads, head]`, into a
    bounce buffer (`_Copier.gather_slice`, one index_select per piece) and writes from there.
    On the staged path (`transfer.gpu_memory=staged`) every page goes through a host bounce
    buffer: that one gather both packs the slice and moves it off the device. On the direct
    path with a TP mismatch the bounce buffers are device memory (registered as CUDA memory).
  * destination: the decoder's pool itself where the slice is all of its heads (prefill TP <=
    decode TP) and the pool is registered; else a landing area (`LandingPool`, host memory on
    the staged path, device memory on the direct one): the decode rank reserves landing for a
    request before its META and sends the block ids, and the prefill computes each write's
    landing offset from them (`staging.landing_offsets`). Landing unit u = (buffer b, page i)
    holds that page's heads in slice order; slice s sits at `dst_head_off × page × head`.

Counting is unchanged: the decoder counts immediate data per slot in C. Once the count is
reached the progress thread hands the room to the landing thread, which scatters the landed
units into the NHD pool (`_Copier.scatter_slice`; host -> device on the staged path) and only
then reports `KVPoll.Success`.

Bounded memory: the prefill's bounce buffers are allocated once (`BOUNCE_BUFFERS` ×
`BOUNCE_BUFFER_BYTES`) and a piece waits in its peer's queue until one is free (a peer may hold
at most half of them, so one slow decode does not take them all); the decode's landing area
is `LANDING_BYTES`, a request waits (its META is not sent, SGLang's waiting timeout runs) until
its blocks are free, and a request that could never fit fails with the sizes. Blocks of a
failed request are quarantined for `LANDING_QUARANTINE_S` before reuse (a late write of the
failed transfer may still land in them).

Pipelining (prefill): per peer, the gathers of the next pieces are issued while free buffers
last before the writes of the oldest piece are posted, and a piece's writes are posted only
once its copy completed (`trace` records ("copy", n) / ("post", n)).

Several NICs (`rails.py`): the bounce buffers and the landing area are registered on every
endpoint of the rank (`Rails.register`; the decode's landing area on the direct path is made
for the first request that needs it, after its lanes started, so their threads pause for that
registration) and the decode sends the landing area's keys on each of its endpoints with the
landing blocks (META `landing_rails`). A piece's writes go out exactly like the direct path's:
in stripes, each on the path the prefill plane's chooser names (`PrefillPlane.route`: fewest
bytes in flight on the local endpoint, ties in turn), counted there once (`PrefillPlane.
posted`). A bounce buffer's tag is the same on every endpoint and its local completions are
summed over them (`Rails.send_done`), so it is reused only once every write from it completed
on every NIC.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer import fabric, workerenv
from transfer.gpu_memory import NO_HMEM_PROVIDERS
from transfer.sglang.errors import PdtoolBackendError
from transfer.sglang.rails import RailError
from transfer.staging import BouncePool, LandingPool, _Copier, landing_offsets, tensor_at

logger = logging.getLogger(__name__)

BOUNCE_BUFFERS = 8
BOUNCE_BUFFER_BYTES = 4 << 20
LANDING_BYTES = 1 << 30
LANDING_BLOCK_BYTES = 1 << 20
LANDING_QUARANTINE_S = 60.0
LANDING_IDLE_S = 0.2
TRACE = False  # record the prefill's copy/post order in stats()["trace"] (tests)


# --------------------------------------------------------------------------- path choice
@dataclass(frozen=True)
class KvPath:
    """How this rank's KV reaches the fabric: `direct` (its pool memory is registered) or
    `staged` (bounce/landing host memory); `may_fall_back`: a `direct` that goes `staged`
    when the node refuses the GPU memory (`direct_or_staged`)."""

    path: str
    may_fall_back: bool = False


def kv_path(device_type: str, provider: str) -> KvPath:
    """The path this rank tries. The worker passes `transfer.gpu_memory` in PDTOOL_GPU_MEMORY
    (`direct`, `staged`, or `auto`); host memory (CPU pools) is registered as is. `auto` (also
    when no worker says) tries direct on CUDA pools and falls back to staged: the attempt is
    the registration of the pools themselves, on the rank's own GPU, so no probe decides
    (a CUDA registration of a host page succeeds whether or not GPUDirect works) and none can
    change how the provider registers them afterwards."""
    given = workerenv.gpu_memory()
    if given == "staged" or (device_type == "cuda" and provider in NO_HMEM_PROVIDERS
                             and given != "direct"):
        return KvPath("staged")
    if device_type != "cuda" or given == "direct":
        return KvPath("direct")
    return KvPath("direct", may_fall_back=True)


def direct_or_staged(kv: KvPath, provider: str, attempt: Callable[[], Any]) -> Any | None:
    """`attempt()` (open FI_HMEM endpoints, register the pools' GPU memory) on the direct
    path; None when GPU memory was refused and `auto` may go staged (one warning naming the
    key), PdtoolBackendError naming `transfer.gpu_memory` and the fix when the user asked for
    `direct`. Any other failure is raised as it is."""
    try:
        return attempt()
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, fabric.GpuMemoryError):
            cause = cause.__cause__
        if cause is None:
            raise  # not about GPU memory: staged would fail the same way
        if not kv.may_fall_back:
            raise PdtoolBackendError(
                f"transfer.gpu_memory=direct: {provider} cannot use this rank's GPU memory: "
                f"{cause}; set transfer.gpu_memory=staged (or auto)") from None
        logger.warning("pdtool: %s cannot use this rank's GPU memory (%s): KV goes through "
                       "registered host memory (transfer.gpu_memory=auto chose staged; set "
                       "it to staged to skip the attempt)", provider, cause)
        return None


def _head_bytes(item_len: int, page_size: int, heads: int) -> int:
    return item_len // (page_size * heads)


# --------------------------------------------------------------------------- prefill side
@dataclass
class Piece:
    """Writes [a, b) of a StagedBatch gathered into bounce buffer `bounce`."""

    number: int
    bounce: int
    a: int
    b: int
    handle: Any
    err_base: int
    posted: int = 0  # writes posted so far
    ops: int = 0
    rails: int = 0  # bit i: local rail i carried some of its writes


@dataclass
class StagedBatch:
    """Writes of one Send into one layer buffer that read a bounce buffer: `src` holds the
    source page ids (the gather packs heads [head_lo, +heads) of their token rows)."""

    send: Any
    fi_addr: int
    buffer: int
    region: fabric.RemoteRegion
    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    head_lo: int
    heads: int
    heads_local: int  # head units of this rank's buffer in the pair's units (the view)
    mr: fabric.MemoryRegion  # the bounce buffers' registration on the first endpoint
    at: int = 0  # writes gathered so far
    pieces: collections.deque[Piece] = field(default_factory=collections.deque)
    staged = True


class PrefillStaging:
    """The prefill rank's bounce buffers and the write units of each peer (writer thread)."""

    def __init__(self, mgr: Any, ep: fabric.Endpoint, tag_base: int, *, path: str,
                 device: Any) -> None:
        self.mgr = mgr
        self.ep = ep
        self.tag_base = tag_base
        self.staged = path == "staged"
        self.device = device
        self.pool: BouncePool | None = None
        self._copier: Any = None
        self._views: dict[tuple[int, int], Any] = {}
        self.owner: dict[int, tuple[Any, Piece]] = {}
        self.held: collections.Counter[str] = collections.Counter()
        self.trace: list[tuple[str, int]] | None = [] if TRACE else None
        self._pieces = 0
        self.gathers = 0
        self.spread = 0  # pieces whose writes went out on more than one NIC
        if self.staged:  # every page needs them: allocate and register at start-up
            self._ensure_pool()

    # -- planning ---------------------------------------------------------------------------
    def writes(self, peer: Any, t: Any, src_pages: np.ndarray, positions: np.ndarray,
               b: int) -> tuple[bool, fabric.RemoteRegion, tuple[np.ndarray, ...]]:
        """(gather?, remote region, (src, dst, lengths)) of layer buffer `b` for pages
        `src_pages` going to positions `positions` of the decoder's page list: one write per
        page. `src` is page ids when the writes read a bounce buffer, else byte offsets."""
        # this rank's and the decoder's layout of buffer b in the pair's head units (a draft
        # model's buffers count their own, `geometry.sglang_draft_group`) and its slice
        mine, theirs, sl = peer.src_layouts[b], peer.kv_layouts[b], peer.buffer_slice(b)
        page = mine.page_size
        hb = mine.head_dim * mine.itemsize * mine.kv_parts
        unit = page * sl.num_heads * hb
        n = len(src_pages)
        lengths = np.full(n, unit, dtype=np.uint64)
        if t.landing is not None:
            idx = b * len(t.kv_indices) + positions
            la = t.landing
            dst = landing_offsets(la.blocks, la.block, la.unit, idx) \
                + np.uint64(sl.dst_head_off * page * hb)
            region = la.region
        else:
            if sl.num_heads != theirs.heads_local or not peer.kv_regions:
                raise ValueError(f"decode {peer.key} gave no landing area for a head slice "
                                 f"that is not all of its page ({sl.num_heads} of "
                                 f"{theirs.heads_local} heads)")
            dst = t.kv_indices[positions].astype(np.uint64) * np.uint64(theirs.page_bytes)
            region = peer.kv_regions[b]
        gather = self.staged or sl.num_heads != mine.heads_local
        src = src_pages.astype(np.int64) if gather else \
            src_pages.astype(np.uint64) * np.uint64(mine.page_bytes)
        return gather, region, (src, dst, lengths)

    def batch(self, send: Any, fi_addr: int, b: int, region: fabric.RemoteRegion,
              peer: Any, arrays: tuple[np.ndarray, ...]) -> StagedBatch:
        src, dst, lengths = arrays
        sl = peer.buffer_slice(b)
        return StagedBatch(send, fi_addr, b, region, src, dst, lengths, sl.src_head_off,
                           sl.num_heads, peer.src_layouts[b].heads_local,
                           self._ensure_pool().mr)

    # -- bounce memory ----------------------------------------------------------------------
    def _ensure_pool(self) -> BouncePool:
        if self.pool is None:
            biggest = max(self.mgr.kv_args.kv_item_lens)
            size = max(BOUNCE_BUFFER_BYTES, self.ep.iov_limit * biggest)
            # registered on every NIC's endpoint: any of them may carry a piece's writes
            self.pool = BouncePool(self.ep, buffers=BOUNCE_BUFFERS, buffer_bytes=size,
                                   device=self.device, tag_base=self.tag_base,
                                   on_device=not self.staged, carriers=self.mgr.rails)
            self._copier = _Copier(self.pool.device)
        return self.pool

    def _view(self, b: int, heads_local: int) -> Any:
        """Layer buffer b of this rank as [slots, heads_local, head bytes] uint8 (a draft
        buffer's head units depend on the decode peer: one view per count)."""
        v = self._views.get((b, heads_local))
        if v is None:
            args = self.mgr.kv_args
            hb = _head_bytes(args.kv_item_lens[b], args.page_size, heads_local)
            v = tensor_at(args.kv_data_ptrs[b], args.kv_data_lens[b], self.device).view(
                -1, heads_local, hb)
            self._views[(b, heads_local)] = v
        return v

    # -- submission (writer thread) ---------------------------------------------------------
    def _gather_ahead(self, sb: StagedBatch, pool: BouncePool) -> None:
        """Issue the copies of `sb`'s next pieces while bounce buffers are free (at most half
        of them per peer)."""
        import torch

        s, n = sb.send, len(sb.lengths)
        unit = int(sb.lengths[0]) if n else 1
        per_piece = pool.buffer_bytes // unit // s.per_op * s.per_op
        if per_piece < 1:
            raise ValueError(f"a {s.per_op}-write operation of {unit} B does not fit a "
                             f"{pool.buffer_bytes} B bounce buffer")
        page = self.mgr.kv_args.page_size
        tokens = np.arange(page, dtype=np.int64)
        while sb.at < n and self.held[s.peer] < max(1, pool.buffers // 2):
            buf = pool.try_take()
            if buf is None:
                break
            k = min(n - sb.at, per_piece)
            rows = torch.from_numpy((sb.src[sb.at:sb.at + k, None] * page + tokens).ravel())
            handle = self._copier.gather_slice(self._view(sb.buffer, sb.heads_local), rows,
                                               sb.head_lo, sb.heads, pool.view(buf))
            piece = Piece(self._pieces, buf, sb.at, sb.at + k, handle, int(pool.errored[buf]))
            self._pieces += 1
            self.gathers += 1
            sb.pieces.append(piece)
            self.held[s.peer] += 1
            self.owner[buf] = (s, piece)
            if self.trace is not None:
                self.trace.append(("copy", piece.number))
            sb.at += k

    def step(self, batches: Any, budget: int, timeout: float,
             plane: Any) -> tuple[bool, bool]:
        """For a peer's queue whose head is a StagedBatch: issue the copies of the next
        pieces (this batch's and the staged batches queued behind it) while buffers are
        free, then post the head's pieces whose copy completed, in order, each in stripes on
        the paths `plane` (the PrefillPlane) chooses. Returns (something posted, head batch
        finished). FabricError for a failed post."""
        pool = self._ensure_pool()
        for ahead in batches:
            # copy ahead only within the head's room, never past a write from the pool
            if not getattr(ahead, "staged", False) or ahead.send.room != batches[0].send.room:
                break
            self._gather_ahead(ahead, pool)
            if self.held[ahead.send.peer] >= max(1, pool.buffers // 2):
                break
        sb = batches[0]
        s, n = sb.send, len(sb.lengths)
        unit = int(sb.lengths[0]) if n else 1
        posted = False
        while sb.pieces and budget > 0 and self._copier.done(sb.pieces[0].handle):
            p = sb.pieces[0]
            self._copier.wait(p.handle)  # raises what the copy raised
            a, m = p.a + p.posted, p.b - p.a - p.posted
            rail = 0
            try:  # the direct path's chooser and stripes: one rule for every write
                rail, ep, fi_addr, mr, region, m = plane.route(sb, sb.lengths[a:a + m],
                                                                s.per_op)
                src = np.uint64(p.bounce * pool.buffer_bytes) + \
                    np.arange(p.posted, p.posted + m, dtype=np.uint64) * np.uint64(unit)
                ops = ep.write_batch(fi_addr, mr, region, src, sb.dst[a:a + m],
                                     sb.lengths[a:a + m], imm=s.imm,
                                     tag=pool.tag_base + p.bounce,
                                     per_op=min(s.per_op, m), timeout=timeout)
                done, err = m, None
            except fabric.FabricError as exc:
                done = int(getattr(exc, "submitted", 0))
                ops, err = -(-done // s.per_op), exc
            p.posted += done
            p.ops += ops
            p.rails |= (1 << rail) if ops else 0
            plane.posted(s, rail, ops, done * unit, writes=done)  # landing units
            budget -= done * unit
            posted |= done > 0
            if p.posted == p.b - p.a:
                pool.posted_to(p.bounce, p.ops)
                self.spread += (p.rails & (p.rails - 1)) != 0  # two bits or more
                sb.pieces.popleft()
                if self.trace is not None:
                    self.trace.append(("post", p.number))
            if err is not None:
                if err.errno == 110:  # the peer's queue is full: serve the others
                    break
                raise err
        return posted, sb.at >= n and not sb.pieces

    def drop(self, sb: StagedBatch) -> None:
        """A batch whose room failed: buffers it holds come back once nothing reads them."""
        for p in sb.pieces:
            if p.posted:
                self.pool.posted_to(p.bounce, p.ops)  # free once those writes completed
            else:  # a later gather into it queues behind this one (one stream / thread)
                self.owner.pop(p.bounce, None)
                self.held[sb.send.peer] -= 1
                self.pool.give_back(p.bounce)
        sb.pieces.clear()
        sb.at = len(sb.lengths)

    # -- settling (writer thread) -----------------------------------------------------------
    def owns_tag(self, tag: int) -> bool:
        return self.pool is not None and self.pool.owns_tag(tag)

    def failed_write(self, tag: int) -> Any:
        """A completion error on a bounce buffer's tag: the Send it wrote for."""
        buf = self.pool.failed_write(tag)
        owner = self.owner.get(buf)
        return owner[0] if owner else None

    def reclaim(self) -> None:
        """Credit the operations of every bounce buffer whose writes all completed to its
        Send (`credited`) and free the buffer."""
        if self.pool is None:
            return
        for buf in self.pool.reclaim(block=False, timeout=0):
            owner = self.owner.pop(buf, None)
            if owner is None:
                continue
            s, p = owner
            s.credited += p.ops - (int(self.pool.errored[buf]) - p.err_base)
            self.held[s.peer] -= 1

    def leak(self, send: Any) -> None:
        """`send`'s writes never completed: its bounce buffers leave the pool for good."""
        for buf, (s, _p) in list(self.owner.items()):
            if s is send:
                del self.owner[buf]
                self.held[s.peer] -= 1
                self.pool.leak(buf)

    def stats(self) -> dict[str, int]:
        pool = self.pool
        return {"bounce_buffers": 0 if pool is None else pool.buffers,
                "bounce_bytes": 0 if pool is None else pool.allocated_bytes,
                "bounce_in_use_peak": 0 if pool is None else pool.in_use_peak,
                "bounce_leaked": 0 if pool is None else len(pool.leaked),
                "gathers": self.gathers, "pieces_over_nics": self.spread,
                **({"trace": list(self.trace)} if self.trace is not None else {})}

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()


# --------------------------------------------------------------------------- decode side
@dataclass
class Landing:
    """A request's landing blocks and what the scatter needs."""

    room: int
    blocks: tuple[int, ...]
    pages: np.ndarray
    prefill_key: str = ""
    prefill_tp: int = 0
    slot: int | None = None


@dataclass
class _Waiter:
    room: int
    count: int
    send: Callable[[tuple[int, ...]], None]
    alive: Callable[[], bool]


class DecodeLanding:
    """The decode rank's landing area and its thread (see the module docstring).
    `slices(landing, b)` gives the head slices the room received of KV buffer b (the geometry
    owner's routes);
    `done(room, reason)` reports the room once its units are in the pool."""

    def __init__(self, mgr: Any, *, path: str, device: Any,
                 slices: Callable[[Landing, int], list[Any]],
                 done: Callable[[int, str | None], None]) -> None:
        self.mgr = mgr
        self.staged = path == "staged"
        self.device = device
        self._slices = slices
        self._done = done
        args = mgr.kv_args
        self.unit = max(args.kv_item_lens)  # one landing unit per (buffer, page)
        self.block_bytes = max(1, LANDING_BLOCK_BYTES // self.unit) * self.unit
        self.pool: LandingPool | None = None
        self._lock = threading.Lock()
        self._rooms: dict[int, Landing] = {}
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._quarantine: list[tuple[float, tuple[int, ...]]] = []
        self._ready: collections.deque[int] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._views: dict[tuple[int, int], Any] = {}
        self.delivered = 0
        self.waited = 0
        self._thread: threading.Thread | None = None
        if self.staged:  # every request lands: allocate (and fault in) at start-up
            self._ensure_pool()

    def needed(self, prefill_tp: int, decode_tp: int) -> bool:
        """Whether a request from a prefill of attention TP `prefill_tp` lands in staging: on
        the staged path always, else when several prefill ranks each send part of a page's
        heads (prefill TP > decode TP, MHA/GQA)."""
        return self.staged or (not self.mgr.is_mla and prefill_tp > decode_tp)

    def _ensure_pool(self) -> LandingPool:
        if self.pool is None:
            cap = max(LANDING_BYTES // self.block_bytes, 1) * self.block_bytes
            # registered on every NIC's endpoint: writes may land through any of them
            self.pool = LandingPool(self.mgr.ep, capacity_bytes=cap,
                                    block_bytes=self.block_bytes, device=self.device,
                                    on_device=not self.staged, carriers=self.mgr.rails)
            self._thread = threading.Thread(target=self._guarded, name="pdtool-decode-landing",
                                            daemon=True)
            self._thread.start()
        return self.pool

    def blocks_for(self, num_pages: int) -> int:
        units = num_pages * len(self.mgr.kv_args.kv_data_ptrs)
        return math.ceil(units / (self.block_bytes // self.unit))

    # -- scheduler thread -------------------------------------------------------------------
    def reserve(self, room: int, num_pages: int) -> tuple[int, ...] | None:
        """Landing blocks for `room`, or None while the area is full (ValueError when the
        request could never fit it)."""
        with self._lock:
            try:
                pool = self._ensure_pool()
            except RailError as exc:  # a lane that does not pause: this request fails
                raise ValueError(f"the landing area cannot be registered: {exc}") from None
            self._expire()
            try:
                return pool.reserve_blocks(self.blocks_for(num_pages))
            except ValueError as exc:
                raise ValueError(f"{exc}: a {num_pages}-page request does not fit the "
                                 f"{pool.allocated_bytes} B landing area "
                                 f"(staging_plane.LANDING_BYTES)") from None

    def wait(self, room: int, num_pages: int, send: Callable[[tuple[int, ...]], None],
             alive: Callable[[], bool]) -> None:
        """Keep `room` waiting for landing space; `send(blocks)` runs on the landing thread
        once its blocks are free (unless `alive()` turned false meanwhile)."""
        with self._lock:
            self.waited += 1
            self._waiters.append(_Waiter(room, self.blocks_for(num_pages), send, alive))
            self._wake.notify()

    def give_back(self, blocks: tuple[int, ...]) -> None:
        """Blocks reserved for a request whose META was never sent (nothing can land)."""
        with self._lock:
            self.pool.release_blocks(blocks)
            self._wake.notify()

    def hold(self, landing: Landing) -> None:
        with self._lock:
            self._rooms[landing.room] = landing

    def regions(self) -> list[fabric.RemoteRegion]:
        """The landing area's keys on each of the rank's endpoints, the first one's first."""
        rails = self.mgr.rails
        return [rails.twin(self.pool.mr, i).descriptor() for i in range(len(rails))]

    def holds(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms

    def forget(self, room: int) -> None:
        """SGLang cleared the request: blocks it still holds (it failed or was aborted) are
        quarantined, since a late write of its transfer may still land there."""
        with self._lock:
            got = self._rooms.pop(room, None)
            if got is not None:
                self._quarantine.append((time.monotonic() + LANDING_QUARANTINE_S, got.blocks))

    # -- progress thread --------------------------------------------------------------------
    def counted(self, room: int) -> None:
        """Every write of `room` landed: scatter on the landing thread, then report."""
        with self._lock:
            self._ready.append(room)
            self._wake.notify()

    # -- landing thread ---------------------------------------------------------------------
    def _guarded(self) -> None:
        try:
            self._run()
        except Exception as exc:  # a dead landing thread must fail the rooms, with a reason
            if not self._stop:
                logger.exception("pdtool decode landing thread died")
                self.mgr._die(f"pdtool decode landing thread died: {exc!r}")

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self._ready or self._serveable()):
                    self._wake.wait(LANDING_IDLE_S)
                    self._expire()
                if self._stop:
                    return
                room = self._ready.popleft() if self._ready else None
                got = self._rooms.get(room) if room is not None else None
                waiter = self._next_waiter() if room is None else None
            if got is not None:
                reason = None
                try:
                    self._deliver(got)
                except (ValueError, RuntimeError) as exc:
                    reason = f"pdtool: landing of room {room} failed: {exc}"
                with self._lock:
                    if self._rooms.get(room) is got:
                        del self._rooms[room]
                        if reason is None:
                            self.pool.release_blocks(got.blocks)
                            self.delivered += 1
                        else:
                            self._quarantine.append(
                                (time.monotonic() + LANDING_QUARANTINE_S, got.blocks))
                self._done(room, reason)
            elif waiter is not None:
                w, blocks = waiter
                if w.alive():
                    w.send(blocks)
                else:
                    with self._lock:
                        self.pool.release_blocks(blocks)

    def _serveable(self) -> bool:
        while self._waiters and not self._waiters[0].alive():
            self._waiters.popleft()
        return bool(self._waiters) and self._waiters[0].count <= self.pool.free_blocks

    def _next_waiter(self) -> tuple[_Waiter, tuple[int, ...]] | None:
        if not self._serveable():
            return None
        w = self._waiters.popleft()
        return w, self.pool.reserve_blocks(w.count)

    def _expire(self) -> None:
        now = time.monotonic()
        keep = []
        for until, blocks in self._quarantine:
            if until <= now:
                self.pool.release_blocks(blocks)
            else:
                keep.append((until, blocks))
        self._quarantine = keep

    def _view(self, b: int, heads: int) -> Any:
        v = self._views.get((b, heads))
        if v is None:
            args = self.mgr.kv_args
            hb = _head_bytes(args.kv_item_lens[b], args.page_size, heads)
            v = tensor_at(args.kv_data_ptrs[b], args.kv_data_lens[b], self.device).view(
                -1, heads, hb)
            self._views[(b, heads)] = v
        return v

    def _deliver(self, got: Landing) -> None:
        """Landed units -> the NHD pool: per layer buffer, the landed runs copied straight
        from the landing memory to the pool's device, then per slice one indexed copy into
        the token rows."""
        import torch

        args, pool = self.mgr.kv_args, self.pool
        page, npages = args.page_size, len(got.pages)
        rows = torch.from_numpy((got.pages.astype(np.int64)[:, None] * page
                                 + np.arange(page, dtype=np.int64)).ravel())
        units = pool.memory.view(-1, self.unit)
        pos = np.arange(npages, dtype=np.int64)
        for b in range(len(args.kv_data_ptrs)):
            slices = self._slices(got, b)
            heads = sum(s.num_heads for s in slices)
            offs = landing_offsets(got.blocks, self.block_bytes, self.unit, b * npages + pos)
            dst = self._view(b, heads)
            landed = pool.copier.landed_to(units, (offs // np.uint64(self.unit)).astype(
                np.int64), dst.device)
            hb = dst.shape[2]
            for s in slices:
                lo = s.dst_head_off * page * hb
                part = landed[:, lo:lo + s.num_heads * page * hb]
                pool.copier.scatter_slice(part.reshape(npages * page, s.num_heads, hb), dst,
                                          rows, s.dst_head_off, s.num_heads)

    def stats(self) -> dict[str, int]:
        with self._lock:
            pool = self.pool
            return {"landing_bytes": 0 if pool is None else pool.allocated_bytes,
                    "landing_free_blocks": 0 if pool is None else pool.free_blocks,
                    "landing_rooms": len(self._rooms), "landing_waiting": len(self._waiters),
                    "landing_waited": self.waited, "landing_delivered": self.delivered,
                    "landing_quarantined": len(self._quarantine)}

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.pool is not None:
            self.pool.copier.close()

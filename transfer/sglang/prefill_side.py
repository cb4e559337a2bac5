"""The prefill side of the SGLang backend: what a prefill rank's manager does.

SGLang builds one manager class for both roles (`conn.PdtoolKVManager`), so the roles are
split by module: `PrefillSide` is the manager's prefill half, a mixin whose methods run on
the manager. Its control thread checks each decode rank's HELLO against this rank and
answers PEER (`_on_register`, `_match_peer`), records each request's META (`_on_meta`) and
stops a room on SGLang's ABORT (`_on_abort`); `add_transfer_request` hands a chunk to the
writer thread (`prefill_plane.py`); frames to decode ranks leave from the outbox thread, so
a dead decode's socket never stalls the others. `DecodePeer` is a decode rank as this side
knows it after its HELLO.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification
from sglang.srt.environ import envs
from sglang.srt.utils.network import NetworkAddress

from transfer import fabric, workerenv
from transfer.geometry import KVGroup, sglang_draft_group, sglang_group_slices, sglang_slices
from transfer.layout import KVLayout, LayoutError, sglang_buffer_layouts
from transfer.routes import RouteError, ShardSpec, Slice
from transfer.sglang import layer_stream
from transfer.sglang.chunk import Chunk
from transfer.sglang.errors import MAX_SLOTS, PdtoolBackendError
from transfer.sglang.prefill_plane import PrefillPlane
from transfer.sglang.staging_plane import BOUNCE_BUFFERS, PrefillStaging
from transfer.wire.sglang import Hello, Meta, PeerAnswer, RailKeys

logger = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    """A decode rank as the prefill side knows it after its registration frame."""

    key: str
    ip: str
    port: int
    fabric_name: bytes
    tp_size: int
    tp_rank: int
    kv_regions: tuple[fabric.RemoteRegion, ...]
    kv_layouts: list[KVLayout]
    aux_regions: tuple[fabric.RemoteRegion, ...]
    aux_item_lens: tuple[int, ...]
    identity: tuple[Any, ...] = ()  # (ip, GPU, TP size, TP rank): kept by a restarted rank
    # every endpoint (NIC) of the decode rank, the one above first: (name, kv, aux regions)
    rails: list[RailKeys] = field(default_factory=list)
    per_op: int = 1  # page writes grouped into one operation (smaller iov limit of both)
    slice: Slice | None = None  # what this prefill rank sends it (None: another rank does)
    # a draft model's KV buffers (the last `draft.count`): how the pair shards them, this
    # rank's slice of them (None: another rank sends them) and this rank's layouts of them in
    # the pair's head units (`src_layouts`, one per KV buffer: the target's are kv_layouts')
    draft: KVGroup | None = None
    draft_slice: Slice | None = None
    src_layouts: list[KVLayout] = field(default_factory=list)
    sends_aux: bool = False
    error: str | None = None  # why requests from this peer cannot be served

    def buffer_slice(self, b: int) -> Slice | None:
        """What this prefill rank sends of KV buffer `b` (the draft's buffers come last)."""
        if self.draft is not None and b >= len(self.src_layouts) - self.draft.count:
            return self.draft_slice
        return self.slice
    # (local rail, remote rail) -> fi_addr on that local rail's endpoint (inserted lazily)
    addrs: dict[tuple[int, int], int] = field(default_factory=dict)
    _twin_index: dict[Any, tuple[str, int]] = field(default_factory=dict)
    # its landing area's keys on its further endpoints (META `landing_rails`)
    landing_twins: dict[fabric.RemoteRegion, list[fabric.RemoteRegion]] = \
        field(default_factory=dict)

    def remote_twin(self, region: fabric.RemoteRegion, rail: int) -> fabric.RemoteRegion | None:
        """`region` (as registered on the decode's first endpoint) on its endpoint `rail`;
        None for memory it advertised on its first endpoint only."""
        if rail == 0:
            return region
        landing = self.landing_twins.get(region)
        if landing is not None:
            return landing[rail - 1] if rail - 1 < len(landing) else None
        if not self._twin_index:
            self._twin_index = {r: ("kv", i) for i, r in enumerate(self.kv_regions)}
            self._twin_index.update({r: ("aux", i) for i, r in enumerate(self.aux_regions)})
        where = self._twin_index.get(region)
        if where is None or rail >= len(self.rails):
            return None
        kind, i = where
        return (self.rails[rail].kv if kind == "kv" else self.rails[rail].aux)[i]


class PrefillSide:
    """The prefill half of `conn.PdtoolKVManager` (see the module's docstring)."""

    def _start_prefill(self) -> list[threading.Thread]:
        """Set-up of a prefill rank: its peers, staging, writer plane and layer stream; the
        threads it runs (started by the manager)."""
        self.peers: dict[str, DecodePeer] = {}
        self._by_identity: dict[tuple[Any, ...], str] = {}
        self._retired: list[DecodePeer] = []  # replaced peers whose AV entry goes
        timeout = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
        tags = MAX_SLOTS - BOUNCE_BUFFERS  # the last tags count the bounce buffers' writes
        self.staging = PrefillStaging(self, self.ep, tags, path=self.kv_path,
                                      device=self.kv_device)
        # as long as SGLang lets a silent peer live before calling it dead
        heartbeat_s = float(envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get()) * \
            int(envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get())
        self.plane = PrefillPlane(self, self.ep, tags, timeout, stuck_s=timeout,
                                  staging=self.staging, rails=self.rails,
                                  stall_s=min(heartbeat_s, timeout))
        try:
            self.layer_stream = layer_stream.start(self)  # None: PDTOOL_LAYER_STREAM off
        except workerenv.WorkerEnvError as exc:
            raise PdtoolBackendError(str(exc)) from None
        # frames to decode ranks go out from their own thread: SGLang's PUSH sockets wait
        # up to 30 s for a dead peer, which must stall neither writes nor control frames
        self._outbox: queue.SimpleQueue[tuple[str, int, list[bytes]] | None] = \
            queue.SimpleQueue()
        self._unreachable: dict[tuple[str, int], float] = {}
        return [
            threading.Thread(target=self._guard(self._prefill_outbox_loop),
                             name="pdtool-prefill-outbox", daemon=True),
            threading.Thread(target=self._guard(self._prefill_control_loop),
                             name="pdtool-prefill-control", daemon=True),
            threading.Thread(target=self._guard(self._prefill_writer_loop),
                             name="pdtool-prefill-writer", daemon=True)]

    def _prefill_control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stop.is_set():
            msg = recv()
            if not msg:
                continue
            if msg[0] == ABORT_TAG:
                self._on_abort(msg)
                continue
            try:  # MAC, version, replay and every field checked before a byte is used
                got, session = self.frames.receive(msg)
            except ValueError as exc:  # WireError, or a record that cannot be built
                logger.warning("pdtool: dropping control frame: %s", exc)
                continue
            try:
                if isinstance(got, Hello):
                    self._on_register(got, session)
                elif isinstance(got, Meta):
                    self._on_meta(got)
                else:
                    raise ValueError(f"unexpected kind {got.KIND!r}")
            except (TypeError, ValueError) as exc:  # signed and well-formed, yet unusable
                logger.warning("pdtool: dropping %s frame: %s", got.KIND, exc)

    def _on_register(self, h: Hello, session: bytes) -> None:
        peer = DecodePeer(
            key=h.peer, ip=h.ip, port=h.port, fabric_name=h.fabric_name, tp_size=h.tp_size,
            tp_rank=h.tp_rank, kv_regions=h.kv, kv_layouts=[], aux_regions=h.aux,
            aux_item_lens=h.aux_item_lens, identity=(h.ip, h.gpu, h.tp_size, h.tp_rank),
            rails=[RailKeys(h.fabric_name, h.kv, h.aux), *h.rails])
        try:
            self._match_peer(peer, h)
        except (PdtoolBackendError, LayoutError, RouteError) as exc:
            peer.error = f"decode rank {peer.key} cannot be served by this prefill: {exc}"
            logger.error("pdtool: %s", peer.error)
        with self.room_lock:
            old = self.peers.get(peer.key)
            if old is not None and [r.fabric_name for r in old.rails] == \
                    [r.fabric_name for r in peer.rails]:
                peer.addrs = old.addrs
            elif old is not None:
                self._retired.append(old)
            # a decode rank that restarted registers from a new port with the same GPU and TP
            # rank: forget the old one (its AV entry goes once nothing of it is in flight)
            stale = self._by_identity.get(peer.identity)
            if stale is not None and stale != peer.key and stale in self.peers:
                self._retired.append(self.peers.pop(stale))
            self._by_identity[peer.identity] = peer.key
            self.peers[peer.key] = peer
        self._send_to_decode(peer, self.frames.send(PeerAnswer(
            self.peer_key, self.total_kv_heads, peer.per_op, peer.error, peer.draft),
            to=session))

    def _send_to_decode(self, peer: DecodePeer, frame: list[bytes]) -> None:
        self._outbox.put((peer.ip, peer.port, frame))

    def fail_room(self, room: int, reason: str) -> None:
        """Any prefill thread: fail `room` now (the first reason is kept) and tell its decode
        ranks from the outbox thread, so the caller never waits on a dead decode's socket."""
        if room not in self.request_status:
            return
        with self.failure_lock:
            reason = self.failure_records.setdefault(room, reason)
        self.update_status(room, KVPoll.Failed)
        parts = self._encode_kv_status_message(bootstrap_room=room, status=KVPoll.Failed,
                                               failure_reason=reason)
        for ip, port in self._room_notify_targets(room):
            self._outbox.put((ip, port, parts))

    def _prefill_outbox_loop(self) -> None:
        """Send queued frames to decode ranks; one that timed out is skipped for a minute
        (it is dead or wedged: nothing it would read is worth holding the others for)."""
        while not self._stop.is_set():
            item = self._outbox.get()
            if item is None:
                return
            ip, port, parts = item
            if time.monotonic() < self._unreachable.get((ip, port), 0.0):
                continue
            na = NetworkAddress(ip, port)
            try:
                self._send_multipart_locked(na.to_tcp(), parts, is_ipv6=na.is_ipv6)
            except Exception as exc:  # the decode may be gone; never stop serving
                self._unreachable[(ip, port)] = time.monotonic() + 60.0
                logger.warning("pdtool: cannot reach decode %s:%s: %s", ip, port, exc)

    def _match_peer(self, peer: DecodePeer, h: Hello) -> None:
        """Check both sides can talk and work out what this rank sends to that decode rank."""
        if h.provider != self.ep.provider:
            raise PdtoolBackendError(f"libfabric provider: prefill {self.ep.provider!r}, "
                                     f"decode {h.provider!r} (set PDTOOL_FI_PROVIDER alike)")
        if h.is_mla != self.is_mla:
            raise PdtoolBackendError("one side uses an MLA pool, the other not")
        page = self.kv_args.page_size
        if h.page_size != page:
            raise PdtoolBackendError(f"--page-size: prefill {page}, decode {h.page_size}")
        mine = len(self.kv_args.kv_data_lens)
        if h.num_draft != self.num_draft:
            raise PdtoolBackendError(
                f"draft-model KV buffers: prefill has {self.num_draft}, decode {h.num_draft} "
                f"(give both roles the same --speculative-algorithm and draft model)")
        if len(h.kv_data_lens) != mine or len(h.kv) not in (0, mine):
            raise PdtoolBackendError(f"KV buffers: prefill has {mine}, decode "
                                     f"{len(h.kv_data_lens)} (same model and speculative "
                                     f"settings?)")
        if list(peer.aux_item_lens) != list(self.kv_args.aux_item_lens):
            raise PdtoolBackendError(
                f"metadata buffers differ: prefill item lengths {list(self.kv_args.aux_item_lens)}"
                f", decode {peer.aux_item_lens} (enable the same optional metadata on both)")
        if h.compat != self.compat:  # the checks above name the usual differences
            raise PdtoolBackendError("HELLO.compat: the decode rank's static facts differ "
                                     "from this prefill's (pdtool versions differ?)")
        heads = 1 if self.is_mla else self._decode_heads(peer, h)
        ntarget = len(self.kv_args.kv_item_lens) - self.num_draft
        mine_heads, theirs_heads = [self.heads_local] * ntarget, [heads] * ntarget
        if self.num_draft:
            # the draft's shards from the bytes a token takes on each side (geometry)
            peer.draft, unit = sglang_draft_group(
                self.num_draft, self.kv_args.kv_item_lens[-1] // page,
                h.kv_item_lens[-1] // page, self.attn_tp_size, peer.tp_size,
                target_mla=self.is_mla)
            mine_heads += [self.kv_args.kv_item_lens[-1] // page // unit] * self.num_draft
            theirs_heads += [h.kv_item_lens[-1] // page // unit] * self.num_draft
        peer.src_layouts = sglang_buffer_layouts(self.kv_args.kv_data_lens,
                                                 self.kv_args.kv_item_lens, mine_heads, page)
        peer.kv_layouts = sglang_buffer_layouts(h.kv_data_lens, h.kv_item_lens,
                                                theirs_heads, page)
        for mine_, theirs in zip(peer.src_layouts, peer.kv_layouts, strict=True):
            mine_.check_peer(theirs)
        for i, r in enumerate(peer.rails):
            if len(r.kv) != len(peer.kv_regions) or len(r.aux) != len(peer.aux_regions) or \
                    [x.length for x in (*r.kv, *r.aux)] != \
                    [x.length for x in (*peer.kv_regions, *peer.aux_regions)]:
                raise PdtoolBackendError(f"HELLO.rails[{i - 1}]: its regions are not the same "
                                         f"memory as the first endpoint's")
        peer.per_op = max(1, min(self.rails.iov_limit, h.iov_limit))
        slices = sglang_slices(self.is_mla, self.total_kv_heads, self.attn_tp_size,
                               peer.tp_size, peer.tp_rank)
        my_rank = self.kv_args.engine_rank % self.attn_tp_size
        if self.is_mla:
            # the decode draws the real MLA source per request (META is_dummy, sources.py);
            # any replica holds the latent.
            peer.slice = slices[0]
            peer.sends_aux = True
        else:
            mine_ = [s for s in slices if s.src_rank == my_rank]
            peer.slice = mine_[0] if mine_ else None
            peer.sends_aux = slices[0].src_rank == my_rank
        if peer.draft is not None:
            drafts = sglang_group_slices(peer.draft, self.attn_tp_size, peer.tp_size,
                                         peer.tp_rank)
            self._warn_if_unplanned(peer, h, len(drafts))
            if self.is_mla and peer.draft.whole:
                peer.draft_slice = drafts[0]  # whichever connected rank is real sends it
            else:
                own = [s for s in drafts if s.src_rank == my_rank]
                peer.draft_slice = own[0] if own else None

    def _warn_if_unplanned(self, peer: DecodePeer, h: Hello, sources: int) -> None:
        """The plan (PDTOOL_DRAFT_LAYERS set) counted the draft as sharded like the target's
        KV; where this pair's draft takes another number of slices, its figure is off."""
        if workerenv.DRAFT_LAYERS.get() is None:
            return
        page = self.kv_args.page_size
        try:
            planned = sglang_draft_group(self.num_draft, self.kv_args.kv_item_lens[0] // page,
                                         h.kv_item_lens[0] // page, self.attn_tp_size,
                                         peer.tp_size, target_mla=self.is_mla)[0]
            want = len(sglang_group_slices(planned, self.attn_tp_size, peer.tp_size,
                                           peer.tp_rank))
        except RouteError:
            want = 0
        if want != sources:
            logger.warning("pdtool: decode rank %s takes the draft model's KV from %d prefill "
                           "rank(s), while the plan counted %d (its KV heads do not shard like "
                           "the target's): the plan's writes/request is off for it",
                           peer.key, sources, want)

    def _decode_heads(self, peer: DecodePeer, h: Hello) -> int:
        """The decode rank's local KV heads, from its item length and this rank's head size
        (both sides hold the same heads × head_dim × dtype per token and head)."""
        page = self.kv_args.page_size
        head_bytes = self.kv_args.kv_item_lens[0] // (page * self.heads_local)
        want = ShardSpec(self.total_kv_heads, peer.tp_size).heads_per_rank
        got, rem = divmod(h.kv_item_lens[0], page * head_bytes)
        if rem or got != want:
            raise PdtoolBackendError(
                f"decode KV item length {h.kv_item_lens[0]} B is not {want} heads "
                f"({self.total_kv_heads} over TP {peer.tp_size}) × {head_bytes} B × page {page}: "
                f"same model and --kv-cache-dtype on both sides?")
        return got

    def _on_meta(self, target: Meta) -> None:
        room, landing = target.room, target.landing
        peer = self.peers.get(target.peer)
        if landing is not None and peer is not None and not peer.error:
            if len(landing.rails) != len(peer.rails) - 1 or \
                    any(r.length != landing.region.length for r in landing.rails):
                raise ValueError(f"META.landing_rails: {len(landing.rails)} regions for the "
                                 f"decode's {len(peer.rails) - 1} further endpoints, or not "
                                 f"the landing area's length")
            if landing.unit < max(lay.page_bytes for lay in peer.kv_layouts) \
                    or landing.block % landing.unit:
                raise ValueError(f"META.landing_unit {landing.unit} B is smaller than the "
                                 f"decode's page or does not divide its block")
            peer.landing_twins[landing.region] = list(landing.rails)
        infos = self.transfer_infos.setdefault(room, {})
        infos[target.peer] = target
        if peer is None or peer.error:
            self.record_failure(room, peer.error if peer else f"unregistered decode {target.peer}")
            self.update_status(room, KVPoll.Failed)
            ip, port = target.peer.rsplit(":", 1)
            self._outbox.put((ip, int(port), self._encode_kv_status_message(
                bootstrap_room=room, status=KVPoll.Failed,
                failure_reason=self.failure_records.get(room))))
            return
        if len(infos) == target.required_dst_info_num:
            self.req_to_decode_prefix_len[room] = target.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    def _room_notify_targets(self, bootstrap_room: int) -> list[tuple[str, int]]:
        infos = self.transfer_infos.get(bootstrap_room) or {}
        out = []
        for t in list(infos.values()):
            peer = self.peers.get(t.peer)
            if peer is not None and not t.is_dummy and (peer.ip, peer.port) not in out:
                out.append((peer.ip, peer.port))
        return out

    def _on_abort(self, msg: list[bytes]) -> None:
        """Decode gave up on a room: stop writing it; ACK once its writes drained (if asked).
        Under the room lock, so the writer either saw the room Failed before marking it in
        flight, or marked it first and then ACKs itself once its writes drained."""
        note = AbortNotification.from_zmq(msg)
        if note is None:
            return
        with self.room_lock:
            if note.room in self.request_status and \
                    self.check_status(note.room) != KVPoll.Success:
                self.record_failure(note.room, "Aborted by decode-side abort notification.")
                self.update_status(note.room, KVPoll.Failed)
            target = note.deferred_ack_target() if self.enable_deferred_decode_kv_release \
                else None
            if target is not None:
                self.register_deferred_ack_target(note.room, target)
                self._maybe_ack_drained_abort(note.room)  # ACKs now unless writes in flight

    def add_transfer_request(self, bootstrap_room: int, kv_indices: npt.NDArray[np.int32],
                             index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: list | None = None,
                             num_kv_tokens: int | None = None, *, wait_event: Any = None,
                             indices_event: Any = None, **_: Any) -> None:
        if bootstrap_room not in self.transfer_infos:
            return  # dummy rank or cleared
        if self.problem:
            self.fail_room(bootstrap_room, self.problem)
            return
        # kv_indices stays as given: with indices_event it is still being copied to the host
        self.plane.chunks.append(Chunk(bootstrap_room, kv_indices, index_slice, is_last_chunk,
                                    aux_index, wait_event, indices_event))

    def _prefill_writer_loop(self) -> None:
        self.plane.run(self._stop, between=self._drop_retired_peers)

    def _drop_retired_peers(self) -> None:
        """Writer thread: remove replaced decode peers from the address vector once nothing
        of theirs is queued or in flight (a decode instance that restarted)."""
        if not self._retired:
            return
        with self.room_lock:  # the control thread adds peers under it
            retired, self._retired = self._retired, []
            live = {(i, a) for p in self.peers.values() for (i, _), a in p.addrs.items()}
        for peer in retired:
            if self.plane.peer_busy(peer.key):
                with self.room_lock:
                    self._retired.append(peer)
                continue
            for (i, _), addr in peer.addrs.items():
                if (i, addr) not in live:
                    self.rails.eps[i].remove_peer(addr)

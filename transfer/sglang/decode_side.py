"""The decode side of the SGLang backend: what a decode rank's manager does.

`DecodeSide` is the decode half of `conn.PdtoolKVManager` (a mixin whose methods run on the
manager; SGLang builds one manager class for both roles). It builds the HELLO and META
frames SGLang's `CommonKVReceiver` sends, arms a transfer slot per request whose count comes
from the shard routes (`arm`, `_ops`) once the prefill rank answered PEER (`_on_peer`), and
turns a counted slot into `KVPoll.Success` — after the staging scatter where the request
landed in the landing area (`staging_plane.py`) — with no done message from the prefill.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVPoll

from transfer import fabric, workerenv
from transfer.geometry import sglang_decode_writes, sglang_group_slices, sglang_slices
from transfer.routes import RouteError, Slice
from transfer.sglang.decode_plane import DecodePlane
from transfer.sglang.errors import PdtoolBackendError
from transfer.sglang.staging_plane import DecodeLanding, Landing
from transfer.wire.sglang import TAG, Hello, LandingArea, Meta, PeerAnswer, RailKeys

logger = logging.getLogger(__name__)


class DecodeSide:
    """The decode half of `conn.PdtoolKVManager` (see the module's docstring)."""

    def _start_decode(self) -> list[threading.Thread]:
        """Set-up of a decode rank: its landing area, slot plane and lanes; the threads it
        runs (started by the manager)."""
        self.total_kv_heads = 1 if self.is_mla else 0  # 0: per prefill rank, see PEER
        self.prefill_geometry: dict[str, PeerAnswer] = {}
        self._awaiting: dict[str, list[tuple[int, int, int, int, bool]]] = {}
        self._geo_lock = threading.Lock()
        self.landing = DecodeLanding(self, path=self.kv_path, device=self.kv_device,
                                     slices=self._landed_slices, done=self._on_landed)
        self.damage_pages = self._damage_hook()
        self.rails.start_lanes()  # further NICs: their own C threads, counting into ep
        self.plane = DecodePlane(self.ep, self._on_counted, self._die,
                                 lanes=len(self.rails) > 1, metrics=self.metrics)
        self._start_heartbeat_checker_thread()
        return [threading.Thread(target=self._guard(self._decode_control_loop),
                                 name="pdtool-decode-control", daemon=True)]

    def build_receiver_registration_message(self) -> list[bytes]:
        def keys(mrs: list[Any], rail: int) -> tuple[fabric.RemoteRegion, ...]:
            return tuple(self.rails.twin(mr, rail).descriptor() for mr in mrs)

        return self.frames.send(Hello(
            compat=self.compat, peer=self.peer_key, ip=self.local_ip, port=self.rank_port,
            fabric_name=self.ep.name, provider=self.ep.provider, tp_size=self.attn_tp_size,
            tp_rank=self.kv_args.engine_rank % self.attn_tp_size,
            gpu=int(self.kv_args.gpu_id or 0), iov_limit=self.rails.iov_limit,
            is_mla=self.is_mla, page_size=self.kv_args.page_size, num_draft=self.num_draft,
            kv=keys(self.kv_mrs, 0), kv_data_lens=tuple(self.kv_args.kv_data_lens),
            kv_item_lens=tuple(self.kv_args.kv_item_lens), aux=keys(self.aux_mrs, 0),
            aux_item_lens=tuple(self.kv_args.aux_item_lens),
            rails=tuple(RailKeys(ep.name, keys(self.kv_mrs, i), keys(self.aux_mrs, i))
                        for i, ep in enumerate(self.rails.eps) if i)))

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: npt.NDArray[np.int32], aux_index: int | None,
                                        state_indices: list | None, decode_prefix_len: int | None,
                                        is_dummy: bool, device_kv_indices=None,
                                        slot: int = 0, gen: int = 0,
                                        landing_blocks: tuple[int, ...] | None = None
                                        ) -> list[bytes]:
        landing = None
        if landing_blocks is not None and not is_dummy:
            first, *further = self.landing.regions()  # its keys on each endpoint (NIC)
            landing = LandingArea(first, self.landing.block_bytes, self.landing.unit,
                                  np.asarray(landing_blocks, np.int32), tuple(further))
        return self.frames.send(Meta(
            self.peer_key, bootstrap_room, np.asarray(kv_indices, np.int32), aux_index, slot,
            gen, required_dst_info_num, bool(is_dummy), int(decode_prefix_len or 0), landing))

    def arm(self, room: int, prefill_key: str, prefill_tp: int, num_pages: int,
            with_aux: bool) -> tuple[int, int]:
        """Scheduler thread: a slot counting `room`'s writes. Its count is known once the
        prefill rank answered our registration; until then the slot counts and waits."""
        if self.problem:
            raise PdtoolBackendError(self.problem)
        with self._geo_lock:
            geo = self.prefill_geometry.get(prefill_key)
            if geo is not None and geo.error:
                raise PdtoolBackendError(geo.error)
            expected = None if geo is None else self._ops(geo, prefill_tp, num_pages, with_aux)
            try:
                slot, gen = self.plane.allocate(room, expected, prefill_key)
            except RuntimeError as exc:
                raise PdtoolBackendError(str(exc)) from None
            if geo is None:
                self._awaiting.setdefault(prefill_key, []).append(
                    (room, slot, prefill_tp, num_pages, with_aux))
        return slot, gen

    def _ops(self, geo: PeerAnswer, prefill_tp: int, num_pages: int,
             with_aux: bool) -> int:
        """Operations this rank counts for one request (pages grouped `writes_per_op`)."""
        return sglang_decode_writes(
            is_mla=self.is_mla, total_heads=1 if self.is_mla else geo.total_kv_heads,
            prefill_tp=prefill_tp, decode_tp=self.attn_tp_size,
            decode_rank=self.kv_args.engine_rank % self.attn_tp_size,
            page_size=self.kv_args.page_size, num_pages=num_pages,
            num_buffers=len(self.kv_args.kv_data_ptrs),
            num_aux=len(self.aux_mrs) if with_aux else 0, writes_per_op=geo.writes_per_op,
            draft=geo.draft)

    def _on_peer(self, geo: PeerAnswer) -> None:
        """A prefill rank's answer to our registration: the count of every slot waiting for
        it becomes known (or they fail with its reason)."""
        key, draft = geo.peer, geo.draft
        if geo.writes_per_op < 1 or geo.total_kv_heads < 1:
            raise ValueError(f"prefill {key}: writes_per_op/total_kv_heads must be >= 1")
        if not geo.error and (draft.count if draft else 0) != self.num_draft:
            raise ValueError(f"prefill {key}: PEER.draft covers "
                             f"{draft.count if draft else 0} KV buffers, this rank has "
                             f"{self.num_draft} draft buffers")
        with self._geo_lock:
            self.prefill_geometry[key] = geo
            waiting = self._awaiting.pop(key, [])
        for room, slot, prefill_tp, num_pages, with_aux in waiting:
            try:
                if geo.error:
                    raise PdtoolBackendError(geo.error)
                self.plane.set_expected(slot, room, self._ops(geo, prefill_tp, num_pages,
                                                              with_aux))
            except (PdtoolBackendError, RouteError) as exc:
                self.record_failure(room, f"pdtool: {exc}")
                self.update_status(room, KVPoll.Failed)

    def _on_counted(self, room: int, reason: str | None) -> None:
        """Progress thread: every expected write of `room` landed (or too many did). A room
        that landed in staging is scattered into the pool first (landing thread)."""
        if reason is None and self.landing.holds(room):
            self.landing.counted(room)
        else:
            self._on_landed(room, reason)

    def _damage_hook(self) -> dict[int, int] | None:
        """PDTOOL_SGLANG_CORRUPT_INSTANCE (tests): room -> its first KV page, damaged once it
        landed, when this decode is the instance named; None otherwise."""
        try:
            named = workerenv.integer(workerenv.SGLANG_CORRUPT_INSTANCE)
            if named is None or named != workerenv.integer(workerenv.INSTANCE):
                return None
        except workerenv.WorkerEnvError as exc:
            raise PdtoolBackendError(str(exc)) from None
        if self.kv_device.type != "cpu":
            raise PdtoolBackendError(f"{workerenv.SGLANG_CORRUPT_INSTANCE.name}: a test hook "
                                     "for host KV pools only")
        logger.warning("pdtool: %s: this decode damages the first KV page of every request",
                       workerenv.SGLANG_CORRUPT_INSTANCE.name)
        return {}

    def _damage(self, room: int) -> None:
        import ctypes

        page = self.damage_pages.pop(room, None) if self.damage_pages is not None else None
        if page is not None:
            size = int(self.kv_args.kv_item_lens[0])
            ctypes.memset(int(self.kv_args.kv_data_ptrs[0]) + page * size, 0x7F, size)

    def _on_landed(self, room: int, reason: str | None) -> None:
        self._damage(room)
        if reason is None:
            if self.request_status.get(room) not in (None, KVPoll.Failed):
                self.update_status(room, KVPoll.Success)
        else:
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)

    def _landed_slices(self, landing: Landing, b: int) -> list[Slice]:
        """The head slices a landed room holds of KV buffer `b`, in this rank's pool (the
        routes; a draft model's buffers, the last ones, in the pair's draft head units)."""
        geo = self.prefill_geometry[landing.prefill_key]
        rank = self.kv_args.engine_rank % self.attn_tp_size
        if geo.draft is not None and b >= len(self.kv_args.kv_data_ptrs) - geo.draft.count:
            return sglang_group_slices(geo.draft, landing.prefill_tp, self.attn_tp_size, rank)
        return sglang_slices(self.is_mla, 1 if self.is_mla else geo.total_kv_heads,
                             landing.prefill_tp, self.attn_tp_size, rank)

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        """SGLang's heartbeat lost a prefill instance: forget what its ranks answered too."""
        with self.connection_lock:
            ranks = {f"{i.get('rank_ip')}:{i.get('rank_port')}"
                     for k, infos in self.connection_pool.items()
                     if k.startswith(failed_bootstrap_addr) for i in infos}
        super()._handle_node_failure(failed_bootstrap_addr)
        with self._geo_lock:
            for key in ranks:
                self.prefill_geometry.pop(key, None)

    def _decode_control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stop.is_set():
            msg = recv()
            if not msg or self.handle_abort_ack_message(msg):
                continue
            if msg[0] == TAG:
                try:
                    got, _session = self.frames.receive(msg)
                    if not isinstance(got, PeerAnswer):
                        raise ValueError(f"unexpected kind {got.KIND!r}")
                    self._on_peer(got)
                except (TypeError, ValueError) as exc:  # WireError is a ValueError
                    logger.warning("pdtool decode: dropping control frame: %s", exc)
                continue
            parsed = self.parse_kv_status_message(msg)
            if parsed is None:
                logger.warning("pdtool decode: unexpected control message %r", msg[0][:20])
                continue
            room, status, prefill_rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status,
                                      prefill_rank=prefill_rank, failure_reason=reason)

"""SGLang 0.5.23 transfer backend `pdtool`: KV pages over pdtool's libfabric binding.

SGLang drives the request life cycle (bootstrap, page allocation, chunked prefill, aborts); this
backend only moves bytes and reports `KVPoll` states. It subclasses SGLang's `Common*` classes as
its mooncake and nixl backends do, so bootstrap (HTTP registry), rank mapping across TP sizes,
heartbeats, timeouts and failure bookkeeping stay SGLang's own code.

Data plane (pdtool's messenger rules, docs/messenger.md):
  * every KV/aux buffer of a rank is registered once with one libfabric `Endpoint`;
  * prefill turns a chunk's page ids into (src offset, dst offset, length) arrays with
    `transfer.layout.write_plan` and submits each layer buffer's writes in one C call;
  * every write carries the decoder's 32-bit immediate `slot|generation`; the decoder counts
    completions per slot in C and declares `KVPoll.Success` when the count it computed from
    the shard routes is reached — no "done" message. A late write of an older generation
    never advances a reused slot;
  * prefill reports Success once its own writes completed locally (its pages may be reused),
    and sends a status message only on failure (with the reason).

Pages: SGLang's pools are NHD per layer buffer — MHA `[slots, heads, head_dim]` with separate K
and V buffers, MLA `[slots, 1, kv_lora_rank + rope]` — and page p is slots [p*P, (p+1)*P).
  * equal attention TP, or MLA (replicated latent): a page of a layer buffer is contiguous on
    both sides: ONE write per (page, layer buffer);
  * MHA/GQA with different prefill and decode TP: each decode rank receives, from each source
    rank `transfer.routes.routes_for` names, only its head slice, which in NHD is one run per
    token: `page_size` writes per (page, layer buffer, source). Correct and counted, but the
    op count grows with the page size; `pdtool validate` warns and shows it
    (`pdtool/rules/sglang.py`). Staging into HND is not implemented.
  * the decoder counts writes for every page it allocated; a prefill that would send a
    different number of pages fails the room at its last chunk, with the reason.
Not supported (clear error at start-up): hybrid/state pools (Mamba, SWA, DSA, ...), pipeline
or context parallelism, DCP, KV sharding, draft-model KV, SGLang's staging buffer, host KV
destinations, CUDA memory until `transfer.fabric` registers it (FI_HMEM).

Configuration (environment of every SGLang worker; the pdtool launcher sets them):
  PDTOOL_FI_PROVIDER   libfabric provider (default `tcp;ofi_rxm`; `shm` on one host, `efa`,
                       `verbs;ofi_rxm` on clusters)
  PDTOOL_FI_DOMAIN     libfabric domain (NIC) of this process's ranks, or
  PDTOOL_NICS          JSON {gpu id: "nic,..."}: each rank takes its GPU's first NIC
  PDTOOL_SECRET_FILE   path of the per-deployment secret (hex, mode 0600, written at render
                       time); control frames are HMAC-SHA256 signed with it. The secret itself
                       never travels in the environment (other users' `ps e`/`/proc` cannot
                       read it there either way, but crash dumps and job printouts can).
  PDTOOL_SECRET        fallback only when no secret file is given (tests, hand-run workers)
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_device

from transfer import fabric, workerenv
from transfer.control import ControlError, ReplayGuard
from transfer.geometry import sglang_buffer_layouts, sglang_decode_writes, sglang_slices
from transfer.layout import KVLayout, LayoutError, write_plan
from transfer.routes import RouteError, Slice

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
TAG = b"PDTOOL"
KIND_REGISTER = b"REG"
KIND_META = b"META"
STATUS_TAG = b"PDTOOL_STATUS"
DEFAULT_PROVIDER = "tcp;ofi_rxm"
MAX_SLOTS = 4096  # concurrent transfers per rank (decode slots / prefill completion tags)


class PdtoolBackendError(RuntimeError):
    """A deployment this backend cannot serve; the message names the setting to change."""


# --------------------------------------------------------------------------- control frames
def _secret() -> bytes:
    return _load_secret(os.environ.get("PDTOOL_SECRET_FILE", ""),
                        os.environ.get("PDTOOL_SECRET", ""))


@functools.lru_cache(maxsize=4)
def _load_secret(path: str, fallback: str) -> bytes:
    """The secret file's bytes (mode checked by transfer.control.read_secret), read once."""
    if path:
        from ..control import read_secret

        try:
            return read_secret(path)
        except ControlError as exc:
            raise PdtoolBackendError(f"PDTOOL_SECRET_FILE: {exc}") from None
    return fallback.encode()


_replay = ReplayGuard(30.0)  # frames older than 30 s, or whose nonce was seen, are replays


def encode_frame(kind: bytes, body: dict[str, Any]) -> list[bytes]:
    """[TAG, kind, msgpack body, HMAC-SHA256(kind + body)] for SGLang's ZMQ PUSH sockets. The
    signed body carries a timestamp and a random nonce (`t`, `n`) so a captured frame cannot be
    replayed (a replayed META would make the prefill write into pages that moved on)."""
    payload = msgpack.packb({"v": WIRE_VERSION, **body, "t": time.time(),
                             "n": os.urandom(16)}, use_bin_type=True)
    mac = hmac.new(_secret(), kind + payload, hashlib.sha256).digest()
    return [TAG, kind, payload, mac]


def decode_frame(msg: list[bytes]) -> tuple[bytes, dict[str, Any]]:
    """Inverse of encode_frame; ValueError on a bad signature, version or shape."""
    if len(msg) != 4 or msg[0] != TAG:
        raise ValueError(f"not a pdtool control frame ({len(msg)} parts)")
    kind, payload, mac = msg[1], msg[2], msg[3]
    want = hmac.new(_secret(), kind + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, want):
        raise ValueError("bad HMAC: the deployment secret (PDTOOL_SECRET_FILE) differs "
                         "between prefill and decode")
    body = msgpack.unpackb(payload, raw=False)
    version = body.get("v") if isinstance(body, dict) else None
    if version != WIRE_VERSION:
        raise ValueError(f"unsupported pdtool wire version {version!r} (want {WIRE_VERSION})")
    ts, nonce = body.pop("t", None), body.pop("n", None)
    if not isinstance(ts, float) or not isinstance(nonce, bytes) or len(nonce) != 16:
        raise ValueError("t/n: expected a timestamp and a 16-byte nonce")
    try:
        _replay.check(ts, nonce, time.time())
    except ControlError as exc:
        raise ValueError(str(exc)) from None
    return kind, body


# --------------------------------------------------------------------------- peer state
@dataclass
class DecodePeer:
    """A decode rank as the prefill side knows it after its registration frame."""

    key: str
    ip: str
    port: int
    fabric_name: bytes
    tp_size: int
    tp_rank: int
    kv_regions: list[fabric.RemoteRegion]
    kv_layouts: list[KVLayout]
    aux_regions: list[fabric.RemoteRegion]
    aux_item_lens: list[int]
    slice: Slice | None = None  # what this prefill rank sends it (None: another rank does)
    sends_aux: bool = False
    error: str | None = None  # why requests from this peer cannot be served
    fi_addr: int | None = None


@dataclass
class RoomTarget:
    """One decode destination of one request (from a META frame)."""

    peer: str
    kv_indices: npt.NDArray[np.int32]
    aux_index: int | None
    slot: int
    gen: int
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int


@dataclass
class Chunk:
    room: int
    kv_indices: npt.NDArray[np.int32]
    index_slice: slice
    is_last: bool
    aux_index: int | None


@dataclass
class PendingRoom:
    """Prefill-side completion tracking of one request's writes."""

    tag: int
    submitted: int = 0
    last_seen: bool = False
    started: float = field(default_factory=time.monotonic)


# --------------------------------------------------------------------------- manager
class PdtoolKVManager(CommonKVManager):
    """One per scheduler rank: owns the fabric endpoint and its worker thread(s)."""

    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    # Late-write fencing for reused pages: with SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE
    # the decoder holds an aborted request's pages until every prefill rank ACKs that its
    # writes for the room have completed (`_staging_outstanding` is 0 once they drained).
    supports_deferred_decode_kv_release = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._check_supported()
        self.is_mla = bool(is_mla_backend)
        self.total_kv_heads = 1 if self.is_mla else int(getattr(args, "total_kv_head_num", 0))
        self.heads_local = 1 if self.is_mla else int(getattr(args, "kv_head_num", 0))
        if not self.is_mla and (self.total_kv_heads < 1 or self.heads_local < 1):
            raise PdtoolBackendError("KVArgs.total_kv_head_num / kv_head_num are not set")
        self.kv_layouts = sglang_buffer_layouts(args.kv_data_lens, args.kv_item_lens,
                                         self.heads_local, args.page_size)
        self.ep = self._open_endpoint()
        if not _secret():
            logger.warning("PDTOOL_SECRET_FILE is unset: pdtool control frames are not "
                           "authenticated")
        iface, device = self._memory_iface()
        try:
            self.kv_mrs = [self.ep.register(p, n, iface=iface, device=device)
                           for p, n in zip(args.kv_data_ptrs, args.kv_data_lens, strict=True)]
            # SGLang keeps metadata (aux) buffers in host memory (MetadataBuffers, device "cpu")
            self.aux_mrs = [self.ep.register(p, n)
                            for p, n in zip(args.aux_data_ptrs, args.aux_data_lens, strict=True)]
        except NotImplementedError as exc:
            raise PdtoolBackendError(
                f"pdtool transfer backend: cannot register {iface} memory with "
                f"{self.ep.provider}: {exc}"
            ) from exc
        self._stop = threading.Event()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.peers: dict[str, DecodePeer] = {}
            self.chunks: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
            self._free_tags = collections.deque(range(MAX_SLOTS))
            self._pending: dict[int, PendingRoom] = {}
            self._send_timeout = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
            threading.Thread(target=self._guard(self._prefill_control_loop),
                             name="pdtool-prefill-control", daemon=True).start()
            threading.Thread(target=self._guard(self._prefill_worker_loop),
                             name="pdtool-prefill-writer", daemon=True).start()
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self._slot_lock = threading.Lock()
            self._free_slots = collections.deque(range(MAX_SLOTS))
            self._slot_gen = np.zeros(MAX_SLOTS, dtype=np.uint32)
            self._active: dict[int, tuple[int, int]] = {}  # slot -> (room, expected)
            self._wake = threading.Event()
            threading.Thread(target=self._guard(self._decode_control_loop),
                             name="pdtool-decode-control", daemon=True).start()
            threading.Thread(target=self._guard(self._decode_progress_loop),
                             name="pdtool-decode-progress", daemon=True).start()
            self._start_heartbeat_checker_thread()

    # -- set-up ---------------------------------------------------------------------------
    def _check_supported(self) -> None:
        args = self.kv_args
        bad = []
        if getattr(args, "state_types", None):
            bad.append(f"state pools {[s.value for s in args.state_types]} (hybrid models)")
        if self.pp_size > 1:
            bad.append(f"pipeline parallelism (pp_size={self.pp_size})")
        if self.attn_cp_size > 1 or self.dcp_size > 1:
            bad.append("attention/decode context parallelism")
        if self.kv_shard_size > 1:
            bad.append("KV cache sharding")
        if envs.SGLANG_DISAGG_STAGING_BUFFER.get():
            bad.append("SGLANG_DISAGG_STAGING_BUFFER")
        if getattr(args, "num_draft_entries", 0):
            bad.append("draft-model KV (speculative decoding)")
        if bad:
            raise PdtoolBackendError(
                "--disaggregation-transfer-backend pdtool does not support: " + "; ".join(bad)
                + ". Use mooncake or nixl for these deployments."
            )

    def _nic(self) -> str | None:
        """This rank's NIC: PDTOOL_FI_DOMAIN, else its GPU's first entry of PDTOOL_NICS."""
        try:
            return workerenv.domain_for(self.kv_args.gpu_id)
        except workerenv.WorkerEnvError as exc:
            raise PdtoolBackendError(str(exc)) from None

    def _open_endpoint(self) -> fabric.Endpoint:
        """Open the rank's endpoint on its NIC. libfabric names domains after the device, but
        EFA's RDM domain carries a `-rdm` suffix; if no domain matches, the provider's default
        NIC is used with a warning (it works, only slower when it is the wrong one)."""
        provider = workerenv.provider(DEFAULT_PROVIDER)
        node = self.local_ip if provider.startswith(("tcp", "sockets")) else None
        nic = self._nic()
        tried: list[str | None] = [nic, f"{nic}-rdm", None] if nic and provider != "shm" \
            else [None]  # shm has one domain per host
        for domain in tried:
            try:
                ep = fabric.Endpoint(provider, domain=domain, node=node, max_slots=MAX_SLOTS)
            except fabric.FabricError as exc:
                if domain is None:
                    raise PdtoolBackendError(
                        f"cannot open a libfabric {provider!r} endpoint (PDTOOL_FI_PROVIDER): "
                        f"{exc}") from exc
                continue
            if nic and provider != "shm" and domain is None:
                logger.warning("pdtool: no libfabric domain %r (or %r) for provider %s; using "
                               "%s", nic, f"{nic}-rdm", provider, ep.domain)
            return ep
        raise AssertionError("unreachable")  # pragma: no cover

    def _memory_iface(self) -> tuple[str, int]:
        dev = getattr(get_device(), "device", "cpu")
        if dev == "cuda":
            return "cuda", int(self.kv_args.gpu_id or 0)
        return "system", 0

    def _guard(self, fn):
        def run() -> None:
            try:
                fn()
            except Exception:
                logger.exception("pdtool %s thread died", fn.__name__)
                raise
        return run

    # -- decode -> prefill frames (called by CommonKVReceiver) ------------------------------
    @property
    def peer_key(self) -> str:
        return f"{self.local_ip}:{self.rank_port}"

    def build_receiver_registration_message(self) -> list[bytes]:
        return encode_frame(KIND_REGISTER, {
            "peer": self.peer_key, "ip": self.local_ip, "port": self.rank_port,
            "fabric_name": self.ep.name, "provider": self.ep.provider,
            "tp_size": self.attn_tp_size, "tp_rank": self.kv_args.engine_rank % self.attn_tp_size,
            "is_mla": self.is_mla, "total_kv_heads": self.total_kv_heads,
            "heads_local": self.heads_local, "page_size": self.kv_args.page_size,
            "kv": [mr.descriptor().to_dict() for mr in self.kv_mrs],
            "kv_data_lens": list(self.kv_args.kv_data_lens),
            "kv_item_lens": list(self.kv_args.kv_item_lens),
            "aux": [mr.descriptor().to_dict() for mr in self.aux_mrs],
            "aux_item_lens": list(self.kv_args.aux_item_lens),
        })

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: npt.NDArray[np.int32], aux_index: int | None,
                                        state_indices: list | None, decode_prefix_len: int | None,
                                        is_dummy: bool, device_kv_indices=None,
                                        slot: int = 0, gen: int = 0) -> list[bytes]:
        return encode_frame(KIND_META, {
            "peer": self.peer_key, "room": bootstrap_room,
            "kv_indices": b"" if is_dummy else np.asarray(kv_indices, np.int32).tobytes(),
            "aux_index": aux_index, "slot": slot, "gen": gen,
            "required_dst_info_num": required_dst_info_num, "is_dummy": bool(is_dummy),
            "decode_prefix_len": int(decode_prefix_len or 0),
        })

    # -- prefill: control thread -------------------------------------------------------------
    def _prefill_control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stop.is_set():
            msg = recv()
            if not msg:
                continue
            if msg[0] == ABORT_TAG:
                self._on_abort(msg)
                continue
            try:
                kind, body = decode_frame(msg)
            except (ValueError, msgpack.UnpackException) as exc:
                logger.warning("pdtool: dropping control frame: %s", exc)
                continue
            try:
                if kind == KIND_REGISTER:
                    self._on_register(body)
                elif kind == KIND_META:
                    self._on_meta(body)
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except KeyError as exc:  # signed by a peer, yet malformed: drop it, keep serving
                logger.warning("pdtool: dropping %s frame: missing field %s", kind, exc)
            except (TypeError, ValueError) as exc:
                logger.warning("pdtool: dropping %s frame: %s", kind, exc)

    def _on_register(self, b: dict[str, Any]) -> None:
        peer = DecodePeer(
            key=b["peer"], ip=b["ip"], port=int(b["port"]), fabric_name=b["fabric_name"],
            tp_size=int(b["tp_size"]), tp_rank=int(b["tp_rank"]),
            kv_regions=[fabric.RemoteRegion.from_dict(d) for d in b["kv"]],
            kv_layouts=[], aux_regions=[fabric.RemoteRegion.from_dict(d) for d in b["aux"]],
            aux_item_lens=list(b["aux_item_lens"]),
        )
        try:
            self._match_peer(peer, b)
        except (PdtoolBackendError, LayoutError, RouteError) as exc:
            peer.error = f"decode rank {peer.key} cannot be served by this prefill: {exc}"
            logger.error("pdtool: %s", peer.error)
        old = self.peers.get(peer.key)
        if old is not None and old.fabric_name == peer.fabric_name:
            peer.fi_addr = old.fi_addr
        self.peers[peer.key] = peer

    def _match_peer(self, peer: DecodePeer, b: dict[str, Any]) -> None:
        """Check both sides can talk and work out what this rank sends to that decode rank."""
        if b["provider"] != self.ep.provider:
            raise PdtoolBackendError(f"libfabric provider: prefill {self.ep.provider!r}, "
                                     f"decode {b['provider']!r} (set PDTOOL_FI_PROVIDER alike)")
        if bool(b["is_mla"]) != self.is_mla:
            raise PdtoolBackendError("one side uses an MLA pool, the other not")
        if int(b["page_size"]) != self.kv_args.page_size:
            raise PdtoolBackendError(f"--page-size: prefill {self.kv_args.page_size}, "
                                     f"decode {b['page_size']}")
        if not self.is_mla and int(b["total_kv_heads"]) != self.total_kv_heads:
            raise PdtoolBackendError(f"KV heads: prefill {self.total_kv_heads}, "
                                     f"decode {b['total_kv_heads']}")
        if len(b["kv"]) != len(self.kv_mrs):
            raise PdtoolBackendError(f"KV buffers: prefill has {len(self.kv_mrs)}, decode "
                                     f"{len(b['kv'])} (same model and speculative settings?)")
        if list(peer.aux_item_lens) != list(self.kv_args.aux_item_lens):
            raise PdtoolBackendError(
                f"metadata buffers differ: prefill item lengths {list(self.kv_args.aux_item_lens)}"
                f", decode {peer.aux_item_lens} (enable the same optional metadata on both)")
        peer.kv_layouts = sglang_buffer_layouts(b["kv_data_lens"], b["kv_item_lens"],
                                         int(b["heads_local"]), int(b["page_size"]))
        for mine, theirs in zip(self.kv_layouts, peer.kv_layouts, strict=True):
            mine.check_peer(theirs)
        slices = sglang_slices(self.is_mla, self.total_kv_heads, self.attn_tp_size,
                               peer.tp_size, peer.tp_rank)
        my_rank = self.kv_args.engine_rank % self.attn_tp_size
        if self.is_mla:
            # SGLang picks the real MLA source (META is_dummy); any replica holds the latent.
            peer.slice = slices[0]
            peer.sends_aux = True
        else:
            mine_ = [s for s in slices if s.src_rank == my_rank]
            peer.slice = mine_[0] if mine_ else None
            peer.sends_aux = slices[0].src_rank == my_rank

    def _on_meta(self, b: dict[str, Any]) -> None:
        room = int(b["room"])
        target = RoomTarget(
            peer=b["peer"], kv_indices=np.frombuffer(b["kv_indices"], dtype=np.int32),
            aux_index=b["aux_index"], slot=int(b["slot"]), gen=int(b["gen"]),
            required_dst_info_num=int(b["required_dst_info_num"]), is_dummy=bool(b["is_dummy"]),
            decode_prefix_len=int(b["decode_prefix_len"]),
        )
        infos = self.transfer_infos.setdefault(room, {})
        infos[target.peer] = target
        peer = self.peers.get(target.peer)
        if peer is None or peer.error:
            self.record_failure(room, peer.error if peer else f"unregistered decode {target.peer}")
            self.update_status(room, KVPoll.Failed)
            ip, port = target.peer.rsplit(":", 1)
            self.send_kv_status_message(targets=[(ip, int(port))], bootstrap_room=room,
                                        status=KVPoll.Failed,
                                        failure_reason=self.failure_records.get(room))
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
        """Decode gave up on a room: stop writing it; ACK once its writes drained (if asked)."""
        note = AbortNotification.from_zmq(msg)
        if note is None:
            return
        if note.room in self.request_status and self.check_status(note.room) != KVPoll.Success:
            self.record_failure(note.room, "Aborted by decode-side abort notification.")
            self.update_status(note.room, KVPoll.Failed)
        target = note.deferred_ack_target() if self.enable_deferred_decode_kv_release else None
        if target is not None:
            self.register_deferred_ack_target(note.room, target)
            self._maybe_ack_drained_abort(note.room)  # ACKs now unless writes are in flight

    # -- prefill: writer thread (the only user of the endpoint's data path) ---------------------
    def add_transfer_request(self, bootstrap_room: int, kv_indices: npt.NDArray[np.int32],
                             index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: list | None = None,
                             num_kv_tokens: int | None = None, **_: Any) -> None:
        if bootstrap_room not in self.transfer_infos:
            return  # dummy rank or cleared
        self.chunks.put(Chunk(bootstrap_room, np.asarray(kv_indices, dtype=np.int32),
                              index_slice, is_last_chunk, aux_index))

    def _outstanding(self) -> bool:
        return any(self.ep.send_done[p.tag] < p.submitted for p in self._pending.values())

    def _prefill_worker_loop(self) -> None:
        """Submit chunks, drive progress and settle rooms, all on this one thread. It blocks on
        the chunk queue unless writes are in flight; then it polls, backing off when idle."""
        idle = 0
        while not self._stop.is_set():
            busy = self._outstanding()
            try:
                chunk = self.chunks.get_nowait() if busy else self.chunks.get(timeout=0.05)
            except queue.Empty:
                chunk = None
            if chunk is not None:
                try:
                    self._process_chunk(chunk)
                except Exception as exc:  # a bug must fail its room, not stop every transfer
                    logger.exception("pdtool: chunk of room %s", chunk.room)
                    if chunk.room in self._pending:
                        self._pending[chunk.room].last_seen = True
                    self.conclude_failure(bootstrap_room=chunk.room,
                                          failure_reason=f"pdtool internal error: {exc!r}")
            if self._pending:
                n = self.ep.poll()
                self._settle_pending()
                idle = 0 if n or chunk is not None else idle + 1
                if idle > 64:
                    time.sleep(0.0002)

    def _process_chunk(self, chunk: Chunk) -> None:
        room = chunk.room
        status = self.request_status.get(room)
        if status is None or status == KVPoll.Failed:
            return
        pending = self._pending.get(room)
        if pending is None:
            if not self._free_tags:
                self.conclude_failure(bootstrap_room=room,
                                      failure_reason=f"more than {MAX_SLOTS} transfers in flight")
                return
            pending = self._pending[room] = PendingRoom(self._free_tags.popleft())
            self.ep.send_done[pending.tag] = 0
            self._staging_outstanding[room] = 1  # writes may be in flight from here on
        self.update_status(room, KVPoll.Transferring)
        try:
            for target in list(self.transfer_infos.get(room, {}).values()):
                if target.is_dummy:
                    continue
                pending.submitted += self._write_target(chunk, target, pending.tag)
        except (fabric.FabricError, LayoutError, ValueError, PdtoolBackendError) as exc:
            pending.submitted += getattr(exc, "submitted", 0)
            pending.last_seen = True
            self.conclude_failure(bootstrap_room=room, failure_reason=f"pdtool transfer: {exc}")
            return
        if chunk.is_last:
            pending.last_seen = True

    def _write_target(self, chunk: Chunk, t: RoomTarget, tag: int) -> int:
        peer = self.peers[t.peer]
        sent = chunk.index_slice.stop or 0
        if chunk.is_last and sent != len(t.kv_indices):
            # the decoder counts writes for every page it allocated: fail now, not at timeout
            raise PdtoolBackendError(f"prefill sends {sent} pages but decode {t.peer} allocated "
                                     f"{len(t.kv_indices)}; it would never complete")
        if peer.fi_addr is None:
            peer.fi_addr = self.ep.insert_peer(peer.fabric_name)
        imm = fabric.encode_imm(t.slot, t.gen)
        n = 0
        if peer.slice is not None and len(chunk.kv_indices):
            dst_pages = t.kv_indices[chunk.index_slice]
            src_pages = chunk.kv_indices[: len(dst_pages)]
            plans: dict[tuple[KVLayout, KVLayout], tuple[np.ndarray, ...]] = {}
            for i, (mr, region) in enumerate(zip(self.kv_mrs, peer.kv_regions, strict=True)):
                key = (self.kv_layouts[i], peer.kv_layouts[i])
                plan = plans.get(key)
                if plan is None:
                    plan = plans[key] = write_plan(key[0], key[1], src_pages, dst_pages,
                                                   peer.slice)
                self.ep.write_batch(peer.fi_addr, mr, region, *plan, imm=imm, tag=tag)
                n += len(plan[2])
        if chunk.is_last and peer.sends_aux and chunk.aux_index is not None \
                and t.aux_index is not None:
            for mr, region, ilen in zip(self.aux_mrs, peer.aux_regions, peer.aux_item_lens,
                                        strict=True):
                one = np.ones(1, dtype=np.uint64)
                self.ep.write_batch(peer.fi_addr, mr, region, one * (chunk.aux_index * ilen),
                                    one * (t.aux_index * ilen), one * ilen, imm=imm, tag=tag)
                n += 1
        return n

    def _settle_pending(self) -> None:
        for tag, errno, message in self.ep.errors:
            room = next((r for r, p in self._pending.items() if p.tag == tag), None)
            if room is not None:
                self._pending[room].last_seen = True
                self.conclude_failure(bootstrap_room=room,
                                      failure_reason=f"pdtool write failed: {message} ({errno})")
        now = time.monotonic()
        for room, p in list(self._pending.items()):
            drained = self.ep.send_done[p.tag] >= p.submitted
            status = self.request_status.get(room)
            if drained and (p.last_seen or status in (None, KVPoll.Failed)):
                # done, failed or cleared by the scheduler: nothing of ours is in flight now
                del self._pending[room]
                self._free_tags.append(p.tag)
                self._staging_outstanding.pop(room, None)
                self._maybe_ack_drained_abort(room)
                if p.last_seen and status not in (None, KVPoll.Failed):
                    self.update_status(room, KVPoll.Success)
            elif now - p.started > self._send_timeout and not p.last_seen:
                p.last_seen = True
                self.conclude_failure(bootstrap_room=room,
                                      failure_reason="pdtool: prefill chunks stopped arriving")

    # -- decode: slots and completion counting ----------------------------------------------
    def arm_slot(self, room: int, expected: int) -> tuple[int, int]:
        """Reserve a transfer slot for `room`, bump its generation and start counting."""
        with self._slot_lock:
            if not self._free_slots:
                raise PdtoolBackendError(f"more than {MAX_SLOTS} transfers in flight")
            slot = self._free_slots.popleft()
            gen = int(self._slot_gen[slot] + 1) & 0xFFFF
            self._slot_gen[slot] = gen
            self.ep.arm(slot, gen)  # takes the endpoint lock: no old-generation count slips in
            self._active[slot] = (room, expected)
        self._wake.set()
        return slot, gen

    def release_slot(self, slot: int) -> None:
        """Return a slot (called once per armed slot, from the receiver's clear()). Writes still
        in flight for it carry the old generation, so its next owner never counts them."""
        with self._slot_lock:
            self._active.pop(slot, None)
            self._free_slots.append(slot)

    def _decode_progress_loop(self) -> None:
        idle = 0
        while not self._stop.is_set():
            if not self._active:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            n = self.ep.poll()
            with self._slot_lock:
                items = list(self._active.items())
            if items:
                slots = np.fromiter((s for s, _ in items), dtype=np.int64, count=len(items))
                want = np.fromiter((e for _, (_, e) in items), dtype=np.int64, count=len(items))
                done = np.nonzero(self.ep.recv_counts[slots] >= want)[0]
                for i in done:
                    slot, (room, _) = items[i]
                    with self._slot_lock:
                        if self._active.get(slot, (None,))[0] != room:
                            continue
                        del self._active[slot]
                    self.update_status(room, KVPoll.Success)
            idle = 0 if n else idle + 1
            if idle > 64:
                time.sleep(0.0002)

    def _decode_control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stop.is_set():
            msg = recv()
            if not msg or self.handle_abort_ack_message(msg):
                continue
            parsed = self.parse_kv_status_message(msg)
            if parsed is None:
                logger.warning("pdtool decode: unexpected control message %r", msg[0][:20])
                continue
            room, status, prefill_rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status,
                                      prefill_rank=prefill_rank, failure_reason=reason)

    def teardown(self) -> None:
        self._stop.set()
        self.ep.close()


class PdtoolKVSender(CommonKVSender):
    """SGLang's sender; chunks go to the manager's writer thread (see add_transfer_request)."""


class PdtoolKVReceiver(CommonKVReceiver):
    """Counts this request's writes instead of waiting for a prefill status message."""

    slot: int | None = None

    def send_metadata(self, kv_indices: npt.NDArray[np.int32], aux_index: int | None = None,
                      state_indices: list | None = None, decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE,
                      device_kv_indices=None) -> None:
        mgr: PdtoolKVManager = self.kv_mgr  # type: ignore[assignment]
        if getattr(self, "bootstrap_infos", None) is None:
            return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len,
                                         destination, device_kv_indices)
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("pdtool: host KV destinations are not supported")
        if state_indices and any(s is not None and len(s) for s in state_indices):
            raise NotImplementedError("pdtool: state pools are not supported")
        try:
            expected = sglang_decode_writes(
                is_mla=mgr.is_mla, total_heads=mgr.total_kv_heads,
                prefill_tp=self.prefill_info.attn_tp_size, decode_tp=mgr.attn_tp_size,
                decode_rank=mgr.kv_args.engine_rank % mgr.attn_tp_size,
                page_size=mgr.kv_args.page_size, num_pages=len(kv_indices),
                num_buffers=len(mgr.kv_mrs),
                num_aux=len(mgr.aux_mrs) if aux_index is not None else 0,
            )
            self.slot, gen = mgr.arm_slot(self.bootstrap_room, expected)
        except (RouteError, PdtoolBackendError) as exc:
            mgr.record_failure(self.bootstrap_room, f"pdtool: {exc}")
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return
        for info in self.bootstrap_infos:
            frame = mgr.build_receiver_metadata_message(
                bootstrap_room=self.bootstrap_room,
                required_dst_info_num=self.required_dst_info_num,
                kv_indices=kv_indices, aux_index=aux_index, state_indices=None,
                decode_prefix_len=decode_prefix_len, is_dummy=info["is_dummy"],
                slot=self.slot, gen=gen,
            )
            if not self._send_bootstrap_message(bootstrap_info=info, message=frame,
                                                operation="send_metadata"):
                self.invalidate_cached_bootstrap_infos()
                return
        self.init_time = time.time()

    def _clear(self) -> None:
        super()._clear()
        if self.slot is not None:
            self.kv_mgr.release_slot(self.slot)  # type: ignore[attr-defined]
            self.slot = None


class PdtoolKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap registry, unchanged."""

"""SGLang 0.5.23 transfer backend `pdtool`: KV pages over pdtool's libfabric binding.

SGLang drives the request life cycle (bootstrap, page allocation, chunked prefill, aborts); this
backend only moves bytes and reports `KVPoll` states. It subclasses SGLang's `Common*` classes as
its mooncake and nixl backends do, so bootstrap (HTTP registry), rank mapping across TP sizes,
heartbeats, timeouts and failure bookkeeping stay SGLang's own code.

Data plane (pdtool's messenger rules, docs/messenger.md; `prefill_plane.py`, `decode_plane.py`):
  * a rank opens one libfabric `Endpoint` per NIC beside its GPU (`rails.py`, the plan's
    GPU->NIC map in PDTOOL_NICS) and registers every KV/aux buffer and its staging memory
    on each; the decode's further endpoints count into its first one's slots, the prefill
    stripes its operations, staged ones too, over its endpoints by bytes in flight (each
    operation counted once, whichever NIC);
  * registration: each decode rank sends REG to the prefill ranks it reads from; each answers
    PEER with the KV head count (SGLang's decode never gets it) and how many consecutive page
    writes it groups into one RMA operation (the smaller iov limit of the two endpoints);
  * prefill turns a chunk's page ids into (src offset, dst offset, length) arrays with
    `transfer.layout.write_plan` and queues them per decode peer; one writer thread submits
    them round-robin, each peer within its own budget of bytes in flight;
  * every write carries the decoder's 32-bit immediate `slot|generation`; the decoder counts
    operations per slot in C (the messenger's `transfer.plane.slots.SlotTable`) and declares
    `KVPoll.Success` when the count it computed from the shard routes is reached — no "done"
    message. A late write of an older generation never advances a reused slot;
  * prefill reports Success once its own operations completed locally (its pages may be
    reused); a failed operation counts as completed and fails its room. It sends a status
    message only on failure (with the reason), from its own outbox thread;
  * a backend thread that dies fails every live room at once with the reason, and later
    requests are refused with it (`PdtoolKVManager.problem`, `stats()`).

Pages: SGLang's pools are NHD per layer buffer — MHA `[slots, heads, head_dim]` with separate K
and V buffers, MLA `[slots, 1, kv_lora_rank + rope]` — and page p is slots [p*P, (p+1)*P).
  * equal attention TP, or MLA (replicated latent): a page of a layer buffer is contiguous on
    both sides: ONE write per (page, layer buffer), grouped per operation;
  * MHA/GQA with different prefill and decode TP: each decode rank receives, from each source
    rank `transfer.routes.routes_for` names, only its head slice, which in NHD would be one run
    per token; the prefill packs it into a registered bounce buffer and the decoder lands it in
    a staging area it scatters from before Success (or in place where the slice is all of its
    heads): one write per (page, layer buffer, source) — `staging_plane.py`;
  * `transfer.gpu_memory=staged` (PDTOOL_GPU_MEMORY): every page goes through the host bounce
    and landing buffers of `staging_plane.py` instead of registered pool memory;
  * the decoder counts writes for every page it allocated; a prefill that would send a
    different number of pages fails the room at its last chunk, with the reason;
  * a speculative draft model's own KV pool (EAGLE/NEXTN, EAGLE3, STANDALONE) is the last
    `KVArgs.num_draft_entries` buffers, addressed with the target's page ids: more layer
    buffers with their own geometry, told from the bytes a token takes in them on each side
    (`transfer.geometry.sglang_draft_group`: whole pages, or head slices through the same
    staging route), agreed at registration (PEER.draft) and counted by the same owner.
Not supported (clear error at start-up): hybrid/state pools (Mamba, SWA, DSA, ...), pipeline
or context parallelism, DCP, KV sharding, DFLASH/DSPARK draft KV, a draft pool of other layers
than the plan counted (PDTOOL_DRAFT_LAYERS), SGLang's staging buffer, host KV destinations.

Configuration (environment of every SGLang worker; the pdtool launcher sets them):
  PDTOOL_FI_PROVIDER   libfabric provider (default `tcp;ofi_rxm`; `shm` on one host, `efa`,
                       `verbs;ofi_rxm` on clusters)
  PDTOOL_FI_DOMAIN     libfabric domain (NIC) of this process's ranks, or
  PDTOOL_NICS          JSON {gpu id: "nic,..."}: each rank opens an endpoint on every NIC of
                       its GPU (`transfer.sglang.rails`; with tcp an entry may be an address)
  PDTOOL_SECRET_FILE   path of the per-deployment secret (hex, mode 0600, written at render
                       time); control frames are HMAC-SHA256 signed with it. The secret itself
                       never travels in the environment (other users' `ps e`/`/proc` cannot
                       read it there either way, but crash dumps and job printouts can).
  PDTOOL_SECRET        fallback only when no secret file is given (tests, hand-run workers)
  PDTOOL_GPU_MEMORY    direct | staged, as the worker resolved transfer.gpu_memory
  PDTOOL_LAYER_STREAM  auto | on | off: per-layer KV streaming on the prefill
                       (`layer_stream.py`; auto: host-memory pools only)
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

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
from sglang.srt.utils.network import NetworkAddress

from transfer import fabric, workerenv
from transfer.geometry import (
    KVGroup,
    sglang_decode_writes,
    sglang_draft_group,
    sglang_group_slices,
    sglang_slices,
)
from transfer.layout import KVLayout, LayoutError, sglang_buffer_layouts
from transfer.routes import RouteError, ShardSpec, Slice
from transfer.sglang import layer_stream
from transfer.sglang import metrics as transfer_metrics
from transfer.sglang.chunk import Chunk
from transfer.sglang.decode_plane import DecodePlane
from transfer.sglang.prefill_plane import PrefillPlane
from transfer.sglang.rails import RailError, Rails, rail_specs
from transfer.sglang.sources import dummy_flags
from transfer.sglang.staging_plane import (
    BOUNCE_BUFFERS,
    DecodeLanding,
    Landing,
    PrefillStaging,
    kv_path,
)
from transfer.wire import WireError, check_secret, compat_hash, read_secret
from transfer.wire.sglang import TAG, Frames, Hello, LandingArea, Meta, PeerAnswer, RailKeys
from transfer.wire.sglang import facts as wire_facts

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
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
    """The secret file's bytes (mode checked by transfer.wire.read_secret), read once; no
    secret at all refuses to start (frames are never signed with an empty key)."""
    try:
        return read_secret(path) if path else check_secret(fallback.encode() or None)
    except WireError as exc:
        raise PdtoolBackendError(f"PDTOOL_SECRET_FILE: {exc}") from None


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


# --------------------------------------------------------------------------- manager
class PdtoolKVManager(CommonKVManager):
    """One per scheduler rank: owns the fabric endpoint and the backend's threads.

    Built exactly as SGLang's `PrefillBootstrapQueue` / `DecodePreallocQueue._init_kv_manager`
    build it. The prefill's KVArgs carry `kv_head_num`/`total_kv_head_num`; the decode's do not
    (SGLang 0.5.23 sets them there only for its staging buffer, after the manager is built), so
    the decode learns the KV head count from each prefill rank's answer to its registration
    and the prefill derives the decode's local heads from the decode's item lengths."""

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
        # a draft model's own KV pool: its buffers come after the target's (SGLang appends
        # them in _init_kv_manager) and are addressed with the target's page ids
        self.num_draft = int(getattr(args, "num_draft_entries", 0) or 0)
        self._check_supported()
        self.is_mla = bool(is_mla_backend)
        self.problem = ""  # set when a backend thread died: every room fails with it
        # one step for "room still live?" + "mark it in flight", and for abort + ACK decisions
        self.room_lock = threading.RLock()
        self.kv_layouts: list[KVLayout] = []
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.total_kv_heads = 1 if self.is_mla else int(getattr(args, "total_kv_head_num", 0))
            self.heads_local = 1 if self.is_mla else int(getattr(args, "kv_head_num", 0))
            if not self.is_mla and (self.total_kv_heads < 1 or self.heads_local < 1):
                raise PdtoolBackendError("KVArgs.total_kv_head_num / kv_head_num are not set "
                                         "(SGLang's prefill scheduler sets them)")
            # the draft's buffers as one head unit of a whole token row here; each decode peer
            # gets them in the pair's own units (`_match_peer`)
            n = len(args.kv_item_lens)
            self.kv_layouts = sglang_buffer_layouts(
                args.kv_data_lens, args.kv_item_lens,
                [self.heads_local] * (n - self.num_draft) + [1] * self.num_draft,
                args.page_size)
        # direct: SGLang's pools are registered (CUDA memory: on FI_HMEM endpoints); staged:
        # KV goes through registered host bounce/landing buffers on every endpoint
        # (transfer.gpu_memory, as the worker decided it)
        self.kv_device = self._kv_device()
        self.kv_path = kv_path(self.kv_device.type, workerenv.provider(DEFAULT_PROVIDER),
                               self._probe_hmem)
        self.rails = self._open_rails(
            disaggregation_mode == DisaggregationMode.DECODE,
            hmem=self.kv_path == "direct" and self.kv_device.type == "cuda")
        self.ep = self.rails.primary  # the decode's slot table lives here
        # on SGLang's /metrics when it runs with --enable-metrics (metrics.py)
        self.metrics = transfer_metrics.for_manager(
            disaggregation_mode == DisaggregationMode.PREFILL,
            self.kv_args.engine_rank % self.attn_tp_size)
        # one signed envelope per manager (its session); no secret: the manager refuses to start
        self.frames = Frames(_secret(), f"{disaggregation_mode.value}-{self.peer_key}")
        self.compat = compat_hash(wire_facts(
            provider=self.ep.provider, is_mla=self.is_mla, page_size=args.page_size,
            num_kv_buffers=len(args.kv_data_lens), aux_item_lens=list(args.aux_item_lens),
            num_draft=self.num_draft))
        iface, device = self._memory_iface()
        try:
            self.kv_mrs = [] if self.kv_path == "staged" else \
                [self.rails.register(p, n, iface=iface, device=device)
                 for p, n in zip(args.kv_data_ptrs, args.kv_data_lens, strict=True)]
            # SGLang keeps metadata (aux) buffers in host memory (MetadataBuffers, device "cpu")
            self.aux_mrs = [self.rails.register(p, n)
                            for p, n in zip(args.aux_data_ptrs, args.aux_data_lens, strict=True)]
        except NotImplementedError as exc:
            raise PdtoolBackendError(
                f"pdtool transfer backend: cannot register {iface} memory with "
                f"{self.ep.provider}: {exc}"
            ) from exc
        self._stop = threading.Event()
        if disaggregation_mode == DisaggregationMode.PREFILL:
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
            self._threads = [
                threading.Thread(target=self._guard(self._prefill_outbox_loop),
                                 name="pdtool-prefill-outbox", daemon=True),
                threading.Thread(target=self._guard(self._prefill_control_loop),
                                 name="pdtool-prefill-control", daemon=True),
                threading.Thread(target=self._guard(self._prefill_writer_loop),
                                 name="pdtool-prefill-writer", daemon=True)]
        elif disaggregation_mode == DisaggregationMode.DECODE:
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
            self._threads = [threading.Thread(target=self._guard(self._decode_control_loop),
                                              name="pdtool-decode-control", daemon=True)]
            self._start_heartbeat_checker_thread()
        for t in self._threads:
            t.start()

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
        if self.num_draft:
            bad += self._draft_problems()
        if bad:
            raise PdtoolBackendError(
                "--disaggregation-transfer-backend pdtool does not support: " + "; ".join(bad)
                + ". Use mooncake or nixl for these deployments."
            )

    def _draft_problems(self) -> list[str]:
        """What this backend cannot carry of the draft model's KV buffers (KVArgs'
        num_draft_entries last buffers), and whether they are what the plan counted."""
        args, n = self.kv_args, self.num_draft
        total = len(args.kv_item_lens)
        if not 0 < n < total:
            return [f"KVArgs.num_draft_entries={n} of {total} KV buffers"]
        out = []
        draft_items = set(args.kv_item_lens[total - n:])
        if len(draft_items) != 1:
            out.append(f"draft-model KV buffers of different item lengths {sorted(draft_items)}"
                       " (K and V of different widths)")
        alg = str(getattr(self.server_args, "speculative_algorithm", "") or "").upper()
        if alg in ("DFLASH", "DSPARK"):
            out.append(f"--speculative-algorithm {alg} (its draft pool follows rules of its "
                       "own in SGLang 0.5.23: DFLASH's may run on a TP group of its own, DSPARK "
                       "needs DeepSeek-V4's hybrid pools; neither was checked with this backend)")
        try:
            want = workerenv.integer(workerenv.DRAFT_LAYERS)
        except workerenv.WorkerEnvError as exc:
            return [*out, str(exc)]
        if want is not None:
            per_layer = 1 if self.is_mla_backend else 2
            if want * per_layer != n:
                out.append(
                    f"draft-model KV of {n} buffers, while model.draft_layers={want} "
                    f"({workerenv.DRAFT_LAYERS.name}) makes {want * per_layer} "
                    f"({per_layer} per layer, as the target's): the plan's write counts "
                    f"would be wrong (set model.draft_layers to the draft model's KV layers)")
        return out

    def _open_rails(self, receive: bool, hmem: bool = False) -> Rails:
        """One endpoint per NIC of this rank's GPU (PDTOOL_NICS, else PDTOOL_FI_DOMAIN, else
        the provider's default). libfabric names domains after the device, EFA's RDM domain
        with a `-rdm` suffix; a first NIC that matches no domain falls back to the provider's
        default with a warning (it works, only slower when it is the wrong one), a further
        one is left out with a warning. `receive`: the decode's further endpoints count into
        the first one's slots (`Rails`)."""
        provider = workerenv.provider(DEFAULT_PROVIDER)
        try:
            nics = workerenv.nics_for(self.kv_args.gpu_id)
        except workerenv.WorkerEnvError as exc:
            raise PdtoolBackendError(str(exc)) from None
        try:
            return Rails.open(provider, rail_specs(provider, nics, self.local_ip), MAX_SLOTS,
                              receive=receive, hmem=hmem)
        except RailError as exc:
            raise PdtoolBackendError(str(exc)) from exc

    def _kv_device(self) -> Any:
        import torch

        if getattr(get_device(), "device", "cpu") == "cuda":
            return torch.device("cuda", int(self.kv_args.gpu_id or 0))
        return torch.device("cpu")

    def _probe_hmem(self) -> tuple[bool, str]:
        """`transfer.gpu_memory=auto` without the worker's answer: ask this libfabric."""
        nics = workerenv.nics_for(self.kv_args.gpu_id)
        return fabric.gpu_direct_support(workerenv.provider(DEFAULT_PROVIDER),
                                         domain=nics[0] if nics else None)

    def _memory_iface(self) -> tuple[str, int]:
        if self.kv_device.type == "cuda":
            return "cuda", int(self.kv_device.index or 0)
        return "system", 0

    def _guard(self, fn):
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # a dead thread must fail its rooms
                if not self._stop.is_set():
                    logger.exception("pdtool %s thread died", fn.__name__)
                    self._die(f"pdtool {fn.__name__.strip('_')} thread died: {exc!r}")
        return run

    def _die(self, reason: str) -> None:
        """A backend thread died: fail every live room now with the reason (instead of each
        waiting for its timeout) and refuse new ones with it (`problem`)."""
        if self._stop.is_set():
            return
        self.problem = self.problem or reason
        for room, status in list(self.request_status.items()):
            if status in (KVPoll.Success, KVPoll.Failed):
                continue
            if self.disaggregation_mode == DisaggregationMode.PREFILL:
                self.fail_room(room, self.problem)
            else:
                self.record_failure(room, self.problem)
                self.update_status(room, KVPoll.Failed)

    def update_status(self, bootstrap_room: int, status: KVPoll) -> None:
        """SGLang's status change; a decode room that ends here (Success or Failed, from any
        path: pdtool's counts, a peer's failure, SGLang's own timeouts) is counted once in
        the transfer metrics."""
        before = self.request_status.get(bootstrap_room)
        super().update_status(bootstrap_room, status)
        if self.disaggregation_mode != DisaggregationMode.DECODE or \
                before in (None, KVPoll.Success, KVPoll.Failed):
            return
        after = self.request_status.get(bootstrap_room)
        if after in (KVPoll.Success, KVPoll.Failed):
            seconds, peer = self.plane.armed_for(bootstrap_room) or (None, "")
            # SGLang's waiting timeout records "Request N timed out after ..." before this
            why = self.failure_records.get(bootstrap_room, "")
            self.metrics.transfer_ended(after == KVPoll.Success, seconds, peer,
                                        timed_out=" timed out after " in why)

    def stats(self) -> dict[str, Any]:
        """A snapshot for health checks and tests (`problem` empty while healthy)."""
        out: dict[str, Any] = {"problem": self.problem, "kv_path": self.kv_path,
                               **self.plane.stats()}
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            out["peers"] = len(self.peers)
            out.update(self.layer_stream.stats() if self.layer_stream is not None else {})
            out["av_entries"] = sum(len(ep._peers) for ep in self.rails.eps)
        else:
            out.update(self.landing.stats())
        out["rail_writes"] = self.rails.remote_writes()
        return out

    # -- decode -> prefill frames (called by CommonKVReceiver) ------------------------------
    @property
    def peer_key(self) -> str:
        return f"{self.local_ip}:{self.rank_port}"

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

    # -- prefill: writer thread (the only user of the endpoint) -------------------------------
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
        self.plane.chunks.put(Chunk(bootstrap_room, kv_indices, index_slice, is_last_chunk,
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

    # -- decode: slots and completion counting ----------------------------------------------
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

    def teardown(self) -> None:
        self._stop.set()
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self.plane.close()
            self.landing.close()
        else:
            self._outbox.put(None)
            if self.layer_stream is not None:
                self.layer_stream.close()
            for t in self._threads:
                if t.name == "pdtool-prefill-writer":
                    t.join(timeout=5)
            self.staging.close()
        self.rails.close()


class PdtoolKVSender(CommonKVSender):
    """SGLang's sender; chunks go to the manager's writer thread (see add_transfer_request).
    It may be handed page ids as a pinned host tensor whose copy completes at the chunk's
    `indices_event`: the writer waits for it, so the scheduler does not. SGLang's
    `send_kv_chunk` takes that route (a pinned copy and a CUDA event) whenever the sender
    says it can, so it says so only for KV pools on a GPU."""

    @property
    def supports_host_tensor_indices(self) -> bool:  # type: ignore[override]
        return self.kv_mgr.kv_device.type == "cuda"


class PdtoolKVReceiver(CommonKVReceiver):
    """Counts this request's writes instead of waiting for a prefill status message."""

    slot: int | None = None
    _cleared = False

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
        room, prefill_tp = self.bootstrap_room, self.prefill_info.attn_tp_size
        blocks = None
        if mgr.landing.needed(prefill_tp, mgr.attn_tp_size):
            try:
                blocks = mgr.landing.reserve(room, len(kv_indices))
            except ValueError as exc:
                self._fail(f"pdtool: {exc}")
                return
            if blocks is None:  # the landing area is full: wait for space, never allocate
                self.init_time = time.time()  # SGLang's waiting timeout covers the wait
                mgr.landing.wait(room, len(kv_indices),
                                 functools.partial(self._send_waited, kv_indices, aux_index,
                                                   decode_prefix_len),
                                 alive=self._still_wanted)
                return
        self._arm_and_send(kv_indices, aux_index, decode_prefix_len, blocks)

    def _fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def _still_wanted(self) -> bool:
        return not self._cleared and self.kv_mgr.request_status.get(self.bootstrap_room) \
            not in (None, KVPoll.Failed)

    def _send_waited(self, kv_indices: npt.NDArray[np.int32], aux_index: int | None,
                     decode_prefix_len: int | None, blocks: tuple[int, ...]) -> None:
        """Landing thread: the blocks a waiting request needed came free."""
        with self._lifecycle_lock:  # against SGLang's clear() in between
            if not self._still_wanted():
                self.kv_mgr.landing.give_back(blocks)  # never announced
                return
            self._arm_and_send(kv_indices, aux_index, decode_prefix_len, blocks)

    def _arm_and_send(self, kv_indices: npt.NDArray[np.int32], aux_index: int | None,
                      decode_prefix_len: int | None, blocks: tuple[int, ...] | None) -> None:
        mgr: PdtoolKVManager = self.kv_mgr  # type: ignore[assignment]
        # MLA: the sending replica is drawn per request (sources.py), not SGLang's fixed one
        dummies = dummy_flags(self.bootstrap_infos, mgr.is_mla)
        real = [i for i, d in zip(self.bootstrap_infos, dummies, strict=True) if not d] \
            or self.bootstrap_infos
        prefill_key = f"{real[0]['rank_ip']}:{real[0]['rank_port']}"
        try:
            self.slot, gen = mgr.arm(self.bootstrap_room, prefill_key,
                                     self.prefill_info.attn_tp_size, len(kv_indices),
                                     aux_index is not None)
        except (RouteError, PdtoolBackendError) as exc:
            if blocks is not None:
                mgr.landing.give_back(blocks)  # never announced
            self._fail(f"pdtool: {exc}")
            return
        if mgr.damage_pages is not None and len(kv_indices):
            mgr.damage_pages[self.bootstrap_room] = int(kv_indices[0])
        if blocks is not None:
            mgr.landing.hold(Landing(self.bootstrap_room, blocks,
                                     np.asarray(kv_indices, dtype=np.int64), prefill_key,
                                     self.prefill_info.attn_tp_size, self.slot))
        for info, dummy in zip(self.bootstrap_infos, dummies, strict=True):
            frame = mgr.build_receiver_metadata_message(
                bootstrap_room=self.bootstrap_room,
                required_dst_info_num=self.required_dst_info_num,
                kv_indices=kv_indices, aux_index=aux_index, state_indices=None,
                decode_prefix_len=decode_prefix_len, is_dummy=dummy,
                slot=self.slot, gen=gen, landing_blocks=blocks,
            )
            if not self._send_bootstrap_message(bootstrap_info=info, message=frame,
                                                operation="send_metadata"):
                self.invalidate_cached_bootstrap_infos()
                return
        self.init_time = time.time()

    def _clear(self) -> None:
        super()._clear()
        self._cleared = True
        if getattr(self, "_owns_bootstrap_room", True):  # a failed room's blocks: quarantined
            self.kv_mgr.landing.forget(self.bootstrap_room)
        if self.slot is not None:
            self.kv_mgr.plane.release(self.slot)  # type: ignore[attr-defined]
            self.slot = None


class PdtoolKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap registry, unchanged."""

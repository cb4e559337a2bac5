"""SGLang 0.5.23 transfer backend `pdtool`: KV pages over pdtool's libfabric binding.

SGLang drives the request life cycle (bootstrap, page allocation, chunked prefill, aborts); this
backend only moves bytes and reports `KVPoll` states. It subclasses SGLang's `Common*` classes as
its mooncake and nixl backends do, so bootstrap (HTTP registry), rank mapping across TP sizes,
heartbeats, timeouts and failure bookkeeping stay SGLang's own code.

The manager is SGLang's one class for both roles; its halves live in `prefill_side.py` and
`decode_side.py`, this module keeps what both share (set-up, failure, status, metrics) and
SGLang's sender, receiver and bootstrap server.

Data plane (pdtool's messenger rules, docs/messenger.md; `prefill_plane.py`, `decode_plane.py`):
  * a rank opens one libfabric `Endpoint` per NIC beside its GPU (`rails.py`, the plan's
    GPU->NIC map in PDTOOL_NICS) and registers every KV/aux buffer and its staging memory
    on each; the decode's further endpoints count into its first one's slots, the prefill
    stripes its operations, staged ones too, over its endpoints by bytes in flight (each
    operation counted once, whichever NIC);
  * registration: each decode rank sends HELLO to the prefill ranks it reads from; each answers
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
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_device

from transfer import fabric, workerenv
from transfer.layout import KVLayout, sglang_buffer_layouts
from transfer.routes import RouteError
from transfer.sglang import metrics as transfer_metrics
from transfer.sglang.decode_side import DecodeSide
from transfer.sglang.errors import MAX_SLOTS, PdtoolBackendError
from transfer.sglang.idle_wait import IdleWait
from transfer.sglang.prefill_side import PrefillSide
from transfer.sglang.rails import RailError, Rails, rail_specs
from transfer.sglang.sources import dummy_flags
from transfer.sglang.staging_plane import (
    Landing,
    direct_or_staged,
    kv_path,
)
from transfer.wakeups import Doorbell
from transfer.wire import WireError, check_secret, compat_hash, read_secret
from transfer.wire.sglang import Frames
from transfer.wire.sglang import facts as wire_facts

logger = logging.getLogger(__name__)

STATUS_TAG = b"PDTOOL_STATUS"
DEFAULT_PROVIDER = "tcp;ofi_rxm"


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


# --------------------------------------------------------------------------- manager
class PdtoolKVManager(PrefillSide, DecodeSide, CommonKVManager):
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
        self.news = Doorbell()  # rung on every room status change (update_status)
        self._idle_wait: IdleWait | bool | None = False  # False: not looked up yet
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
        # (transfer.gpu_memory, as the worker passes it; `auto` falls back to staged when the
        # FI_HMEM endpoints or the pools' registration are refused: staging_plane.kv_path)
        self.kv_device = self._kv_device()
        provider = workerenv.provider(DEFAULT_PROVIDER)
        kv = kv_path(self.kv_device.type, provider)
        receive = disaggregation_mode == DisaggregationMode.DECODE
        direct_rails = None  # the direct path's endpoints (FI_HMEM on a GPU); None: staged
        if kv.path == "direct":
            direct_rails = direct_or_staged(kv, provider, functools.partial(
                self._open_rails, receive, self.kv_device.type == "cuda"))
        self.rails = direct_rails if direct_rails is not None else self._open_rails(receive)
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
        # direct: SGLang's pools; on a GPU under `auto`, staged when they do not register
        mrs = None if direct_rails is None else \
            direct_or_staged(kv, provider, self._register_pools)
        self.kv_path = "staged" if mrs is None else "direct"
        self.kv_mrs = mrs or []
        # SGLang keeps metadata (aux) buffers in host memory (MetadataBuffers, device "cpu")
        self.aux_mrs = [self.rails.register(p, n)
                        for p, n in zip(args.aux_data_ptrs, args.aux_data_lens, strict=True)]
        self._stop = threading.Event()
        self._threads = self._start_prefill() \
            if disaggregation_mode == DisaggregationMode.PREFILL else self._start_decode()
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

    def _register_pools(self) -> list[fabric.MemoryRegion]:
        """SGLang's KV pools on every rail (direct path); none stays registered when one
        fails."""
        iface, device = self._memory_iface()
        mrs: list[fabric.MemoryRegion] = []
        try:
            for p, n in zip(self.kv_args.kv_data_ptrs, self.kv_args.kv_data_lens, strict=True):
                mrs.append(self.rails.register(p, n, iface=iface, device=device))
        except Exception:
            for mr in mrs:
                self.rails.release(mr)
            raise
        return mrs

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
        self.news.ring()  # a scheduler asleep in `idle_wait` looks at its rooms again
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

    def idle_wait(self, sched: Any) -> None:
        """SGLang's scheduler `sched` found nothing to run (after its `on_idle`): while a room
        of this manager is in flight, sleep until one changes or a request comes instead of
        polling again at once (idle_wait.py; only under --sleep-on-idle)."""
        if self._idle_wait is False:
            self._idle_wait = IdleWait.for_scheduler(sched, self.news, self.metrics)
        if self._idle_wait is None:
            return
        # a copy (made without releasing the GIL): the backend's threads change statuses
        # while this runs, and a dictionary changed during iteration would raise here
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in list(self.request_status.values())):
            return
        try:
            self._idle_wait.wait()
        except Exception as exc:  # never the scheduler's end: back to SGLang's own loop
            logger.warning("pdtool: the scheduler's idle wait failed (%r); it polls again "
                           "at once from now on, as SGLang does", exc)
            self._idle_wait = None

    def stats(self) -> dict[str, Any]:
        """A snapshot for health checks and tests (`problem` empty while healthy)."""
        out: dict[str, Any] = {"problem": self.problem, "kv_path": self.kv_path,
                               **self.plane.stats()}
        if isinstance(self._idle_wait, IdleWait):
            out["idle_waits"] = dict(self._idle_wait.ended)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            out["peers"] = len(self.peers)
            out.update(self.layer_stream.stats() if self.layer_stream is not None else {})
            out["av_entries"] = sum(len(ep._peers) for ep in self.rails.eps)
        else:
            out.update(self.landing.stats())
        out["rail_writes"] = self.rails.remote_writes()
        return out

    @property
    def peer_key(self) -> str:
        return f"{self.local_ip}:{self.rank_port}"

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

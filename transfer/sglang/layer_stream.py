"""Per-layer KV streaming on an SGLang prefill rank: a layer's pages go out once its attention ran.

Without it the backend learns about KV only when SGLang's scheduler calls `sender.send` after
the forward (`send_kv_chunk`), so the transfer of a chunk starts when its last layer is done.
With it the writes of layer L are posted while layers L+1.. still compute; the post-forward
send then carries only what is left (pages not yet posted, operations not yet whole, aux).

Two AROUND hooks, registered by `plugin.register` through SGLang's `HookRegistry` (thin there:
they come here only where a prefill manager of this backend has a stream):

* `Scheduler.run_batch` (`run_batch`): before the forward, learn which writes the
  post-forward `send_kv_chunk` of each request of the batch will make, as that function cuts
  them (`plan_request`): from `start_send_idx` to the end of this extend, the end page-aligned
  unless the chunk is the prompt's last. A ForwardBatch has no bootstrap room, so this side
  has to. Only rooms whose decode already sent every META (status WaitingForInput or
  Transferring) and whose sender is this backend's are planned; the others go per chunk.
* `AttentionBackend.forward` (`after_attention`): after a layer's attention in a planned
  extend on the target model's KV pool (the backend's `token_to_kv_pool` is the one planned;
  a draft model's pool is not), a marker is queued with the layer: a CUDA event recorded on
  the current stream when the pool is CUDA memory, else an already-complete marker (on the
  CPU the pool write has happened when forward returns). A layer already queued in this
  forward is not queued again (wrappers that call a child's forward, several calls per layer:
  its KV is written at the first).

The layer thread waits on each marker and hands the writer thread (the only user of the
endpoint) one `LayerPart` per planned room: that layer's buffers (K and V of the layer, or its
latent), those pages. The writer plans them with the same function as a chunk
(`PrefillPlane._plan`: `staging.writes` per buffer, grouped per operation from the room's
first write), and marks each (page, buffer) planned, so the chunk that SGLang sends after the
forward writes only what no layer part wrote, whichever reaches the writer first. The decoder
counts operations, not their order: its count (`geometry.sglang_decode_writes`) is unchanged.
A layer part never completes a partial operation (only the last chunk does), so a plan that
SGLang's send then contradicts cannot add an operation.

Fallbacks, each logged once: a planned forward in which no attention callback fired (the
`full` prefill CUDA graph captures attention: its replay calls no Python), two-batch overlap
and split prefill (a layer's attention runs once per micro-batch) -- the KV then goes per chunk
as without this module. `PDTOOL_LAYER_STREAM` (auto | on | off) switches it; auto: on for KV
pools in host memory, off for CUDA pools, whose event branch is written but has not run.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer import workerenv
from transfer.sglang.chunk import Chunk

logger = logging.getLogger(__name__)


@dataclass
class LayerPart(Chunk):
    """One layer's writes of one room (layer buffers `buffers`), for the writer thread."""

    buffers: tuple[int, ...] = ()


@dataclass
class PlannedRoom:
    """What the post-forward send of one request will write: decoder page positions
    `index_slice` and this rank's page ids `pages` for them (host numpy, or a pinned tensor
    complete at `pages_event`)."""

    room: int
    index_slice: slice
    pages: Any
    pages_event: Any = None


@dataclass
class ForwardPlan:
    stream: LayerStream
    pool: Any
    on_cuda: bool
    rooms: list[PlannedRoom]
    queued: set[int] = field(default_factory=set)  # layer ids handed to the layer thread


class _Complete:
    """The CPU's marker: the pool write is done when the attention call returns."""

    @staticmethod
    def synchronize() -> None:
        return None


_active: ForwardPlan | None = None  # the forward being launched (scheduler thread)


def enabled_for(pool_on_cuda: bool, environ: Any = None) -> bool:
    """PDTOOL_LAYER_STREAM for a pool in CUDA (True) or host memory: `auto` streams host
    pools only, since the CUDA branch has not run."""
    mode = workerenv.layer_stream(environ)
    return mode == "on" or (mode == "auto" and not pool_on_cuda)


def layer_buffers(pool: Any, kv_data_ptrs: list[int]) -> dict[int, tuple[int, ...]]:
    """Layer id -> indices into KVArgs.kv_data_ptrs of that layer's buffers, found by address
    (SGLang registers `k_buffer + v_buffer`, or `kv_buffer` for MLA). A layer whose buffers
    are not all registered is left out (its KV goes per chunk)."""
    where = {int(p): i for i, p in enumerate(kv_data_ptrs)}
    lists = [getattr(pool, a, None) for a in ("k_buffer", "v_buffer", "kv_buffer")]
    lists = [b for b in lists if isinstance(b, (list, tuple)) and b]
    start = int(getattr(pool, "start_layer", 0) or 0)
    out: dict[int, tuple[int, ...]] = {}
    for local in range(min((len(b) for b in lists), default=0)):
        idx = [where.get(int(b[local].data_ptr())) for b in lists]
        if all(i is not None for i in idx):
            out[start + local] = tuple(i for i in idx if i is not None)
    return out


class LayerStream:
    """One per prefill manager: plans forwards, queues finished layers, feeds the writer."""

    def __init__(self, mgr: Any) -> None:
        self.mgr = mgr
        self._buffers: dict[int, dict[int, tuple[int, ...]]] = {}  # id(pool) -> layer map
        self._layers: queue.SimpleQueue[tuple[ForwardPlan, int, Any] | None] = \
            queue.SimpleQueue()
        self._said: set[str] = set()
        self.forwards_planned = 0
        self.forwards_streamed = 0
        self.fallbacks = 0
        self.parts = 0
        self._thread = threading.Thread(target=mgr._guard(self._layer_loop),
                                        name="pdtool-layer-stream", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._layers.put(None)
        self._thread.join(timeout=5)

    def stats(self) -> dict[str, int]:
        return {"forwards_planned": self.forwards_planned,
                "forwards_streamed": self.forwards_streamed,
                "layer_fallbacks": self.fallbacks, "layer_parts": self.parts}

    def _once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.info(message, *args)

    # -- scheduler thread ---------------------------------------------------------------------
    def plan(self, sched: Any, batch: Any) -> ForwardPlan | None:
        """The writes the post-forward sends of `batch` will make, for the rooms that can
        stream; None when nothing of this forward streams."""
        mode = getattr(batch, "forward_mode", None)
        if mode is None or not mode.is_extend() or not getattr(batch, "reqs", None):
            return None
        if mode.is_split_prefill() or getattr(getattr(sched, "server_args", None),
                                               "enable_two_batch_overlap", False):
            self._once("split", "pdtool: split prefill / two-batch overlap runs each layer's "
                                "attention per part of the batch: KV goes per chunk")
            return None
        if getattr(sched, "enable_staging", False):
            return None  # SGLang's staging buffer (refused by this backend anyway)
        alloc = sched.token_to_kv_pool_allocator
        pool = alloc.get_kvcache()
        layers = self._buffers.get(id(pool))
        if layers is None:
            layers = self._buffers[id(pool)] = layer_buffers(
                pool, list(self.mgr.kv_args.kv_data_ptrs))
            if not layers:
                self._once("pool", "pdtool: KV pool %s has no per-layer buffers this backend "
                                   "registered: KV goes per chunk", type(pool).__name__)
        if not layers:
            return None
        rooms = [r for r in (plan_request(self.mgr, sched, req) for req in batch.reqs) if r]
        if not rooms:
            return None
        self.forwards_planned += 1
        return ForwardPlan(self, pool, _on_cuda(pool), rooms)

    def layer_done(self, plan: ForwardPlan, layer_id: int) -> None:
        """Inside the forward, after layer `layer_id`'s attention."""
        if layer_id in plan.queued or layer_id not in self._buffers.get(id(plan.pool), {}):
            return
        plan.queued.add(layer_id)
        self._layers.put((plan, layer_id, _marker(plan.on_cuda)))

    def finish(self, plan: ForwardPlan) -> None:
        """After the forward was launched: no callback means nothing streamed."""
        if plan.queued:
            self.forwards_streamed += 1
            self._once("streamed", "pdtool: per-layer KV streaming: a forward streamed %d "
                                   "layers of %d rooms", len(plan.queued), len(plan.rooms))
            return
        self.fallbacks += 1
        self._once("graph", "pdtool: no attention callback fired in a planned prefill "
                            "forward (the prefill CUDA graph captures attention?): its KV, and "
                            "that of every such forward, goes per chunk after the forward")

    # -- layer thread -------------------------------------------------------------------------
    def _layer_loop(self) -> None:
        while True:
            item = self._layers.get()
            if item is None:
                return
            plan, layer_id, marker = item
            marker.synchronize()  # the layer's KV is in the pool
            buffers = self._buffers[id(plan.pool)][layer_id]
            for r in plan.rooms:
                if r.pages_event is not None:  # the page ids' device->host copy
                    r.pages_event.synchronize()
                    r.pages_event = None
                if not isinstance(r.pages, np.ndarray):
                    r.pages = np.asarray(r.pages.numpy(), dtype=np.int32)
                self.mgr.plane.chunks.append(LayerPart(r.room, r.pages, r.index_slice,
                                                       False, None, buffers=buffers))
                self.parts += 1


def plan_request(mgr: Any, sched: Any, req: Any) -> PlannedRoom | None:
    """The pages `send_kv_chunk(req)` will send after this forward (SGLang 0.5.23,
    `disaggregation/prefill.py` `_send_kv_chunk`), as decoder positions and page ids; None
    when this request does not stream.

    SGLang sends tokens [start_send_idx, end): end = min(extend_end, prompt length), cut down
    to a page boundary unless this is the prompt's last chunk; one `send` per segment of
    `get_max_transfer_tokens()` tokens, which is None for this backend (DCP is refused), so
    one. Under overlap scheduling the previous chunk's send may come after this forward was
    launched, so `start_send_idx` may still be behind: the plan starts no earlier than this
    extend's first page (`prefix_len` rounded down), which earlier forwards completed."""
    sender = getattr(req, "disagg_kv_sender", None)
    if getattr(sender, "kv_mgr", None) is not mgr or getattr(req, "pending_bootstrap", True) \
            or req.finished() or getattr(req, "to_finish", None) is not None:
        return None
    if sender.get_max_transfer_tokens() is not None:
        return None
    from sglang.srt.disaggregation.base.conn import KVPoll

    room = sender.bootstrap_room
    if mgr.request_status.get(room) not in (KVPoll.WaitingForInput, KVPoll.Transferring):
        return None  # a decode's META is missing: per chunk
    targets = [t for t in list(mgr.transfer_infos.get(room, {}).values()) if not t.is_dummy]
    if not targets:
        return None
    alloc = sched.token_to_kv_pool_allocator
    page = alloc.page_size
    prompt = len(req.origin_input_ids)
    last = req.extend_end >= prompt
    end = min(req.extend_end, prompt)
    if not last:
        end -= end % page
    start = max(req.start_send_idx, req.prefix_len // page * page)
    base = int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
    if end <= start or start < base or (start - base) % page:
        return None
    k0, k1 = (start - base) // page, -(-(end - base) // page)
    if k1 > getattr(sender, "num_kv_indices", 0) or any(k1 > len(t.kv_indices) for t in targets):
        return None
    tokens = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end]
    ids = alloc.translate_kv_indices_for_transfer(tokens)[::page] // page
    event = None
    if ids.is_cuda:  # GPU branch: written, not run (no GPU where this was built)
        import torch

        host = torch.empty(ids.shape, dtype=ids.dtype, device="cpu", pin_memory=True)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(ids.device))
        ids = host
    else:
        ids = np.asarray(ids.numpy(), dtype=np.int32)
    return PlannedRoom(room, slice(k0, k1), ids, event)


def _on_cuda(pool: Any) -> bool:
    return str(getattr(pool, "device", "cpu")).startswith("cuda")


def _marker(on_cuda: bool) -> Any:
    """What the layer thread waits on before reading the layer's pages."""
    if on_cuda:  # GPU branch: written, not run (no GPU where this was built)
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event
    return _Complete


# --------------------------------------------------------------------------- the hooks
# plugin.py's thin hooks call these only where a prefill manager of this backend has a stream
def run_batch(stream: LayerStream, original: Any, sched: Any, batch: Any, *args: Any,
              **kwargs: Any) -> Any:
    """`Scheduler.run_batch` with a layer stream: plan the batch's writes, launch the
    forward, then check that its layers reported (else per chunk, logged once)."""
    global _active
    plan = stream.plan(sched, batch)
    if plan is None:
        return original(sched, batch, *args, **kwargs)
    _active = plan
    try:
        return original(sched, batch, *args, **kwargs)
    finally:
        _active = None
        stream.finish(plan)


def after_attention(backend: Any, layer: Any, forward_batch: Any) -> None:
    """After `AttentionBackend.forward` returned: in a planned extend on the planned pool,
    queue the layer."""
    plan = _active
    if plan is not None and forward_batch.forward_mode.is_extend() and \
            getattr(backend, "token_to_kv_pool", None) is plan.pool:
        plan.stream.layer_done(plan, int(layer.layer_id))


def start(mgr: Any) -> LayerStream | None:
    """The prefill manager's layer stream, or None where PDTOOL_LAYER_STREAM says no."""
    on_cuda = mgr.kv_device.type == "cuda"
    on = enabled_for(on_cuda)  # WorkerEnvError: the caller names it the backend's error
    if not on:
        logger.info("pdtool: per-layer KV streaming off (PDTOOL_LAYER_STREAM=%s%s)",
                    workerenv.layer_stream(), ", CUDA pool" if on_cuda else "")
        return None
    return LayerStream(mgr)

"""Staged GPU memory (`transfer.gpu_memory=staged`): KV moves through registered host memory.

Where the provider cannot register GPU memory (Debian's libfabric has no CUDA; tcp;ofi_rxm never
has FI_HMEM, see `transfer.gpu_memory`), the sender copies pages device -> host into a bounded
pool of pinned, registered bounce buffers and writes from there; the receiver's writes land in a
registered host landing area and are copied host -> device once the transfer's count is reached.
The counting protocol is unchanged: every operation still carries the slot's immediate data and
the decoder still counts operations; only the memory the operations read and write differs.

Sender (prefill), one per endpoint::

    pool = BouncePool(ep, buffers=4, buffer_bytes=8 << 20, device=kv.device)
    sender = StagedSender(ep, pool)
    for layer in finished_layers:                   # or all at once: an iterable of Chunk
        nops += sender.send(peer, remote, [Chunk(kv_flat, src_offs, lengths, dst_offs)],
                            imm=encode_imm(slot, gen), per_op=k)
    sender.flush()                                  # every write completed locally

`send` pipelines the chunks of one call: the device -> host copy of a chunk runs on a side
stream (a worker thread for CPU tensors) while the writes of the previous chunk are posted
(chunk i+1's copy is always issued before chunk i's writes), and a chunk's writes are posted
only once its copy's event completed. At most `buffers`
chunks are staged at a time (bounded memory: the pool is allocated once); a chunk larger than
a buffer is split at multiples of `per_op` writes, so it becomes exactly as many operations as
one `write_batch` of it would (the receiver's expected count does not change).

Receiver (decode)::

    landing = LandingPool(ep, capacity_bytes=256 << 20, block_bytes=1 << 20)
    grant = landing.reserve(lengths)        # None when full: keep the request waiting
    # send grant.region and grant.dst_offsets to the sender in place of the KV offsets,
    # arm the slot and count exactly as for unstaged transfers; once the count is reached:
    landing.deliver(grant, kv_flat, kv_offsets)   # host -> device; returns once copied
    landing.release(grant)

Both sides work on flat uint8 views of the KV buffers (torch tensors, CUDA or CPU). CUDA is
imported only when a tensor is a CUDA tensor: on CPU the "device copy" is a host copy through
the same code, which is what the CPU tests exercise.

Head slices (SGLang's backend, `transfer/sglang/staging_plane.py`): the same pools serve a TP
mismatch on NHD pools. `_Copier.gather_slice` packs heads [h, h+n) of a page's token rows into
one contiguous run `[tokens, n, head]` of a bounce buffer (one index_select; on a device on the
side stream, with an event), so the run is one write; `_Copier.scatter_slice` puts landed runs
back into the NHD rows once the count is reached. `BouncePool.try_take` / `LandingPool.
reserve_blocks` never block: the caller keeps the request waiting for space instead.
`tensor_at` views memory SGLang allocated (its pools' data pointers) as such a tensor.

Several NICs (`Carriers`, SGLang's backend's `transfer.sglang.rails.Rails`): a pool whose
writes go out on (or land through) several endpoints is registered on each of them, and a
bounce buffer counts its writes' local completions summed over them: it is free again only
once every write from it completed, whichever endpoint carried it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .fabric import (
    DEFAULT_TIMEOUT_S,
    Endpoint,
    FabricError,
    MemoryRegion,
    RemoteRegion,
    buffer_address,
)

__all__ = ["BouncePool", "Carriers", "Chunk", "LandingGrant", "LandingPool", "StagedSender",
           "landing_offsets", "tensor_at"]


class Carriers(Protocol):
    """The endpoints (one per NIC) that carry a pool's writes, as one: `register` registers
    memory on each and returns the first one's registration (the others' are its twins);
    `send_done(tag)` is a tag's local completions summed over them; `poll` drives them all;
    `release` closes a registration and its twins."""

    def register(self, addr: int, length: int, **kw: Any) -> MemoryRegion: ...

    def send_done(self, tag: int) -> int: ...

    def poll(self) -> int: ...

    def release(self, mr: MemoryRegion) -> None: ...


@dataclass
class Chunk:
    """Pages of one layer (or any group) to send: `src` is a flat uint8 tensor (a KV buffer,
    CUDA or CPU); write i copies src[src_offsets[i]:+lengths[i]] to the peer's
    dst_offsets[i] (offsets into the remote region, e.g. a `LandingGrant`'s)."""

    src: Any
    src_offsets: np.ndarray
    lengths: np.ndarray
    dst_offsets: np.ndarray

    def __post_init__(self) -> None:
        self.src_offsets = np.ascontiguousarray(self.src_offsets, dtype=np.uint64)
        self.lengths = np.ascontiguousarray(self.lengths, dtype=np.uint64)
        self.dst_offsets = np.ascontiguousarray(self.dst_offsets, dtype=np.uint64)
        n = len(self.lengths)
        if len(self.src_offsets) != n or len(self.dst_offsets) != n:
            raise ValueError(f"Chunk: src_offsets/lengths/dst_offsets differ in length: "
                             f"{len(self.src_offsets)}, {n}, {len(self.dst_offsets)}")
        nbytes = _nbytes(self.src)
        if n and int((self.src_offsets + self.lengths).max()) > nbytes:
            raise ValueError(f"Chunk: a source range runs past the {nbytes}-byte buffer")

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _is_cuda(t: Any) -> bool:
    return getattr(getattr(t, "device", None), "type", "cpu") == "cuda"


class _DeviceMemory:
    """A raw CUDA range as `__cuda_array_interface__`, so torch can view it without a copy."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (addr, False), "version": 3}


def tensor_at(addr: int, nbytes: int, device: Any = "cpu") -> Any:
    """A flat uint8 torch tensor over memory someone else owns (SGLang's pool buffers, given as
    `KVArgs.kv_data_ptrs/lens`); the owner keeps it alive. CPU: through numpy; CUDA: through
    `__cuda_array_interface__` (no CUDA import for CPU memory)."""
    import ctypes

    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.as_tensor(_DeviceMemory(addr, nbytes), device=dev)
    raw = (ctypes.c_uint8 * nbytes).from_address(addr)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8))


def landing_offsets(blocks: Sequence[int] | np.ndarray, block_bytes: int, unit: int,
                    index: np.ndarray) -> np.ndarray:
    """Byte offsets in a LandingPool's memory of landing units `index` of a transfer granted
    `blocks` (`reserve_blocks`): units of `unit` bytes, `block_bytes // unit` per block, in
    order. The one packing rule both sides use (the sender computes where its writes go from
    the block ids alone, so they travel instead of one offset per write)."""
    per = block_bytes // unit
    if per < 1:
        raise ValueError(f"landing: a {unit}-byte unit does not fit a {block_bytes}-byte block")
    index = np.asarray(index, dtype=np.int64)
    b = np.asarray(blocks, dtype=np.int64)
    if len(index) and int(index.max()) >= len(b) * per:
        raise ValueError(f"landing: unit {int(index.max())} is past the {len(b)} granted "
                         f"block(s) of {per} unit(s)")
    return (b[index // per] * block_bytes + (index % per) * unit).astype(np.uint64)


def _uniform(offsets: np.ndarray, lengths: np.ndarray, *buffers: Any) -> int:
    """The common length L when every range is an L-aligned L-byte page of buffers whose
    sizes are multiples of L (the fast path: one index_select/index_copy per chunk instead of
    one copy per page), else 0."""
    if not len(lengths):
        return 0
    size = int(lengths[0])
    if (size and bool((lengths == size).all()) and not bool((offsets % size).any())
            and all(_nbytes(b) % size == 0 for b in buffers)):
        return size
    return 0


class _Copier:
    """Asynchronous copies between a KV tensor and host memory. CUDA tensors: on a side stream
    of their device, completion = a recorded event. CPU tensors: on one worker thread (torch
    releases the GIL while copying), completion = its future. Handles are opaque.

    Order on a GPU: the copies run on backend threads, whose current stream is the legacy
    default stream, which SGLang's forward stream (a non-blocking stream from PyTorch's pool)
    does not synchronise with; waiting on it ordered nothing. So the side stream waits on no
    stream: every caller hands over only pages whose producer the host already waited for.
    On the prefill, SGLang calls `send_kv_chunk` after synchronising the batch's result on the
    host (`disaggregation/prefill.py`), a per-layer part comes after the layer thread's wait
    on the layer's event (`sglang/layer_stream.py`), and a cached prefix sent early after the
    writer's wait on its `wait_event` (`sglang/prefill_plane.py`); on the decode, the pages
    written to were allocated for this request, and the copy ends with a wait on the side
    stream before the request is reported ready."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        if self.cuda:
            import torch

            self._torch = torch
            self.stream = torch.cuda.Stream(device=device)
        else:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "pdtool-staging")

    # ------------------------------------------------------------------ sender: gather
    def gather(self, src: Any, offsets: np.ndarray, lengths: np.ndarray, out: Any) -> Any:
        """Copy the ranges of `src`, packed one after another, into the host tensor `out`."""
        if not self.cuda:
            return self._thread.submit(_gather_into, src, offsets, lengths, out)
        torch = self._torch
        with torch.cuda.stream(self.stream):
            size = _uniform(offsets, lengths, src)
            keep = None
            if size:
                idx = torch.as_tensor((offsets // size).astype(np.int64), device=src.device)
                keep = src.view(-1, size).index_select(0, idx)  # packed on the GPU
                out[:keep.numel()].view_as(keep).copy_(keep, non_blocking=True)
            else:
                pos = 0
                for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
                    out[pos:pos + n].copy_(src[o:o + n], non_blocking=True)
                    pos += n
            event = torch.cuda.Event()
            event.record(self.stream)
        return event, keep  # keep the packed temporary alive until the event

    def gather_slice(self, src: Any, rows: Any, head_lo: int, heads: int, out: Any) -> Any:
        """Pack heads [head_lo, head_lo + heads) of token rows `rows` (int64) of an NHD buffer
        `src` ([slots, heads_local, head_bytes] uint8) into `out` as [rows, heads, head_bytes],
        one contiguous run; returns a handle (`wait`/`done`)."""
        n = len(rows) * heads * src.shape[2]
        if not self.cuda:
            view = out[:n].view(len(rows), heads, src.shape[2])
            return self._thread.submit(torch_index_select, src[:, head_lo:head_lo + heads],
                                       rows, view)
        torch = self._torch
        with torch.cuda.stream(self.stream):
            idx = rows.to(src.device, non_blocking=True)
            keep = src[:, head_lo:head_lo + heads].index_select(0, idx)  # packed on the GPU
            out[:n].view_as(keep).copy_(keep, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event, keep

    def landed_to(self, units: Any, rows: np.ndarray, device: Any) -> Any:
        """`units[rows]` (host landing memory, [units, unit bytes]; pinned on the staged GPU
        path) as a tensor on `device`: one copy per contiguous run of `rows` (a request's
        units sit in whole blocks) straight from the landing memory. A CPU `index_select`
        first made a pageable copy, which the host -> device copy then had to go through
        again; on CUDA these copies are queued on the copier's stream, which `scatter_slice`
        uses next and waits for."""
        import torch

        out = torch.empty((len(rows), units.shape[1]), dtype=units.dtype, device=device)
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            for a, b in _runs(rows, 1):
                first = int(rows[a])
                out[a:b].copy_(units[first:first + b - a], non_blocking=self.cuda)
        return out

    def scatter_slice(self, landed: Any, dst: Any, rows: Any, head_lo: int, heads: int) -> None:
        """The reverse of `gather_slice`, after the count: `landed` ([rows, heads, head_bytes],
        landing memory) into heads [head_lo, +heads) of token rows `rows` of `dst`; returns
        once the data is there."""
        if not self.cuda:
            dst[rows, head_lo:head_lo + heads] = landed
            return
        torch = self._torch
        with torch.cuda.stream(self.stream):
            idx = rows.to(dst.device, non_blocking=True)
            dst[idx, head_lo:head_lo + heads] = landed.to(dst.device, non_blocking=True)
        self.stream.synchronize()

    # ------------------------------------------------------------------ receiver: scatter
    def scatter(self, host: Any, host_offsets: np.ndarray, dst: Any, offsets: np.ndarray,
                lengths: np.ndarray) -> None:
        """Copy host[host_offsets[i]:+lengths[i]] to dst[offsets[i]:+lengths[i]]; returns
        once the data is in `dst` (the engine may use the pages right after)."""
        if not self.cuda:
            _scatter_from(host, host_offsets, dst, offsets, lengths)
            return
        torch = self._torch
        with torch.cuda.stream(self.stream):
            size = _uniform(offsets, lengths, dst)
            if size:
                # one host -> device copy per contiguous run of landed pages, then one
                # index_copy_ into the KV pages
                n = len(lengths)
                packed = torch.empty(n * size, dtype=torch.uint8, device=dst.device)
                for a, b in _runs(host_offsets, size):
                    h = int(host_offsets[a])
                    packed[a * size:b * size].copy_(host[h:h + (b - a) * size],
                                                    non_blocking=True)
                didx = torch.as_tensor((offsets // size).astype(np.int64), device=dst.device)
                dst.view(-1, size).index_copy_(0, didx, packed.view(n, size))
            else:
                for h, o, n in zip(host_offsets.tolist(), offsets.tolist(), lengths.tolist(),
                                   strict=True):
                    dst[o:o + n].copy_(host[h:h + n], non_blocking=True)
        self.stream.synchronize()

    def done(self, handle: Any) -> bool:
        return handle[0].query() if self.cuda else handle.done()

    def wait(self, handle: Any) -> None:
        if self.cuda:
            handle[0].synchronize()
        else:
            handle.result()

    def close(self) -> None:
        if not self.cuda:
            self._thread.shutdown(wait=True)


def _runs(offsets: np.ndarray, size: int) -> list[tuple[int, int]]:
    """[a, b) index ranges over which offsets[i] advance by exactly `size` (contiguous)."""
    if not len(offsets):
        return []
    breaks = np.flatnonzero(np.diff(offsets.astype(np.int64)) != size) + 1
    edges = [0, *breaks.tolist(), len(offsets)]
    return list(itertools.pairwise(edges))


def torch_index_select(src: Any, rows: Any, out: Any) -> None:
    """index_select into `out` (a view of bounce memory), on the copier's worker thread."""
    import torch

    torch.index_select(src, 0, rows, out=out)


def _gather_into(src: Any, offsets: np.ndarray, lengths: np.ndarray, out: Any) -> None:
    import torch

    size = _uniform(offsets, lengths, src)
    if size:
        idx = torch.as_tensor((offsets // size).astype(np.int64))
        n = len(lengths)
        torch.index_select(src.view(-1, size), 0, idx, out=out[:n * size].view(n, size))
        return
    pos = 0
    for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
        out[pos:pos + n].copy_(src[o:o + n])
        pos += n


def _scatter_from(host: Any, host_offsets: np.ndarray, dst: Any, offsets: np.ndarray,
                  lengths: np.ndarray) -> None:
    import torch

    size = _uniform(offsets, lengths, dst)
    if size:
        # one index_copy_ per contiguous run of landed pages, straight from the landing
        # memory (an index_select first would allocate and fault in a temporary)
        didx = torch.as_tensor((offsets // size).astype(np.int64))
        for a, b in _runs(host_offsets, size):
            h = int(host_offsets[a])
            dst.view(-1, size).index_copy_(0, didx[a:b], host[h:h + (b - a) * size].view(-1, size))
        return
    for h, o, n in zip(host_offsets.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
        dst[o:o + n].copy_(host[h:h + n])


def _host_memory(nbytes: int, pinned: bool) -> Any:
    """A zeroed uint8 host tensor in its own huge-page-advised anonymous mapping (hostmem),
    page-locked with cudaHostRegister when CUDA copies use it (so they run as DMA, without a
    hidden staging copy). Not cudaHostAlloc: shm's receiver reads this memory with
    process_vm_readv, which needs ordinary process pages, not a driver mapping."""
    import torch

    from .hostmem import host_buffer

    buf = host_buffer((nbytes,), torch.uint8)
    if pinned:
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
        if err != 0 or not buf.is_pinned():
            raise RuntimeError(f"staging: cudaHostRegister of {nbytes} bytes failed (cudaError "
                               f"{err}); the bounce/landing memory cannot be page-locked")
    return buf


def _release_host_memory(buf: Any, pinned: bool) -> None:
    if pinned:  # (not buf.is_pinned(): on CPU that asks the CUDA runtime)
        import torch

        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class BouncePool:
    """`buffers` host bounce buffers of `buffer_bytes` each: one allocation, registered once on
    `ep` (read by the local writes only), or on every endpoint of `carriers`. Buffer i counts
    its writes' local completions in send_done[tag_base + i] (summed over the carriers); it is
    free again once they all completed."""

    def __init__(self, ep: Endpoint, *, buffers: int = 4, buffer_bytes: int = 8 << 20,
                 device: Any = "cpu", tag_base: int | None = None,
                 on_device: bool = False, carriers: Carriers | None = None) -> None:
        if buffers < 2:
            raise ValueError(f"BouncePool: buffers must be >= 2 to overlap copies and writes, "
                             f"got {buffers}")
        if buffer_bytes < 1:
            raise ValueError(f"BouncePool: buffer_bytes must be >= 1, got {buffer_bytes}")
        if tag_base is None:
            tag_base = ep.max_slots - buffers
        if not 0 <= tag_base <= ep.max_slots - buffers:
            raise ValueError(f"BouncePool: tags {tag_base}..{tag_base + buffers - 1} do not fit "
                             f"the endpoint's {ep.max_slots} slots")
        import torch

        self.device = torch.device(device)
        self.buffers = buffers
        self.buffer_bytes = buffer_bytes
        self.tag_base = tag_base
        # on_device (transfer.gpu_memory=direct with a TP mismatch: the gather only packs head
        # slices, the memory stays where the provider reads it); else pinned host memory
        self.on_device = on_device and self.device.type == "cuda"
        self._carriers = carriers
        self.memory, self.mr = _registered(carriers.register if carriers else ep.register,
                                           buffers * buffer_bytes, self.device,
                                           self.on_device, remote_write=False)
        self._ep = ep
        self.posted = np.zeros(buffers, dtype=np.int64)  # operations posted per buffer, ever
        self.errored = np.zeros(buffers, dtype=np.int64)  # of those, completed with an error
        self._free = collections.deque(range(buffers))
        self._inflight: list[int] = []  # posted, writes not yet all completed (oldest first)
        self.leaked: set[int] = set()  # writes never completed: never reused
        self.in_use_peak = 0

    @property
    def allocated_bytes(self) -> int:
        """Host memory the pool holds (fixed at creation, whatever is sent through it)."""
        return self.buffers * self.buffer_bytes

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    def view(self, i: int) -> Any:
        return self.memory[i * self.buffer_bytes:(i + 1) * self.buffer_bytes]

    def _target(self, i: int) -> int:
        return int(self.posted[i] & 0xFFFFFFFF)  # send_done is uint32

    def in_use(self) -> int:
        return self.buffers - len(self._free) - len(self.leaked)

    def try_take(self) -> int | None:
        """A free buffer, or None while all are in use (the caller waits, never allocates)."""
        if not self._free:
            self.reclaim(block=False, timeout=0)
            if not self._free:
                return None
        i = self._free.popleft()
        self.in_use_peak = max(self.in_use_peak, self.buffers - len(self._free))
        return i

    def give_back(self, i: int) -> None:
        """A taken buffer none of whose writes was posted (its room failed first)."""
        self._free.append(i)

    def leak(self, i: int) -> None:
        """Buffer i's writes will never be known complete (a peer that never drained): it
        leaves the pool for good rather than be overwritten under a posted write."""
        if i in self._inflight:
            self._inflight.remove(i)
        self.leaked.add(i)

    def take(self, timeout: float) -> int:
        """A free buffer; waits (driving the endpoint's writes) while all are in use."""
        if not self._free:
            self.reclaim(block=True, timeout=timeout)
        i = self._free.popleft()
        self.in_use_peak = max(self.in_use_peak, self.buffers - len(self._free))
        return i

    def posted_to(self, i: int, ops: int) -> None:
        """Buffer i's writes were posted: it is free once `ops` more completed locally."""
        self.posted[i] += ops
        self._inflight.append(i)

    def owns_tag(self, tag: int) -> bool:
        return self.tag_base <= tag < self.tag_base + self.buffers

    def failed_write(self, tag: int) -> int:
        """A completion error on buffer `tag - tag_base`'s tag: that write is settled too (so
        the buffer comes free); returns the buffer."""
        i = tag - self.tag_base
        self.errored[i] += 1
        return i

    def _done(self, tag: int) -> int:
        if self._carriers is not None:
            return self._carriers.send_done(tag)
        return int(self._ep.send_done[tag])

    def _complete(self, i: int) -> bool:
        done = self._done(self.tag_base + i) + int(self.errored[i] & 0xFFFFFFFF)
        return done & 0xFFFFFFFF >= self._target(i)

    def _wait_send(self, i: int, timeout: float) -> bool:
        """Until buffer i's writes completed (True) or `timeout` (False): in C on one endpoint,
        else polling every carrier."""
        if self._carriers is None:
            return self._ep.wait_send(self.tag_base + i, self._target(i), timeout)
        deadline = time.monotonic() + timeout
        while not self._complete(i):
            if time.monotonic() >= deadline:
                return False
            if not self._carriers.poll():
                time.sleep(0.0001)
        return True

    def reclaim(self, *, block: bool, timeout: float) -> list[int]:
        """Free the buffers whose writes all completed (or failed), returning them; with
        `block`, wait for the oldest one when none has (FabricError on timeout)."""
        deadline = time.monotonic() + timeout
        freed: list[int] = []
        while True:
            done = [i for i in self._inflight if self._complete(i)]
            for i in done:
                self._inflight.remove(i)
                self._free.append(i)
            freed += done
            if self._free or not block or not self._inflight:
                return freed
            oldest = self._inflight[0]
            left = deadline - time.monotonic()
            if left <= 0 or not self._wait_send(oldest, left):
                raise FabricError("staged send", 110, f"no bounce buffer came free within "
                                  f"{timeout:.1f} s (writes not completing)")

    def wait_all(self, timeout: float) -> None:
        """Until every posted write completed locally (FabricError on timeout or a failed
        write, whose completion error names the buffer's tag)."""
        deadline = time.monotonic() + timeout
        while self._inflight:
            i = self._inflight[0]
            left = max(0.0, deadline - time.monotonic())
            if not self._wait_send(i, left):
                raise FabricError("staged send", 110, f"bounce buffer {i}'s writes did not "
                                  f"complete within {timeout:.1f} s")
            self.reclaim(block=False, timeout=0)

    def close(self) -> None:
        _deregister(self.mr, self._carriers)
        if not self.on_device:
            _release_host_memory(self.memory, self.device.type == "cuda")


def _registered(register: Any, nbytes: int, device: Any, on_device: bool,
                **kw: Any) -> tuple[Any, MemoryRegion]:
    """Staging memory and its registration by `register(addr, length, **kw)` (an endpoint's,
    or the carriers' on each of theirs): device memory registered as CUDA memory (direct
    path) or pinned host memory (`_host_memory`)."""
    if on_device:
        import torch

        mem = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return mem, register(mem.data_ptr(), nbytes, iface="cuda", device=device.index or 0,
                             **kw)
    mem = _host_memory(nbytes, pinned=device.type == "cuda")
    addr, n = buffer_address(mem)
    return mem, register(addr, n, **kw)


def _deregister(mr: MemoryRegion, carriers: Carriers | None) -> None:
    if carriers is not None:
        carriers.release(mr)
    else:
        mr.close()


@dataclass
class _Staged:
    index: int
    buffer: int
    chunk: Chunk
    handle: Any


class StagedSender:
    """Sends Chunks through a BouncePool (see the module docstring). One thread at a time: the
    thread that owns the endpoint. `trace` (when a list) records ("copy", i) when piece i's
    device -> host copy is issued and ("post", i) once its writes were posted."""

    def __init__(self, ep: Endpoint, pool: BouncePool, *,
                 trace: list[tuple[str, int]] | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.ep = ep
        self.pool = pool
        self.trace = trace
        self.timeout = timeout
        self._copier = _Copier(pool.device)
        self._count = 0

    def _pieces(self, chunk: Chunk, per_op: int) -> Iterable[Chunk]:
        """`chunk` cut to fit one bounce buffer, each piece but the last a multiple of `per_op`
        writes (so the pieces make as many operations as the whole chunk would)."""
        cap = self.pool.buffer_bytes
        n = len(chunk.lengths)
        ends = np.cumsum(chunk.lengths, dtype=np.uint64)
        start, base = 0, 0
        while start < n:
            fit = int(np.searchsorted(ends, base + cap, side="right"))  # writes that fit
            stop = n if fit >= n else start + (fit - start) // per_op * per_op
            if stop <= start:
                raise ValueError(f"StagedSender: {per_op} write(s) of up to "
                                 f"{int(chunk.lengths.max())} bytes do not fit a {cap}-byte "
                                 f"bounce buffer")
            yield Chunk(chunk.src, chunk.src_offsets[start:stop], chunk.lengths[start:stop],
                        chunk.dst_offsets[start:stop])
            base = int(ends[stop - 1])
            start = stop

    def send(self, peer: int | Sequence[int], remote: RemoteRegion | Sequence[RemoteRegion],
             chunks: Iterable[Chunk], *, imm: int, per_op: int = 1) -> int:
        """Stage and write every chunk, in order; returns the operations posted. Returns once
        all are POSTED; `flush` waits for their local completion."""
        staged: collections.deque[_Staged] = collections.deque()
        nops = 0
        pieces = (p for c in chunks for p in self._pieces(c, per_op))
        pending = next(pieces, None)
        while pending is not None or staged:
            if pending is not None and not self.pool.has_free:
                self.pool.reclaim(block=False, timeout=0)
            # issue copies ahead while a buffer is free, and always the next piece's before
            # this piece's writes are posted (waiting for a buffer if need be): the copy of
            # piece i+1 runs while piece i's writes go out
            while pending is not None and (self.pool.has_free or len(staged) < 2):
                buf = self.pool.take(self.timeout)
                handle = self._copier.gather(pending.src, pending.src_offsets, pending.lengths,
                                             self.pool.view(buf))
                staged.append(_Staged(self._count, buf, pending, handle))
                if self.trace is not None:
                    self.trace.append(("copy", self._count))
                self._count += 1
                pending = next(pieces, None)
            s = staged.popleft()
            self._copier.wait(s.handle)  # the writes read the bounce buffer: copy first
            lengths = s.chunk.lengths
            src = np.zeros(len(lengths), dtype=np.uint64)
            np.cumsum(lengths[:-1], dtype=np.uint64, out=src[1:])
            src += np.uint64(s.buffer * self.pool.buffer_bytes)
            ops = self.ep.write_batch(peer, self.pool.mr, remote, src, s.chunk.dst_offsets,
                                      lengths, imm, self.pool.tag_base + s.buffer,
                                      per_op=per_op, timeout=self.timeout)
            self.pool.posted_to(s.buffer, ops)
            nops += ops
            if self.trace is not None:
                self.trace.append(("post", s.index))
        return nops

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every posted write completed locally (bounce buffers all free). After a
        FabricError from `send` or `flush` (a peer that stopped draining, a failed write) the
        pool's buffers may still be read by posted writes: close the pool with the endpoint
        (and the peer) rather than reuse it."""
        self.pool.wait_all(self.timeout if timeout is None else timeout)

    def close(self) -> None:
        self._copier.close()


@dataclass(frozen=True)
class LandingGrant:
    """Landing space for one transfer: write i of it goes to `dst_offsets[i]` of `region`."""

    blocks: tuple[int, ...]
    dst_offsets: np.ndarray
    lengths: np.ndarray
    region: RemoteRegion


class LandingPool:
    """The receiver's registered host landing area, `capacity_bytes` in blocks of
    `block_bytes`. A transfer reserves whole blocks for its writes (packed in order; a write
    never straddles two blocks), so memory stays bounded by the capacity whatever the KV size,
    and a request that does not fit waits for an earlier one's release. Registered on `ep`, or
    on every endpoint of `carriers` (writes may land through any of them)."""

    def __init__(self, ep: Endpoint, *, capacity_bytes: int, block_bytes: int = 1 << 20,
                 device: Any = "cpu", on_device: bool = False,
                 carriers: Carriers | None = None) -> None:
        if block_bytes < 1 or capacity_bytes < block_bytes:
            raise ValueError(f"LandingPool: need 1 <= block_bytes <= capacity_bytes, got "
                             f"{block_bytes}, {capacity_bytes}")
        import torch

        self.device = torch.device(device)
        self.block_bytes = block_bytes
        self.nblocks = capacity_bytes // block_bytes
        # on_device: a registered device landing area (direct path, TP mismatch); else host
        self.on_device = on_device and self.device.type == "cuda"
        self._carriers = carriers
        self.memory, self.mr = _registered(carriers.register if carriers else ep.register,
                                           self.nblocks * block_bytes, self.device,
                                           self.on_device)
        self._free = collections.deque(range(self.nblocks))
        self._copier = _Copier(self.device)

    @property
    def allocated_bytes(self) -> int:
        return self.nblocks * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def reserve_blocks(self, count: int) -> tuple[int, ...] | None:
        """`count` free blocks (any order), or None while fewer are free (ValueError when the
        pool could never hold them): the caller keeps the transfer waiting."""
        if count > self.nblocks:
            raise ValueError(f"LandingPool: the transfer needs {count} blocks of "
                             f"{self.block_bytes} B, the pool has {self.nblocks}")
        if count > len(self._free):
            return None
        return tuple(self._free.popleft() for _ in range(count))

    def release_blocks(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)

    @property
    def copier(self) -> _Copier:
        return self._copier

    def reserve(self, lengths: np.ndarray) -> LandingGrant | None:
        """Landing offsets for writes of these lengths, or None while not enough blocks are
        free (ValueError when they could never fit)."""
        lengths = np.ascontiguousarray(lengths, dtype=np.uint64)
        if len(lengths) and int(lengths.max()) > self.block_bytes:
            raise ValueError(f"LandingPool: a {int(lengths.max())}-byte write exceeds the "
                             f"{self.block_bytes}-byte block")
        # pack the writes in order, opening a new block when the next one does not fit
        block_of = np.zeros(len(lengths), dtype=np.int64)
        within = np.zeros(len(lengths), dtype=np.uint64)
        need, fill = 0, self.block_bytes
        for i, n in enumerate(lengths.tolist()):
            if fill + n > self.block_bytes:
                need, fill = need + 1, 0
            block_of[i], within[i] = need - 1, fill
            fill += n
        if need > self.nblocks:
            raise ValueError(f"LandingPool: the transfer needs {need} blocks, the pool has "
                             f"{self.nblocks}")
        if need > len(self._free):
            return None
        blocks = tuple(self._free.popleft() for _ in range(need))
        base = np.array(blocks, dtype=np.uint64) * np.uint64(self.block_bytes)
        dst = base[block_of] + within if need else within
        return LandingGrant(blocks, dst, lengths, self.mr.descriptor())

    def deliver(self, grant: LandingGrant, dst: Any, dst_offsets: np.ndarray) -> None:
        """Copy the landed writes into `dst` (flat uint8 KV tensor, CUDA or CPU) at
        `dst_offsets`; returns once the data is there. Call after the count is reached."""
        dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.uint64)
        if len(dst_offsets) != len(grant.lengths):
            raise ValueError(f"deliver: {len(dst_offsets)} destinations for "
                             f"{len(grant.lengths)} writes")
        if len(dst_offsets) and int((dst_offsets + grant.lengths).max()) > _nbytes(dst):
            raise ValueError("deliver: a destination range runs past the KV buffer")
        self._copier.scatter(self.memory, grant.dst_offsets, dst, dst_offsets, grant.lengths)

    def release(self, grant: LandingGrant) -> None:
        self._free.extend(grant.blocks)

    def close(self) -> None:
        self._copier.close()
        _deregister(self.mr, self._carriers)
        if not self.on_device:
            _release_host_memory(self.memory, self.device.type == "cuda")

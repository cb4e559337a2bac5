"""Typed Python surface of the libfabric binding (the native `transfer._fabric` stays private).

The package follows the order a libfabric program is built in (fabtests' ladder):
`native` loads the binding; `errors` and `values` are plain Python (no native import, so the
control planes, the wire and validate use them where libfabric is absent); `domain` opens a
fabric and domain; `endpoint` opens an endpoint in it, registers memory, inserts peers and
writes; `waits` is how its threads wait and wake; `lanes` adds receive lanes and progress
threads; `shm` cleans up what a killed shm process left. Names that need the native module
(`Endpoint`, `MemoryRegion`, `kick`, the probes) load it on first use, and raise
FabricUnavailableError naming the missing package where it is absent.

One `Endpoint` = one RDM endpoint + address vector + one completion queue (FI_CQ_FORMAT_DATA)
in a fabric + domain (transfer/csrc/domain.c). Use it from ONE thread (a lock makes accidental
sharing safe, not fast), or hand it to its own C progress thread as a decoder's receive lane:
`open_lane` opens another endpoint in the SAME domain (FI_THREAD_COMPLETION: each endpoint's CQ
is drained by one thread) counting into the owner's slots, and memory registered once in that
domain serves every lane (`lane_region`), so the KV is registered once, not once per lane.
Progress is manual on shm and rxm: the target must keep calling `poll()` (or
a `wait_*`) or nothing lands; the sender's `write_batch` drains the CQ itself when the queue is
full.

Completion counting (docs/libfabric.md): every write carries 32 bits of immediate data,
`encode_imm(slot, gen)`. The target's `poll()` adds one to `recv_counts[slot]` when `gen` equals
`recv_gen[slot]` (set by the decoder when it arms the slot), else to `stale_writes`: a late write
from a timed-out transfer never advances the slot's new owner. The sender passes a `tag` with each
batch; local completions add one to `send_done[tag]`, so it knows when its pages are free again.

Flow control (measured on shm, libfabric 1.17): the target performs the copy (CMA,
process_vm_readv, one copy; FI_SHM_DISABLE_CMA's two-copy SAR path measured ~20% slower) inside
its CQ reads, and one read copies everything queued for it. So `write_batch` caps the bytes in
flight per endpoint (`max_inflight_bytes`, not just the provider's queue depth): with 1 MiB pages
the queue alone let one poll of the target copy 1 GiB, blind to its control work for ~200 ms.

GPU memory (`transfer.gpu_memory=direct`): `Endpoint(..., hmem=True)` asks fi_getinfo for
FI_HMEM; `register(iface="cuda", device=gpu)` checks the pointer through the CUDA driver (loaded
only then) and registers it with FI_HMEM_CUDA / FI_HMEM_DEVICE_ONLY, as a dma-buf where the
headers and driver have it. Where this libfabric cannot (`cuda_registration`,
`gpu_direct_support`) it raises GpuMemoryError naming the key and the cause; the staged path
(transfer/staging.py) needs none of it.

Errors: caller mistakes raise `ValueError`; provider faults raise `FabricError` carrying the
failing call, the provider's message and context. Completion errors are data: `poll()` records
them and `errors` hands them out as `(tag, errno, message)`.
"""


from __future__ import annotations

import importlib
from typing import Any

from .errors import FabricError, FabricUnavailableError, GpuMemoryError
from .shm import shm_leftovers
from .values import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_TIMEOUT_S,
    MAX_SLOTS,
    RemoteRegion,
    WriteGroup,
    buffer_address,
    decode_imm,
    encode_imm,
)

# name -> the submodule that defines it; each loads the native binding when first imported
_NATIVE = {"Endpoint": "endpoint", "MemoryRegion": "endpoint", "gpu_direct_support": "endpoint",
           "kick": "waits", "available_providers": "domain", "build_features": "domain",
           "check_cuda_pointer": "domain", "cuda_dmabuf_support": "domain",
           "cuda_stream_write_u32": "domain"}

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_TIMEOUT_S",
    "MAX_SLOTS",
    "FabricError",
    "FabricUnavailableError",
    "GpuMemoryError",
    "RemoteRegion",
    "WriteGroup",
    "buffer_address",
    "cuda_dmabuf_support",
    "cuda_stream_write_u32",
    "decode_imm",
    "encode_imm",
    "shm_leftovers",
    *_NATIVE,
]


def __getattr__(name: str) -> Any:
    """`from transfer.fabric import Endpoint` loads the native binding then, not before."""
    module = _NATIVE.get(name)
    if module is None:
        raise AttributeError(f"module 'transfer.fabric' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

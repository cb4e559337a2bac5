"""Paged KV cache in the messenger's page layout (`transfer.layout`), and its page allocator.

One buffer per layer (kv_parts=2: K and V fused; 1: MLA latent, one head):
  * HND ``[num_pages, kv_parts, heads_local, page_size, head_dim]``: FlashInfer's HND paged
    cache exactly (``[:, 0]`` keys, ``[:, 1]`` values), what its decode wrapper reads with
    ``kv_layout="HND"`` on a GPU; a head slice of a page is two runs (K part, V part);
  * NHD ``[num_pages, page_size, heads_local, kv_parts, head_dim]``: heads interleave per token,
    so a partial head slice is one write per token (transfer.layout, transfer.geometry).
`buffers` are those tensors (what the messenger registers and writes); `layers` are views of
the same memory in HND order ``[pages, parts, heads, page_size, dim]``, which the model indexes
whatever the layout. With ``device="cuda"`` the buffers stay in host memory, page-locked and
mapped into the GPU, and `layers` are CUDA tensors over the same bytes (`transfer.cudahost`).
`progress` is the prefill's per-layer progress word (`transfer.progress.ProgressWord`).
"""

from __future__ import annotations

import heapq

import torch

from transfer.hostmem import host_buffer
from transfer.layout import KVLayout
from transfer.progress import ProgressWord
from transfer.routes import LAYOUTS

from .model import TinyConfig


class OutOfPages(RuntimeError):
    """Not enough free pages; the scheduler keeps the request waiting."""


class PageAllocator:
    """Free page ids, handed out lowest first and in ascending order (a min-heap). `num_free`
    lets tests assert nothing leaked.

    Why the order matters: the CPU attention gathers a sequence's cached entries page by page,
    and a cache larger than L2 streams them from memory, where ascending addresses are what
    the prefetchers follow. A LIFO free list handed every other request of a size its pages
    in descending order, and those prefills took 1.3-1.6x as long (median 1.4x;
    docs/benchmark-rounds.md, "Tenth round"). SGLang's allocators sort their free pages too
    (`merge_and_sort_free`)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # sorted: already a heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            heapq.heappush(self._free, p)


class PagedKV:
    """This rank's KV buffers (one tensor per layer) plus the allocator over their pages."""

    def __init__(
        self, cfg: TinyConfig, heads_local: int, num_pages: int, page_size: int,
        layout: str = "HND", device: str = "cpu",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"transfer.layout: expected one of {LAYOUTS}, got {layout!r}")
        kind = device.split(":", 1)[0]  # cuda:N: the rank's GPU (the current device)
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"cluster.device: expected cpu or cuda, got {device!r}")
        if kind == "cuda" and layout != "HND":
            raise ValueError("transfer.layout: the GPU path reads FlashInfer's HND pages; "
                             "set transfer.layout=HND")
        self.device = device
        self.page_size = page_size
        self.layout = layout
        itemsize = torch.empty((), dtype=cfg.torch_kv_dtype).element_size()
        self.shape = KVLayout(layout, num_pages, heads_local, cfg.kv_parts, page_size,
                              cfg.cache_dim, itemsize).shape
        self.buffers = [
            host_buffer(self.shape, cfg.torch_kv_dtype) for _ in range(cfg.num_layers)
        ]
        # NHD [pages, tokens, heads, parts, dim] seen as [pages, parts, heads, tokens, dim]
        self.layers = self.buffers if layout == "HND" else [
            b.permute(0, 3, 2, 1, 4) for b in self.buffers]
        # the prefill's per-layer progress word (transfer.progress), polled by its messenger
        self.progress = ProgressWord()
        if kind == "cuda":
            # the GPU reads and writes the very pages the messenger registers (mapped pinned
            # host memory, transfer.cudahost): no staged copy, FlashInfer reads what arrived
            from transfer.cudahost import device_alias

            self.layers = [device_alias(b) for b in self.buffers]
        self.pages = PageAllocator(num_pages)

    def page_bytes(self) -> int:
        t = self.buffers[0]
        return t[0].numel() * t.element_size()

"""Paged KV cache in the messenger's page layout (`transfer.layout`), and its page allocator.

One buffer per layer (kv_parts=2: K and V fused per head; 1: MLA latent, one head):
  * HND ``[num_pages, heads_local, kv_parts, page_size, head_dim]``: the head slice of a page is
    one contiguous range, one RMA write per (page, layer, source shard);
  * NHD ``[num_pages, page_size, heads_local, kv_parts, head_dim]``: heads interleave per token,
    so a partial head slice is one write per token (transfer.layout, transfer.routes).
`buffers` are those tensors (what the messenger registers and writes); `layers` are views of
the same memory in HND order, which the model indexes whatever the layout.
"""

from __future__ import annotations

from transfer.hostmem import host_buffer
from transfer.routes import LAYOUTS

from .model import TinyConfig


class OutOfPages(RuntimeError):
    """Not enough free pages; the scheduler keeps the request waiting."""


class PageAllocator:
    """Free-list of page ids. `num_free` lets tests assert nothing leaked."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)


class PagedKV:
    """This rank's KV buffers (one tensor per layer) plus the allocator over their pages."""

    def __init__(
        self, cfg: TinyConfig, heads_local: int, num_pages: int, page_size: int,
        layout: str = "HND",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"transfer.layout: expected one of {LAYOUTS}, got {layout!r}")
        self.page_size = page_size
        self.layout = layout
        hnd = (num_pages, heads_local, cfg.kv_parts, page_size, cfg.cache_dim)
        self.shape = hnd if layout == "HND" else (hnd[0], hnd[3], hnd[1], hnd[2], hnd[4])
        self.buffers = [
            host_buffer(self.shape, cfg.torch_kv_dtype) for _ in range(cfg.num_layers)
        ]
        self.layers = self.buffers if layout == "HND" else [
            b.permute(0, 2, 3, 1, 4) for b in self.buffers]
        self.pages = PageAllocator(num_pages)

    def page_bytes(self) -> int:
        t = self.buffers[0]
        return t[0].numel() * t.element_size()

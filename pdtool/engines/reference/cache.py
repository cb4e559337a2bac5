"""Paged KV cache in the messenger's HND layout, and its page allocator.

One buffer per layer, ``[num_pages, heads_local, kv_parts, page_size, head_dim]`` (kv_parts=2:
K and V fused per head; 1: MLA latent, one head), so the head slice of a page is one contiguous
range: the messenger writes it with one RMA write per (page, layer, source shard).
"""

from __future__ import annotations

from transfer.hostmem import host_buffer

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
        self, cfg: TinyConfig, heads_local: int, num_pages: int, page_size: int
    ) -> None:
        self.page_size = page_size
        self.shape = (num_pages, heads_local, cfg.kv_parts, page_size, cfg.cache_dim)
        self.layers = [
            host_buffer(self.shape, cfg.torch_kv_dtype) for _ in range(cfg.num_layers)
        ]
        self.pages = PageAllocator(num_pages)

    def page_bytes(self) -> int:
        t = self.layers[0]
        return t[0].numel() * t.element_size()

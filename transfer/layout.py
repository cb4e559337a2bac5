"""KV page layouts: where a (layer, page, head slice) lives in memory, as byte offsets.

The messenger never copies tensors itself: it turns "send pages S of this request to pages D of
that decoder, heads [h, h+n)" into three uint64 arrays (source offsets, destination offsets,
lengths) that one C call submits as RMA writes. This module builds those arrays with numpy
broadcasting, never a Python loop per page, so a batch of thousands of pages costs microseconds.

One buffer per layer (docs/sharding.md), `kv_parts` = 2 for K and V fused, 1 for an MLA latent
or for K and V kept in buffers of their own. The axes of one page come from
`transfer.geometry.MESSENGER_AXES` (the one owner of the write count):
  * HND: `[num_pages, kv_parts, heads_local, page_size, head_dim]` — FlashInfer's HND paged
    cache exactly (`paged_kv_cache[:, 0]` keys, `[:, 1]` values; with kv_parts=1 and K, V in
    two buffers, its `(k_cache, v_cache)` form). A head slice of a page is one contiguous run
    per part: 2 writes for fused K/V (K part, V part), 1 for a latent or a split buffer.
  * NHD: `[num_pages, page_size, heads_local, kv_parts, head_dim]` — heads interleave inside
    each token, so a partial head run is one write per token.
A slice covering every local head on both sides is one write of the whole page in either.

Both sides must agree on page size, head dim, kv_parts and element size; `heads_local` may differ
(that is the TP mismatch the routes describe).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .geometry import MESSENGER_AXES, PagePool, messenger_pool
from .routes import LAYOUTS, Slice

_U64 = np.uint64


class LayoutError(ValueError):
    """A layout that does not describe the buffer, or two layouts that cannot talk."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of ONE per-layer KV buffer (every layer buffer of a rank has the same layout).

    `itemsize` is the element size in bytes (2 for bf16/fp16, 1 for fp8).
    """

    kind: str
    num_pages: int
    heads_local: int
    kv_parts: int
    page_size: int
    head_dim: int
    itemsize: int

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise LayoutError(f"layout.kind: must be one of {LAYOUTS}, got {self.kind!r}")
        for name in ("num_pages", "heads_local", "kv_parts", "page_size", "head_dim", "itemsize"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"layout.{name}: must be a positive integer, got {value!r}")
        if self.kv_parts not in (1, 2):
            raise LayoutError(f"layout.kv_parts: must be 1 (MLA latent) or 2 (K,V), got "
                              f"{self.kv_parts}")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def axes(self) -> tuple[str, ...]:
        """Axes of one page, outermost first (`geometry.MESSENGER_AXES`)."""
        return MESSENGER_AXES[self.kind]

    def _size(self, axis: str) -> int:
        return {"heads": self.heads_local, "tokens": self.page_size, "parts": self.kv_parts,
                "dim": self.head_dim}[axis]

    def stride_bytes(self, axis: str) -> int:
        """Bytes between two neighbours along `axis` inside a page."""
        inner = self.axes[self.axes.index(axis) + 1:]
        return self.itemsize * math.prod(self._size(a) for a in inner)

    @property
    def page_bytes(self) -> int:
        return self.itemsize * math.prod(self._size(a) for a in self.axes)

    @property
    def buffer_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_pages, *(self._size(a) for a in self.axes))

    @property
    def pool(self) -> PagePool:
        """The geometry pool these buffers are (what the write counts are computed with)."""
        return messenger_pool(self.kind, kv_parts=self.kv_parts)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_tensor(cls, tensor: Any, kind: str) -> KVLayout:
        """Read the layout off a torch tensor / numpy array of the documented 5-D shape."""
        shape = tuple(int(x) for x in tensor.shape)
        if kind not in LAYOUTS:
            raise LayoutError(f"layout.kind: must be one of {LAYOUTS}, got {kind!r}")
        if len(shape) != 5:
            axes = ", ".join(("pages", *MESSENGER_AXES[kind]))
            raise LayoutError(f"KV buffer: expected a 5-D {kind} tensor [{axes}], got shape "
                              f"{shape}")
        size = dict(zip(MESSENGER_AXES[kind], shape[1:], strict=True))
        itemsize = int(tensor.element_size() if hasattr(tensor, "element_size")
                       else tensor.itemsize)
        return cls(kind, shape[0], size["heads"], size["parts"], size["tokens"], size["dim"],
                   itemsize)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "num_pages": self.num_pages, "heads_local": self.heads_local,
            "kv_parts": self.kv_parts, "page_size": self.page_size, "head_dim": self.head_dim,
            "itemsize": self.itemsize,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**{k: d[k] for k in ("kind", "num_pages", "heads_local", "kv_parts",
                                         "page_size", "head_dim", "itemsize")})

    def check_peer(self, other: KVLayout) -> None:
        """Raise LayoutError naming the first field two sides disagree on."""
        for name in ("kind", "page_size", "head_dim", "kv_parts", "itemsize"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise LayoutError(f"layout.{name}: this side has {a!r}, the peer {b!r}; "
                                  f"both sides must match")

    # -- offsets -------------------------------------------------------------------------------
    def check_pages(self, pages: np.ndarray, what: str = "pages") -> np.ndarray:
        arr = np.asarray(pages)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise LayoutError(f"{what}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.num_pages):
            raise LayoutError(f"{what}: page ids must lie in [0, {self.num_pages}), got "
                              f"[{int(arr.min())}, {int(arr.max())}]")
        return arr.astype(_U64, copy=False)

    def slice_offsets(self, pages: np.ndarray, head_off: int, num_heads: int,
                      whole_pages: bool) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets and lengths of heads [head_off, head_off+num_heads) of `pages`.

        One range per page when `whole_pages` (the slice covers every local head on BOTH
        sides, so whole pages line up); else one per page and index of the axes outside
        `heads` (HND: per part, K then V; NHD: per token). Returns (offsets, lengths) as
        uint64, page-major, then those axes in row-major order.
        """
        if head_off < 0 or num_heads < 1 or head_off + num_heads > self.heads_local:
            raise LayoutError(f"head slice [{head_off}, {head_off + num_heads}) outside the "
                              f"{self.heads_local} local heads")
        p = self.check_pages(pages)
        base = p * _U64(self.page_bytes)
        if whole_pages:
            if head_off != 0 or num_heads != self.heads_local:
                raise LayoutError("whole-page write needs every local head")
            return base, np.full(base.shape, self.page_bytes, dtype=_U64)
        outer = self.axes[: self.axes.index("heads")]
        runs = np.zeros(1, dtype=_U64)
        for a in outer:  # offsets of every index combination of the outer axes, row-major
            step = np.arange(self._size(a), dtype=_U64) * _U64(self.stride_bytes(a))
            runs = (runs[:, None] + step[None, :]).ravel()
        head = self.stride_bytes("heads")
        offs = (base[:, None] + runs[None, :] + _U64(head_off * head)).ravel()
        return offs, np.full(offs.shape, num_heads * head, dtype=_U64)

def write_plan(src: KVLayout, dst: KVLayout, src_pages: np.ndarray, dst_pages: np.ndarray,
               sl: Slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src offsets, dst offsets, lengths) moving slice `sl` of `src_pages` into `dst_pages`.

    Offsets are relative to one layer buffer on each side; the same arrays serve every layer.
    The number of writes per page equals `geometry.writes_per_page` for the same slice.
    """
    src.check_peer(dst)
    if len(src_pages) != len(dst_pages):
        raise LayoutError(f"source has {len(src_pages)} pages, destination {len(dst_pages)}")
    whole = sl.num_heads == src.heads_local == dst.heads_local
    s_off, s_len = src.slice_offsets(src_pages, sl.src_head_off, sl.num_heads, whole)
    d_off, d_len = dst.slice_offsets(dst_pages, sl.dst_head_off, sl.num_heads, whole)
    if not np.array_equal(s_len, d_len):  # pragma: no cover - guarded by check_peer
        raise LayoutError("source and destination write lengths differ")
    return s_off, d_off, s_len


@dataclass(frozen=True)
class Buffer:
    """A raw memory range: what the fabric registers and what a layout indexes into."""

    addr: int
    nbytes: int


def as_buffer(obj: Any) -> Buffer:
    """Address and size of a contiguous torch tensor, numpy array, bytearray or (addr, nbytes).

    The caller keeps `obj` alive for as long as the messenger uses it (it is registered memory).
    """
    if isinstance(obj, Buffer):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2:
        return Buffer(int(obj[0]), int(obj[1]))
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
        if not obj.is_contiguous():
            raise LayoutError("KV buffer: torch tensor must be contiguous")
        return Buffer(int(obj.data_ptr()), int(obj.numel() * obj.element_size()))
    if isinstance(obj, np.ndarray):
        if not obj.flags["C_CONTIGUOUS"]:
            raise LayoutError("KV buffer: numpy array must be C-contiguous")
        return Buffer(int(obj.ctypes.data), int(obj.nbytes))
    if isinstance(obj, bytearray):
        return Buffer(ctypes.addressof((ctypes.c_char * len(obj)).from_buffer(obj)), len(obj))
    raise LayoutError(f"KV buffer: cannot take the address of a {type(obj).__name__}")


@dataclass(frozen=True)
class AuxSpec:
    """A context/metadata buffer (hidden states, logits): `rows` rows of `row_bytes` each.

    Decode side: row r belongs to transfer slot r, so it needs rows >= max in-flight transfers.
    Prefill side: the engine says which row holds a request's data when it binds the request.
    """

    rows: int
    row_bytes: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.row_bytes < 1:
            raise LayoutError(f"aux buffer: rows and row_bytes must be >= 1, got {self}")


def aux_spec(obj: Any) -> AuxSpec:
    """Rows of a 2-D (or more) tensor/array: first dimension = rows, the rest one row."""
    shape = tuple(int(x) for x in obj.shape)
    if len(shape) < 2:
        raise LayoutError(f"aux buffer: expected at least 2 dimensions (rows, ...), got {shape}")
    buf = as_buffer(obj)
    return AuxSpec(shape[0], buf.nbytes // shape[0])


def sglang_buffer_layouts(data_lens: list[int], item_lens: list[int],
                          heads_local: int | Sequence[int], page_size: int) -> list[KVLayout]:
    """NHD KVLayout of each SGLang layer buffer (KVArgs.kv_data_lens/kv_item_lens), in bytes
    (itemsize 1).

    An SGLang item is one page of one buffer: `page_size` tokens × `heads_local` heads ×
    head bytes. kv_parts is 1: K and V live in separate buffers, MLA has one latent buffer.
    `heads_local` is one count for every buffer, or one per buffer (a draft model's buffers,
    appended after the target's, count their own head units: `geometry.sglang_draft_group`).
    """
    heads = [heads_local] * len(item_lens) if isinstance(heads_local, int) else list(heads_local)
    out = []
    for i, (dlen, ilen, h) in enumerate(zip(data_lens, item_lens, heads, strict=True)):
        head_bytes, rem = divmod(ilen, page_size * h)
        if rem or head_bytes < 1:
            raise LayoutError(
                f"KV buffer {i}: item length {ilen} B is not page_size {page_size} × "
                f"{h} heads × whole head bytes"
            )
        out.append(KVLayout("NHD", dlen // ilen, h, 1, page_size, head_bytes, 1))
    return out

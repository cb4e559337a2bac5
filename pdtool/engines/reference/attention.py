"""Decode attention over the paged KV cache: FlashInfer on a GPU, its semantics in torch.

The cache of a layer is FlashInfer's HND paged cache, `[pages, 2, kv_heads, page_size,
head_dim]` (`cache[:, 0]` keys, `[:, 1]` values; `transfer.layout` HND). A batch of decode
requests is described the way FlashInfer's `BatchDecodeWithPagedKVCacheWrapper.plan` takes it,
in CSR form: request b reads pages `indices[indptr[b]:indptr[b+1]]`, all full but the last, of
which `last_page_len[b]` (1..page_size) entries count. `paged_kv_csr` builds that from the
engine's page table; `paged_decode_torch` is the same computation in plain torch (the oracle the
GPU check compares FlashInfer with, and what the CPU tests check the layout against); and
`FlashInferDecode` runs FlashInfer's wrapper (kv_layout="HND") over the pages the messenger
wrote. `flashinfer` is imported only when a `FlashInferDecode` is built, on the cuda path.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pdtool.reference_limits import FLASHINFER_HEAD_DIMS, TORCH_KV_DTYPES
from pdtool.reference_limits import FLASHINFER_KV_DTYPES as _FLASHINFER_KV_NAMES

#: FlashInfer's decode kernels take half-precision caches (and fp8, not used here).
FLASHINFER_KV_DTYPES = tuple(getattr(torch, TORCH_KV_DTYPES[n]) for n in _FLASHINFER_KV_NAMES)


def paged_kv_csr(page_table: torch.Tensor, kv_len: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B+1], indices [nnz], last_page_len [B]), int32, from the engine's page table
    `[B, max_pages]` and cached lengths `[B]` (each >= 1, new tokens included)."""
    if int(kv_len.min()) < 1:
        raise ValueError("paged_kv_csr: every request needs at least one cached token")
    n = (kv_len + page_size - 1) // page_size
    if int(n.max()) > page_table.shape[1]:
        raise ValueError(f"paged_kv_csr: {int(n.max())} pages needed, the page table has "
                         f"{page_table.shape[1]} columns")
    indptr = torch.zeros(len(n) + 1, dtype=torch.int32, device=page_table.device)
    indptr[1:] = torch.cumsum(n, 0)
    cols = torch.arange(page_table.shape[1], device=page_table.device)
    indices = page_table[cols[None, :] < n[:, None]].to(torch.int32)  # row-major: per request
    last = (kv_len - (n - 1) * page_size).to(torch.int32)
    return indptr, indices, last


def paged_decode_torch(q: torch.Tensor, cache: torch.Tensor, indptr: torch.Tensor,
                       indices: torch.Tensor, last_page_len: torch.Tensor,
                       sm_scale: float | None = None) -> torch.Tensor:
    """FlashInfer's batch decode in torch: q `[B, q_heads, dim]` (one query per request) over
    an HND cache `[pages, 2, kv_heads, page_size, dim]`; query head h reads KV head
    h // (q_heads / kv_heads). Returns `[B, q_heads, dim]` in q's dtype."""
    b, hq, d = q.shape
    hkv, page_size = cache.shape[2], cache.shape[3]
    group = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    for i in range(b):
        pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
        length = (len(pages) - 1) * page_size + int(last_page_len[i])
        kv = cache[pages].to(q.dtype)  # [n, 2, hkv, P, d]
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]  # [hkv, L, d]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hld->hl", q[i], k) * scale, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", p, v)
    return out


class FlashInferDecode:
    """FlashInfer's paged decode wrapper (kv_layout="HND") for one rank's heads: `plan` once per
    forward pass (the batch's pages), `run` per layer over that layer's cache."""

    def __init__(self, *, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                 kv_dtype: torch.dtype, device: Any, workspace_bytes: int = 128 << 20) -> None:
        if kv_dtype not in FLASHINFER_KV_DTYPES:
            raise ValueError(f"kv_dtype: FlashInfer's decode reads float16 or bfloat16 pages, "
                             f"got {kv_dtype}; set prefill.kv_dtype=fp16 decode.kv_dtype=fp16")
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"model.head_dim: FlashInfer's decode is built for head dims "
                             f"{list(FLASHINFER_HEAD_DIMS)}, got {head_dim}")
        try:
            import flashinfer
        except ImportError as exc:
            raise RuntimeError(
                "cluster.device=cuda: the reference engine's decode attention needs FlashInfer "
                f"(pip install 'pdtool[flashinfer]'): {exc}") from None
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.page_size, self.kv_dtype, self.device = page_size, kv_dtype, device
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND")

    def plan(self, page_table: torch.Tensor, kv_len: torch.Tensor) -> None:
        indptr, indices, last = paged_kv_csr(page_table, kv_len, self.page_size)
        self.wrapper.plan(indptr.to(self.device), indices.to(self.device), last.to(self.device),
                          self.q_heads, self.kv_heads, self.head_dim, self.page_size,
                          pos_encoding_mode="NONE", q_data_type=self.kv_dtype,
                          kv_data_type=self.kv_dtype)

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """q `[B, q_heads, dim]` in any float dtype → `[B, q_heads, dim]` in q's dtype."""
        return self.wrapper.run(q.to(self.kv_dtype).contiguous(), cache).to(q.dtype)

"""The reference engine's attention against FlashInfer's documented paged layout, on the CPU.

FlashInfer's HND paged cache is `[pages, 2, kv_heads, page_size, head_dim]` (`[:, 0]` keys,
`[:, 1]` values), addressed per request in CSR form (indptr, indices, last_page_len). These
tests build pages that way from dense K/V and check the torch transcription of FlashInfer's
decode (`paged_decode_torch`, what the GPU check compares FlashInfer itself with) against dense
attention; then they run the model's decode steps with that transcription in FlashInfer's seat
(the object `FlashInferDecode` is on cuda: `plan` per pass, `run` per layer) and check it equals
the model's own torch attention over the pages the engine wrote. FlashInfer itself runs only on
a GPU, and no check here runs it (docs/binding.md, "gpu/check.sh").
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from pdtool.engines.reference.attention import paged_decode_torch, paged_kv_csr
from pdtool.engines.reference.cache import PagedKV
from pdtool.engines.reference.model import Batch, TinyConfig, TinyModel

torch.set_num_threads(1)


def _flashinfer_pages(keys: list[torch.Tensor], vals: list[torch.Tensor], page_size: int,
                      num_pages: int, gen: torch.Generator):
    """FlashInfer's HND cache holding sequence b's K/V ([L_b, hkv, d]) in random pages, and
    the CSR arrays its plan() takes, written out by hand from its documentation."""
    hkv, d = keys[0].shape[1:]
    cache = torch.full((num_pages, 2, hkv, page_size, d), float("nan"), dtype=torch.float64)
    order = torch.randperm(num_pages, generator=gen).tolist()
    indptr, indices, last = [0], [], []
    for k, v in zip(keys, vals, strict=True):
        n = math.ceil(len(k) / page_size)
        pages = [order.pop() for _ in range(n)]
        for j, p in enumerate(pages):
            part = slice(j * page_size, min((j + 1) * page_size, len(k)))
            cnt = part.stop - part.start
            cache[p, 0, :, :cnt] = k[part].transpose(0, 1)  # [hkv, tokens, d]
            cache[p, 1, :, :cnt] = v[part].transpose(0, 1)
        indices += pages
        indptr.append(len(indices))
        last.append(len(k) - (n - 1) * page_size)
    as32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return cache, as32(indptr), as32(indices), as32(last)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (2, 2), (8, 1)])
def test_torch_transcription_of_flashinfer_decode_is_attention(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    d, page = 8, 4
    lens = [1, 4, 5, 13]
    keys = [torch.randn(n, hkv, d, generator=g, dtype=torch.float64) for n in lens]
    vals = [torch.randn(n, hkv, d, generator=g, dtype=torch.float64) for n in lens]
    q = torch.randn(len(lens), hq, d, generator=g, dtype=torch.float64)
    cache, indptr, indices, last = _flashinfer_pages(keys, vals, page, 16, g)
    out = paged_decode_torch(q, cache, indptr, indices, last)
    group = hq // hkv
    for b in range(len(lens)):
        k = keys[b].repeat_interleave(group, 1)  # [L, hq, d]
        v = vals[b].repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b], k) / math.sqrt(d), -1)
        assert torch.allclose(out[b], torch.einsum("hl,lhd->hd", p, v), atol=1e-12)


def test_csr_from_the_engines_page_table():
    table = torch.tensor([[7, 3, 9, 0], [5, 0, 0, 0], [2, 4, 6, 8]])
    indptr, indices, last = paged_kv_csr(table, torch.tensor([9, 4, 13]), 4)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 3, 9, 5, 2, 4, 6, 8]
    assert last.tolist() == [1, 4, 1]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}
    with pytest.raises(ValueError, match="page table has 4 columns"):
        paged_kv_csr(table, torch.tensor([17, 1, 1]), 4)


class TorchFlashInfer:
    """`FlashInferDecode`'s interface over the torch transcription: what the model does on
    cuda, run here on the CPU (the same calls, the same arguments)."""

    def __init__(self, page_size: int) -> None:
        self.page_size, self.runs, self.plans = page_size, 0, 0

    def plan(self, page_table, kv_len):
        self.csr = paged_kv_csr(page_table, kv_len, self.page_size)
        self.plans += 1

    def run(self, q, cache):
        self.runs += 1
        return paged_decode_torch(q, cache, *self.csr)


def _decode(model: TinyModel, kv: PagedKV, prompts: list[list[int]], steps: int) -> list:
    """Prefill every prompt into the cache, then `steps` batched greedy decode steps; the
    hidden states of every decode step."""
    P = kv.page_size
    pages, pos, out = [], [], []
    for t in prompts:
        pg = kv.pages.alloc(math.ceil((len(t) + steps) / P))
        model.forward(Batch.build([(t[:-1], 0, pg)], P), kv.layers, P)
        pages.append(pg)
        pos.append(len(t) - 1)
    nxt = [t[-1] for t in prompts]
    for _ in range(steps):
        h = model.forward(Batch.build([([n], p, pg) for n, p, pg in zip(nxt, pos, pages,
                                                                          strict=True)], P),
                          kv.layers, P)
        out.append(h)
        nxt = model.logits(h).argmax(-1).tolist()
        pos = [p + 1 for p in pos]
    return out


@pytest.mark.parametrize(("layout", "tp_heads"), [("HND", (4, 2)), ("HND", (2, 2)),
                                                  ("NHD", (4, 2)), ("HND", (4, 1))])
def test_model_decode_through_flashinfers_layout_equals_its_torch_attention(layout, tp_heads):
    hq, hkv = tp_heads
    cfg = TinyConfig(num_q_heads=hq, num_kv_heads=hkv, num_layers=3)
    prompts = [list(b"paged"), list(b"flash infer reads HND"), list(b"ab")]
    ref = _decode(TinyModel(cfg), PagedKV(cfg, hkv, 64, 4, layout), prompts, 5)
    model = TinyModel(cfg)
    fi = TorchFlashInfer(4)
    model.decode_attention = fi
    kv = PagedKV(cfg, hkv, 64, 4, layout)
    if layout == "HND":  # the messenger's buffers are FlashInfer's cache, not a copy of it
        assert kv.layers[0].data_ptr() == kv.buffers[0].data_ptr()
        assert tuple(kv.buffers[0].shape) == (64, 2, hkv, 4, cfg.head_dim)
    got = _decode(model, kv, prompts, 5)
    # every pass with one new token per request: the 5 decode steps and the 1-token prefill of
    # "ab" (the other prefills run torch's attention)
    assert fi.plans == 6 and fi.runs == 6 * cfg.num_layers
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-9)


def test_cuda_path_refuses_what_flashinfer_cannot_read():
    from pdtool.engines.reference.attention import FlashInferDecode

    with pytest.raises(ValueError, match=r"set prefill\.kv_dtype=fp16"):
        FlashInferDecode(q_heads=4, kv_heads=2, head_dim=16, page_size=4,
                         kv_dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"model\.head_dim: .* \[64, 128, 256\], got 16"):
        FlashInferDecode(q_heads=4, kv_heads=2, head_dim=16, page_size=4,
                         kv_dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match=r"transfer\.layout=HND"):
        PagedKV(TinyConfig(), 2, 8, 4, "NHD", device="cuda")


def test_the_host_side_never_imports_flashinfer_or_cuda_helpers():
    """The CPU path (and pdtool validate/plan) loads neither FlashInfer nor the driver."""
    cfg = TinyConfig()
    _decode(TinyModel(cfg), PagedKV(cfg, 2, 16, 4), [list(b"xyz")], 2)
    assert "flashinfer" not in sys.modules
    assert "transfer.cudahost" not in sys.modules

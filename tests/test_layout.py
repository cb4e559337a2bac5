"""Page layouts: the offset arrays must address exactly the bytes torch indexing addresses.

The copy tests apply write plans with numpy on real KV-shaped torch tensors (no fabric), across
the TP splits the messenger supports, and check the decoder's pages byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from transfer.geometry import messenger_pool, slice_ops, writes_per_page
from transfer.hostmem import host_buffer
from transfer.layout import KVLayout, LayoutError, as_buffer, aux_spec, write_plan
from transfer.routes import ShardSpec, routes_for, sendable

PAGE, DIM, PAGES = 4, 8, 6


def _tensor(kind: str, heads: int, parts: int = 2, pages: int = PAGES) -> torch.Tensor:
    shape = ((pages, parts, heads, PAGE, DIM) if kind == "HND"
             else (pages, PAGE, heads, parts, DIM))
    return torch.arange(int(np.prod(shape)), dtype=torch.int32).to(torch.bfloat16).reshape(shape)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _apply(src: torch.Tensor, dst: torch.Tensor, plan) -> None:
    s, d = _bytes(src), dst.view(torch.uint8).numpy().reshape(-1)
    for so, do, n in zip(*plan, strict=True):
        d[int(do):int(do + n)] = s[int(so):int(so + n)]


@pytest.mark.parametrize("kind", ["HND", "NHD"])
def test_layout_from_tensor_and_sizes(kind):
    t = _tensor(kind, heads=3)
    lay = KVLayout.from_tensor(t, kind)
    assert lay.shape == tuple(t.shape)
    assert lay.buffer_bytes == t.numel() * t.element_size() == as_buffer(t).nbytes
    assert KVLayout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize("kind", ["HND", "NHD"])
def test_slice_offsets_address_the_torch_slice(kind):
    t = _tensor(kind, heads=4)
    lay = KVLayout.from_tensor(t, kind)
    raw = _bytes(t)
    pages = np.array([5, 0, 3])
    offs, lens = lay.slice_offsets(pages, head_off=1, num_heads=2, whole_pages=False)
    got = np.concatenate([raw[int(o):int(o + n)] for o, n in zip(offs, lens, strict=True)])
    want = t[pages][:, :, 1:3]  # HND: K of heads 1-2, then V; NHD: per token
    assert np.array_equal(got, _bytes(want))
    assert len(offs) == len(pages) * (2 if kind == "HND" else PAGE)


@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp", "parts"),
    [(8, 2, 2, 2), (8, 4, 2, 2), (8, 2, 4, 2), (4, 1, 4, 2), (1, 8, 2, 1), (2, 4, 8, 2)],
)
@pytest.mark.parametrize("kind", ["HND", "NHD"])
def test_write_plans_rebuild_decoder_pages(kind, heads, src_tp, dst_tp, parts):
    """Every decode rank ends up with exactly its heads of the request's pages."""
    src, dst = ShardSpec(heads, src_tp), ShardSpec(heads, dst_tp)
    full = _tensor("HND", heads, parts)  # global [pages, parts, heads, page, dim]

    def local(spec: ShardSpec, rank: int, pages: int = PAGES) -> torch.Tensor:
        hs = spec.heads_of(rank)
        t = full[:pages, :, hs.start:hs.stop].contiguous()
        return t if kind == "HND" else t.permute(0, 3, 2, 1, 4).contiguous()

    src_pages = np.array([4, 1, 2])
    dst_pages = np.array([0, 5, 3])
    for d in range(dst_tp):
        want = local(dst, d)
        got = torch.zeros_like(want)
        for sl in routes_for(src, dst, d, rng=None):
            s_lay = KVLayout.from_tensor(local(src, sl.src_rank), kind)
            d_lay = KVLayout.from_tensor(got, kind)
            plan = write_plan(s_lay, d_lay, src_pages, dst_pages, sl)
            assert len(plan[0]) == len(src_pages) * writes_per_page(sl, src, dst, kind, PAGE)
            _apply(local(src, sl.src_rank), got, plan)
        # dst page j must equal the source (global) page src_pages[j] for this rank's heads
        hs = dst.heads_of(d)
        ref = full[src_pages][:, :, hs.start:hs.stop]
        ref = ref if kind == "HND" else ref.permute(0, 3, 2, 1, 4)
        assert torch.equal(got[dst_pages].view(torch.int16), ref.contiguous().view(torch.int16))
        untouched = np.setdiff1d(np.arange(PAGES), dst_pages)
        assert not got[untouched].view(torch.int16).any()


def test_hnd_is_one_write_per_part_per_page_per_source_shard():
    """FlashInfer's HND page [2, heads, page, dim]: a head slice is its K run and its V run."""
    src, dst = ShardSpec(8, 4), ShardSpec(8, 2)
    for sl in [s for d in range(dst.attn_tp) for s in routes_for(src, dst, d)]:
        assert writes_per_page(sl, src, dst, "HND", PAGE) == 2
        assert writes_per_page(sl, src, dst, "NHD", PAGE) == PAGE
        mla = messenger_pool("HND", mla=True)
        assert writes_per_page(sl, src, dst, mla, PAGE) == 1
    same = routes_for(dst, dst, 0)[0]
    assert writes_per_page(same, dst, dst, "HND", PAGE) == 1  # every local head: whole page


def test_hnd_layout_is_flashinfers_paged_kv_cache():
    """[pages, 2, kv_heads, page_size, head_dim]: paged_kv_cache[:, 0] keys, [:, 1] values, so
    the byte FlashInfer reads for (page, part, head, token, dim) is the one the offsets name."""
    t = _tensor("HND", heads=2)
    lay = KVLayout.from_tensor(t, "HND")
    assert lay.shape == (PAGES, 2, 2, PAGE, DIM)
    item = t.element_size()
    page, part, head, tok, d = 3, 1, 1, 2, 5
    off = (page * lay.page_bytes + part * lay.stride_bytes("parts")
           + head * lay.stride_bytes("heads") + tok * lay.stride_bytes("tokens") + d * item)
    assert off == item * (((page * 2 + part) * 2 + head) * PAGE + tok) * DIM + item * d
    raw = _bytes(t)
    assert np.array_equal(raw[off:off + item], _bytes(t[page, part, head, tok, d:d + 1]))


def test_errors_name_the_field():
    lay = KVLayout("HND", PAGES, 2, 2, PAGE, DIM, 2)
    with pytest.raises(LayoutError, match=r"layout.kind"):
        KVLayout("XYZ", 1, 1, 1, 1, 1, 1)
    with pytest.raises(LayoutError, match=r"layout.page_size"):
        KVLayout("HND", 1, 1, 1, 0, 1, 1)
    with pytest.raises(LayoutError, match=r"page ids must lie in \[0, 6\)"):
        lay.slice_offsets(np.array([6]), 0, 1, False)
    with pytest.raises(LayoutError, match=r"layout.page_size: this side has 4"):
        lay.check_peer(KVLayout("HND", PAGES, 2, 2, 8, DIM, 2))
    with pytest.raises(LayoutError, match="contiguous"):
        as_buffer(torch.zeros(4, 4).t())


def test_aux_spec_rows():
    t = torch.zeros(16, 3, 5, dtype=torch.float16)
    assert aux_spec(t).rows == 16 and aux_spec(t).row_bytes == 30


@given(total=st.integers(0, 300), per_op=st.integers(1, 8),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_grouped_operations_do_not_depend_on_the_chunking(total, per_op, chunks):
    """Whatever chunks the prompt arrives in, the sender cuts the same operations: all full
    (per_op writes) but the last, in order, exactly slice_ops(...) of them, all sent at the end."""
    sl = routes_for(ShardSpec(4, 1, 1), ShardSpec(4, 1, 1), 0)[0]
    spec = ShardSpec(4, 1, 1)
    sent, ops, ready = 0, [], 0
    for c in [*chunks, total]:  # the last chunk always reaches the prompt's end
        ready = min(total, ready + c)
        b = sendable(sent, ready, total, per_op)
        ops += [min(per_op, b - a) for a in range(sent, b, per_op)]
        sent = b
    assert sent == total
    assert sum(ops) == total and all(o == per_op for o in ops[:-1])
    assert len(ops) == slice_ops(sl, spec, spec, layout="HND", page_size=PAGE, num_pages=total,
                                 writes_per_op=per_op)


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `addr` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_host_buffers_are_zeroed_huge_page_advised_and_outlive_their_mapping_object():
    import gc
    import os

    t = host_buffer((64, 2, 2, 16, 128), torch.bfloat16)
    gc.collect()
    assert t.shape == (64, 2, 2, 16, 128) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.view(torch.uint8).any()
    t[5, 1, 0, 3] = 2.5
    assert float(t.float().sum()) == 2.5 * 128
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE
    assert host_buffer((0, 8), torch.float32).shape == (0, 8)

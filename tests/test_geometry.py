"""The plan's write counts are the backends' own: SGLang's real buffers, the messenger's pages.

SGLang 0.5.23's classes are built on the CPU the way its scheduler builds them for the transfer
backend (`MHATokenToKVPool` / `MLATokenToKVPool` -> `get_kv_transfer_buf_infos`, and
`MetadataBuffers.get_buf_infos`, into `KVArgs`); the decoder's page list is SGLang's
`kv_to_page_indices` of the whole prompt. The count the backend arms its slot with
(`geometry.sglang_decode_writes`, as `PdtoolKVReceiver.send_metadata` calls it) must equal what
`pdtool plan --json` prints for the same deployment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.pdtool_cfg import recipe, recipe_args
from helpers.sglang_kvargs import sglang_backend_writes, sglang_kvargs

from pdtool.cli import main as pdtool_main
from pdtool.plan import build_plan
from pdtool.rules import has_errors, validate
from pdtool.schema import Config
from transfer import geometry as G
from transfer.layout import LayoutError, sglang_buffer_layouts
from transfer.parallel import ParallelDims
from transfer.routes import ShardSpec, pages_for, routes_for

ROOT = Path(__file__).resolve().parents[1]






def _sglang(*overrides: str, base: str = "llama-3.1-70b") -> Config:
    cfg = recipe(base, "model.num_layers=3", *overrides)  # engine=sglang recipes
    assert not has_errors(validate(cfg)), validate(cfg)
    return cfg


# the tiny model's shape on SGLang (which loads weights: the built-in model's seed is refused)
TINY = ("model=tiny", "model.seed=0", "model.dtype=bf16", "prefill.instances=1",
        "decode.instances=1")
GEOMETRIES = {
    "MHA equal TP": _sglang(*TINY, "model.attention=mha", "model.num_kv_heads=4",
                            "prefill.tp=2", "decode.tp=2"),
    "GQA TP8->TP4": _sglang(),
    "GQA TP1->TP2": _sglang(*TINY, "prefill.tp=1", "decode.tp=2"),
    "MLA TP8->TP8": _sglang(base="deepseek-r1"),
    "MLA TP8->TP4": _sglang("decode.tp=4", "model.num_params_b=300", "model.expert_params_b=280",
                            base="deepseek-r1"),
}


@pytest.mark.parametrize("tokens", [37, 65, 1000])  # 65: a page boundary + 1
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_plan_counts_what_the_sglang_backend_waits_for(name: str, tokens: int) -> None:
    cfg = GEOMETRIES[name]
    routes = build_plan(cfg, tokens=tokens).transfer.routes
    assert len(routes) == ParallelDims(cfg.decode.tp).attn_tp
    for route in routes:
        assert route.writes_per_request == sglang_backend_writes(cfg, tokens, route.dst_rank), \
            (name, route.dst_rank)


def test_optional_metadata_buffers_reach_the_plan(monkeypatch) -> None:
    """SGLang's sampling-mask buffers (env) and KV checksum (flag) add metadata writes."""
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")  # read by MetadataBuffers
    cfg = _sglang("+launcher.env.all.SGLANG_ENABLE_DISAGG_SAMPLING_MASK=1",
                  "engine.extra_args=['--disaggregation-enable-kv-checksum']")
    plan = build_plan(cfg, tokens=100)
    assert plan.transfer.aux_writes == 14
    for route in plan.transfer.routes:
        assert route.writes_per_request == sglang_backend_writes(
            cfg, 100, route.dst_rank, kv_checksum=True)


@pytest.mark.parametrize(("sampling_mask", "kv_checksum"),
                         [(False, False), (True, False), (False, True), (True, True)])
def test_metadata_description_is_sglang_metadata_buffers(monkeypatch, sampling_mask,
                                                         kv_checksum) -> None:
    """geometry's description has SGLang's buffers, in its order and with its row sizes."""
    if sampling_mask:
        monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    else:
        monkeypatch.delenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", raising=False)
    args, _keep = sglang_kvargs(_sglang(), 4, kv_checksum=kv_checksum)
    ours = G.sglang_metadata_buffers(sampling_mask=sampling_mask, kv_checksum=kv_checksum)
    assert [a.row_bytes for a in ours] == list(args.aux_item_lens)


@pytest.mark.slow
def test_every_recipe_plan_json_counts_equal_the_backends(capsys) -> None:
    """`pdtool plan --json` of each recipe == the count of the code that runs it: the SGLang
    backend from SGLang's own buffers, or the messenger from the reference engine's pages."""
    names = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert names
    for name in names:
        assert pdtool_main(["plan", f"+recipe={name}", *recipe_args(name), "--json",
                            "--tokens=300"]) == 0
        data = json.loads(capsys.readouterr().out)
        cfg = recipe(name)
        routes = data["transfer"]["routes"]
        for route in routes:
            if data["engine"] == "sglang":
                want = sglang_backend_writes(cfg, 300, route["dst_rank"])
            else:
                want = reference_messenger_writes(cfg, 300, route["dst_rank"])
            assert route["writes_per_request"] == want, (name, route["dst_rank"])


def reference_messenger_writes(cfg: Config, tokens: int, decode_rank: int) -> int:
    """The decode messenger's count (DecodeMessenger._begin) for the reference engine's real
    pages: its PagedKV layer tensors and the one hidden-state aux buffer its link registers."""
    from pdtool.engines.reference.cache import PagedKV
    from pdtool.engines.reference.fromplan import model_fields
    from pdtool.engines.reference.models import model_config
    from pdtool.schema import kv_dtype
    from transfer.layout import KVLayout

    tiny = model_config(model_fields(cfg.model, kv_dtype(cfg.model, cfg.decode), "decode"))
    src, dst = tiny.shard_spec(cfg.prefill.tp), tiny.shard_spec(cfg.decode.tp)
    kv = PagedKV(tiny, dst.heads_per_rank, 8, cfg.decode.page_size)
    lay = KVLayout.from_tensor(kv.layers[0], cfg.decode.kv_layout)
    return G.expected_writes(routes_for(src, dst, decode_rank), src, dst, layout=lay.kind,
                             page_size=lay.page_size, num_pages=pages_for(tokens, lay.page_size),
                             num_layers=len(kv.layers), buffers_per_layer=1,
                             aux_writes=len(G.reference_aux(tiny.hidden)))


# --- moved from tests/test_sglang_frames.py with the code they test -------------------------


def test_buffer_layouts_read_sglang_item_lengths() -> None:
    # MHA K buffer: 64 slots x 2 heads x 8 dims x bf16, page size 4 -> item 128 B
    (lay,) = sglang_buffer_layouts([64 * 2 * 8 * 2], [128], heads_local=2, page_size=4)
    assert (lay.kind, lay.num_pages, lay.heads_local, lay.page_size, lay.head_dim) == \
        ("NHD", 16, 2, 4, 16)
    with pytest.raises(LayoutError, match="KV buffer 1: item length 100 B"):
        sglang_buffer_layouts([2048, 2000], [128, 100], heads_local=2, page_size=4)


@pytest.mark.parametrize(("mla", "heads", "p_tp", "d_tp", "per_page"), [
    (False, 8, 8, 8, 1),        # equal TP: one write per (page, buffer)
    (False, 8, 8, 4, 2),        # each decode rank rebuilds from 2 prefill ranks: a packed
                                # head slice per page and source (not one write per token)
    (False, 8, 4, 8, 1),        # each decode rank takes half of one prefill rank's heads
    (True, 1, 8, 2, 1),         # MLA: latent replicated, one source
])
def test_expected_writes_follow_the_routes(mla, heads, p_tp, d_tp, per_page) -> None:
    n = G.sglang_decode_writes(is_mla=mla, total_heads=heads, prefill_tp=p_tp, decode_tp=d_tp,
                               decode_rank=d_tp - 1, page_size=64, num_pages=10,
                               num_buffers=2 * 61, num_aux=10)
    assert n == 10 * 2 * 61 * per_page + 10


# --- pools as data ---------------------------------------------------------------------------


def test_pool_axes_decide_the_runs_of_a_partial_head_slice() -> None:
    """HND is FlashInfer's [pages, 2, heads, tokens, dim]: K and V outermost, two runs (one for
    MLA's latent); NHD: one per token; a pool with heads outermost would be one."""
    assert G.messenger_pool("HND").axes == ("parts", "heads", "tokens", "dim")
    assert G.messenger_pool("HND").runs_per_page(64) == 2
    assert G.messenger_pool("HND", mla=True).runs_per_page(64) == 1
    assert G.messenger_pool("NHD").runs_per_page(64) == 64
    assert G.sglang_pool(False).runs_per_page(16) == 1  # the backend packs slices first
    heads_outer = G.PagePool("heads outer", "HND", ("heads", "parts", "tokens", "dim"), ("KV",),
                             2, whole_prompt=False)
    assert heads_outer.runs_per_page(64) == 1
    kv_outer = G.messenger_pool("HND")
    src, dst = ShardSpec(8, 8), ShardSpec(8, 4)
    sl = routes_for(src, dst, 0)[0]
    assert G.writes_per_page(sl, src, dst, kv_outer, 64) == 2
    same = routes_for(dst, dst, 0)[0]
    assert G.writes_per_page(same, dst, dst, kv_outer, 64) == 1  # whole pages stay one write


def test_pages_follow_the_engine() -> None:
    """The messenger stops one token short (decode recomputes it); SGLang sends every token."""
    assert G.messenger_pool("HND").pages_for(65, 64) == 1
    assert G.sglang_pool(True).pages_for(65, 64) == 2
    assert G.sglang_pool(True).pages_for(64, 64) == 1


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_sglang_slices_come_only_from_the_prefill_ranks_sglang_connects(heads):
    # SGLang sends a decode rank's META only to its target_tp_ranks; a head replicated on
    # several prefill ranks must come from one of those (1 KV head, TP4 -> TP2: decode rank 1
    # is connected to prefill ranks 2 and 3, though rank 0 holds the head too)
    from transfer.geometry import sglang_connected_ranks, sglang_slices

    for ptp in (1, 2, 4, 8):
        for dtp in (1, 2, 4, 8):
            for rank in range(dtp):
                connected = sglang_connected_ranks(ptp, dtp, rank)
                slices = sglang_slices(False, heads, ptp, dtp, rank)
                assert {s.src_rank for s in slices} <= set(connected), (ptp, dtp, rank)
                assert sum(s.num_heads for s in slices) == max(1, heads // dtp)
    assert [s.src_rank for s in sglang_slices(False, 1, 4, 2, 1)] == [2]

"""Speculative decoding through the `pdtool` SGLang backend: what SGLang 0.5.23 needs of the
transfer, and that it arrives.

SGLang's PD path for speculative decoding carries the draft's state of the first decode step in
its metadata buffers (`MetadataBuffers.output_topk_p`, `output_topk_index`,
`output_hidden_states`, written by the prefill's `set_buf`, read by the decode's `get_buf`);
the scheduler sizes the hidden-state row from the draft model's config for the EAGLE family
(`get_draft_recurrent_hidden_state_spec_from_config`). Algorithms whose draft model keeps a KV
pool of its own (EAGLE/NEXTN, EAGLE3, STANDALONE) also append that pool to the KV buffers
(`KVArgs.num_draft_entries`, the target's page ids); the backend sends them as more layer
buffers with their own geometry (`geometry.sglang_draft_group`).

The pair tests build the metadata buffers exactly as the scheduler does for a draft config,
fill the prefill rows the way `set_buf` does, and read the decode rows back with SGLang's own
`get_buf`; with a draft pool (a second real `MHATokenToKVPool` / `MLATokenToKVPool`, appended
as `_init_kv_manager` appends it) every target and draft page arrives byte-exact, and the
count is geometry's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
import torch
from helpers.pdtool_cfg import assert_error, recipe
from helpers.sglang_kvargs import sglang_backend_writes
from helpers.sglang_pair import (
    AUX_ROWS,
    KV_LORA,
    LAYERS,
    PAGE,
    PER_OP,
    ROOMS,
    ROPE,
    SLOTS,
    expected_decode,
    ops,
    run_pair,
)

from pdtool.plan import aux_buffers, build_plan
from pdtool.rules import validate
from transfer import geometry as G
from transfer.routes import RouteError

pytestmark = [pytest.mark.fabric, pytest.mark.sglang]

DRAFT_HIDDEN = 96  # the draft config's hidden size (its spec_hidden_size)
TOPK = 4  # --speculative-eagle-topk: SGLang's rows hold up to 16


def draft_config_dir() -> Path:
    """A draft model's HF config on disk (config only: SGLang reads no weights for this)."""
    from transformers import LlamaConfig

    path = Path(tempfile.mkdtemp(prefix="pdtool-draft-"))
    LlamaConfig(hidden_size=DRAFT_HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=1, vocab_size=128, intermediate_size=64,
                torch_dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def scheduler_metadata_sizes(algorithm: str | None) -> dict:
    """MetadataBuffers' hidden row as SGLang 0.5.23's scheduler picks it (`init_disaggregation`):
    the draft config's hidden state for algorithms that carry one, else 16 fp32."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.speculative.eagle_utils import (
        get_draft_recurrent_hidden_state_spec_from_config,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    alg = SpeculativeAlgorithm.from_string(algorithm)
    if alg.carries_draft_hidden_states():
        draft = ModelConfig(str(draft_config_dir()), is_draft_model=True)
        hidden, dtype = get_draft_recurrent_hidden_state_spec_from_config(draft, alg)
    else:
        hidden, dtype = 16, torch.float32
    return {"hidden_size": hidden, "hidden_states_dtype": dtype, "max_sampling_mask_tokens": 16}


def draft_row(row: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the prefill's draft produced for the request in metadata row `row`."""
    g = torch.Generator().manual_seed(500 + row)
    topk_p = torch.rand(TOPK, generator=g)
    topk_index = torch.randint(0, 1 << 40, (TOPK,), generator=g)
    hidden = torch.randn(DRAFT_HIDDEN, generator=g).to(torch.bfloat16)
    return 1000 + row, topk_p, topk_index, hidden


def fill_draft_rows(meta, row: int) -> None:
    """Prefill: the speculative part of `MetadataBuffers.set_buf(req)`, field by field (its
    `Req` needs SGLang's serving dependencies; the rows are the same)."""
    token, topk_p, topk_index, hidden = draft_row(row)
    meta.output_ids[row][0] = token
    meta.output_topk_p[row, :TOPK].copy_(topk_p)
    meta.output_topk_index[row, :TOPK].copy_(topk_index)
    meta.output_hidden_states[row].copy_(hidden)
    meta.bootstrap_room[row, 0] = 7000 + row


# --------------------------------------------------------------------------- geometry / plan
def test_spec_algorithm_sets_are_sglangs() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    names = {m.name for m in SpeculativeAlgorithm if m.name != "NONE"} | {"NEXTN"}
    assert names == G.SGLANG_SPEC_ALGORITHMS
    hidden = {a for a in names if SpeculativeAlgorithm.from_string(a).carries_draft_hidden_states()}
    assert hidden == G.SGLANG_SPEC_HIDDEN_STATES
    # no draft model (NGRAM, UNO) or one reading the target's KV (FROZEN_KV_MTP): no draft pool
    assert names - G.SGLANG_SPEC_DRAFT_KV == {"NGRAM", "UNO", "FROZEN_KV_MTP"}


@pytest.mark.parametrize("algorithm", [None, "NGRAM", "FROZEN_KV_MTP", "EAGLE", "EAGLE3"])
def test_geometry_metadata_rows_equal_sglangs_in_spec_mode(algorithm) -> None:
    """geometry's description == SGLang's MetadataBuffers built as its scheduler builds them
    for the algorithm: same buffers (the count does not change), same row sizes."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    sizes = scheduler_metadata_sizes(algorithm)
    _, _, item_lens = MetadataBuffers(4, **sizes).get_buf_infos()
    hidden, itemsize = G.sglang_hidden_row(algorithm, DRAFT_HIDDEN, 2)
    ours = G.sglang_metadata_buffers(hidden_size=hidden, hidden_itemsize=itemsize,
                                     max_sampling_mask_tokens=16)
    assert [a.row_bytes for a in ours] == list(item_lens)
    assert len(ours) == 10


def _spec_cfg(algorithm: str, *over: str):
    cfg = recipe("llama-3.1-70b", "prefill.tp=4", *over)
    cfg.engine.extra_args = ["--speculative-algorithm", algorithm]
    return cfg


@pytest.mark.parametrize("algorithm", ["NGRAM", "FROZEN_KV_MTP", "uno"])
def test_plan_and_validate_accept_algorithms_without_draft_kv(algorithm) -> None:
    cfg = _spec_cfg(algorithm)
    assert not [f for f in validate(cfg) if f.severity == "error"], validate(cfg)
    plan = build_plan(cfg, tokens=300)
    assert plan.transfer.aux_writes == 10  # the same buffers, one write each
    for route in plan.transfer.routes:
        assert route.writes_per_request == sglang_backend_writes(cfg, 300, route.dst_rank)
    hidden = {a.name: a.row_bytes for a in aux_buffers(cfg)}["output_hidden_states"]
    carries = algorithm.upper() in G.SGLANG_SPEC_HIDDEN_STATES
    assert hidden == (cfg.model.hidden_size * 2 if carries else 64)


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_validate_refuses_draft_pools_with_rules_of_their_own(algorithm) -> None:
    f = assert_error(_spec_cfg(algorithm, "model.draft_layers=1"), "engine.extra_args",
                     f"--speculative-algorithm {algorithm}", "rules of its own",
                     "pdtool SGLang transfer backend")
    assert "EAGLE" in f.fix and "mooncake" in f.fix


@pytest.mark.parametrize("algorithm", ["EAGLE", "NEXTN", "EAGLE3", "STANDALONE"])
def test_validate_asks_for_the_draft_layers_of_a_draft_kv_pool(algorithm) -> None:
    f = assert_error(_spec_cfg(algorithm), "model.draft_layers",
                     f"--speculative-algorithm {algorithm}", "KV pool of its own")
    assert "num_hidden_layers" in f.fix


def draft_buffers(cfg, tp: int) -> tuple[int, int]:
    """(buffers, item length) of a draft pool like the target's with model.draft_layers
    layers, built with SGLang's own pool class as the draft worker builds one."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    m = cfg.model
    common = {"size": 64, "page_size": cfg.decode.page_size, "dtype": torch.bfloat16,
              "layer_num": m.draft_layers, "device": "cpu", "enable_memory_saver": False}
    if m.attention == "mla":
        pool = MLATokenToKVPool(kv_lora_rank=m.kv_lora_rank,
                                qk_rope_head_dim=m.qk_rope_head_dim, **common)
    else:
        pool = MHATokenToKVPool(head_num=max(1, m.num_kv_heads // tp), head_dim=m.head_dim,
                                enable_alt_stream=False, **common)
    _, _, items = pool.get_contiguous_buf_infos()
    return len(items), items[0]


@pytest.mark.parametrize("base,over,algorithm,sources", [
    ("llama-3.1-70b", ("prefill.tp=4",), "EAGLE3", 1),  # equal TP: whole pages
    ("llama-3.1-70b", (), "EAGLE", 2),                 # TP8 -> TP4: a slice from 2 ranks
    ("deepseek-r1", (), "NEXTN", 1),                   # MLA: whole latent pages
])
def test_plan_counts_the_draft_kv_as_the_backend_does(base, over, algorithm, sources) -> None:
    """The plan's writes/request = the backend's count for the target (as before) + its count
    for the draft pool, from geometry fed the item lengths of real SGLang draft pools."""
    cfg = recipe(base, *over, "model.draft_layers=1")
    cfg.engine.extra_args = ["--speculative-algorithm", algorithm]
    assert not [f for f in validate(cfg) if f.severity == "error"], validate(cfg)
    plan = build_plan(cfg, tokens=300)
    assert "draft KV (model.draft_layers=1)" in plan.transfer.draft
    p_tp, d_tp = plan.transfer.prefill.attn_tp, plan.transfer.decode.attn_tp
    (n, p_item), (_, d_item) = draft_buffers(cfg, p_tp), draft_buffers(cfg, d_tp)
    page = cfg.decode.page_size
    group, _ = G.sglang_draft_group(n, p_item // page, d_item // page, p_tp, d_tp,
                                    target_mla=cfg.model.attention == "mla")
    pages = G.sglang_pool(cfg.model.attention == "mla").pages_for(300, page)
    for route in plan.transfer.routes:
        dsrc, ddst = group.specs(p_tp, d_tp)
        draft = G.expected_writes(G.sglang_group_slices(group, p_tp, d_tp, route.dst_rank),
                                  dsrc, ddst, layout=G.sglang_pool(False), page_size=page,
                                  num_pages=pages, num_layers=1, buffers_per_layer=n)
        assert draft == pages * n * sources  # one write per page, buffer and source
        assert route.writes_per_request == \
            sglang_backend_writes(cfg, 300, route.dst_rank) + draft
    for inst in plan.instances:
        for rank in inst.ranks:
            assert rank.env["PDTOOL_DRAFT_LAYERS"] == "1"  # what the backend checks


def test_validate_refuses_draft_layers_that_would_change_nothing() -> None:
    cfg = recipe("llama-3.1-70b", "model.draft_layers=1")
    assert_error(cfg, "model.draft_layers", "without a --speculative-algorithm")
    cfg.engine.extra_args = ["--speculative-algorithm", "NGRAM"]
    assert_error(cfg, "model.draft_layers", "without a --speculative-algorithm")
    cfg = _spec_cfg("EAGLE", "model.draft_layers=1", "transfer.backend=mooncake")
    assert_error(cfg, "model.draft_layers", "only pdtool's SGLang transfer backend")


def test_validate_refuses_a_draft_kv_pool_on_one_role_only() -> None:
    cfg = recipe("llama-3.1-70b", "model.draft_layers=1")
    cfg.decode.extra_args = ["--speculative-algorithm", "STANDALONE"]
    assert_error(cfg, "decode.extra_args", "decode runs STANDALONE", "same KV buffers")


def test_validate_refuses_a_draft_hidden_state_only_one_role_makes() -> None:
    cfg = recipe("llama-3.1-70b", "prefill.tp=4")
    cfg.decode.extra_args = ["--speculative-algorithm=FROZEN_KV_MTP"]
    assert_error(cfg, "decode.extra_args", "prefill runs none, decode FROZEN_KV_MTP")
    cfg.prefill.extra_args = ["--speculative-algorithm", "frozen_kv_mtp"]
    assert not [f for f in validate(cfg) if f.severity == "error"]
    # NGRAM drafts on the decode alone: nothing comes from the prefill
    cfg = recipe("llama-3.1-70b", "prefill.tp=4")
    cfg.decode.extra_args = ["--speculative-algorithm", "NGRAM"]
    assert not [f for f in validate(cfg) if f.severity == "error"]


def test_validate_refuses_unknown_algorithms() -> None:
    assert_error(_spec_cfg("MEDUSA"), "engine.extra_args", "MEDUSA", "not one of SGLang")


def test_other_backends_are_not_judged_by_the_pdtool_rule() -> None:
    cfg = _spec_cfg("DFLASH", "transfer.backend=mooncake")
    assert not [f for f in validate(cfg) if "draft-model KV" in f.message]


# --------------------------------------------------------------------------- the transfer
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_draft_hidden_state_and_topk_arrive_byte_exact_and_counted() -> None:
    """FROZEN_KV_MTP's metadata (the scheduler's draft-sized hidden row, bf16) from a prefill
    TP1 to a decode TP1 over tcp;ofi_rxm: KV pages and SGLang's own `get_buf` view of the
    decode rows equal what the prefill's draft wrote; one operation per metadata buffer."""
    sizes = scheduler_metadata_sizes("FROZEN_KV_MTP")
    assert sizes["hidden_size"] == DRAFT_HIDDEN and sizes["hidden_states_dtype"] == torch.bfloat16
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "rooms": ROOMS,
           "provider": "tcp;ofi_rxm", "metadata": sizes, "fill_metadata": fill_draft_rows}
    res = run_pair(cfg)
    (tag, out, bufs, aux, remote_writes, stale, _), = res["decode"]
    assert tag == "done"
    from sglang.srt.disaggregation.utils import MetadataBuffers

    seen = MetadataBuffers(AUX_ROWS, **sizes)  # the decode's rows, read the way it reads them
    for (data, _ilen), t in zip(aux, _buffers(seen), strict=True):
        t.view(-1).view(torch.uint8).numpy()[...] = np.frombuffer(data, dtype=np.uint8)
    for room, req in ROOMS.items():
        assert out[room]["states"][-1] == 4, out[room]  # KVPoll.Success
        assert set(out[room]["per_op"]) == {PER_OP}
        for buf, want in zip(bufs, expected_decode(cfg, 0, room), strict=True):
            got = buf.reshape(SLOTS // PAGE, PAGE, *buf.shape[1:])[req["dst_pages"]]
            assert np.array_equal(got, want), f"room {room}: KV pages differ"
        row = seen.get_buf(req["dst_aux"])
        token, topk_p, topk_index, hidden = draft_row(req["aux_index"])
        assert int(row[0][0]) == token
        assert torch.equal(row[9][:TOPK], topk_p) and torch.equal(row[10][:TOPK], topk_index)
        assert row[11].dtype == torch.bfloat16 and torch.equal(row[11], hidden)
        assert int(row[-1][0]) == 7000 + req["aux_index"]  # bootstrap_room: SGLang's check
    want = {r: ops(len(q["dst_pages"])) * 2 * LAYERS + len(aux) for r, q in ROOMS.items()}
    assert len(aux) == len(G.sglang_metadata_buffers()) == 10
    assert {r: o["count"] for r, o in out.items()} == want
    assert remote_writes == sum(want.values()) and stale == 0
    assert res["prefill"][0][1] == {11: 4, 12: 4}


def _buffers(meta) -> list[torch.Tensor]:
    """MetadataBuffers' registered tensors in `get_buf_infos` order (matched by pointer)."""
    ptrs, _, _ = meta.get_buf_infos()
    by_ptr = {t.data_ptr(): t for t in vars(meta).values() if isinstance(t, torch.Tensor)}
    return [by_ptr[p] for p in ptrs]


# --------------------------------------------------------------------------- draft-model KV
def test_draft_group_is_told_from_the_bytes_a_token_takes() -> None:
    """Whole pages where both sides hold the same bytes (equal TP, a replicated latent, heads
    held by fewer ranks than either side has), head slices where the token row is split
    without replicas on both sides, a clear refusal otherwise."""
    group, unit = G.sglang_draft_group(2, 64, 64, 2, 2)
    assert group.whole and group.heads == 1 and unit == 64
    group, unit = G.sglang_draft_group(1, 1152, 1152, 2, 1, target_mla=True)  # NEXTN latent
    assert group.whole
    assert G.sglang_group_slices(group, 4, 2, 1)[0].src_rank == 2  # SGLang's first of 2, 3
    group, unit = G.sglang_draft_group(2, 32, 64, 2, 1)  # 2 heads × 16 B over TP2 -> TP1
    assert not group.whole and unit == 32 and group.heads == 2
    assert [s.src_rank for s in G.sglang_group_slices(group, 2, 1, 0)] == [0, 1]
    with pytest.raises(RouteError, match="replicated on one side only"):
        G.sglang_draft_group(2, 32, 64, 4, 1)  # 2 heads on 4 prefill ranks: replicas there
    with pytest.raises(RouteError, match="beside an MLA target"):
        G.sglang_draft_group(2, 32, 64, 2, 1, target_mla=True)


def _draft_counts(cfg: dict, rank: int, pages: int, n_aux: int) -> int:
    """geometry's count for a decode rank of `cfg` (its draft as the pair's bytes show it)."""
    d = cfg["draft"]
    nd = d["layers"] * (1 if d["mla"] else 2)

    def token_bytes(tp: int) -> int:
        return ((KV_LORA + ROPE) if d["mla"] else max(1, d["heads"] // tp) * d["head_dim"]) * 2

    group, _ = G.sglang_draft_group(nd, token_bytes(cfg["prefill_tp"]),
                                    token_bytes(cfg["decode_tp"]), cfg["prefill_tp"],
                                    cfg["decode_tp"], target_mla=cfg["mla"])
    n = (LAYERS if cfg["mla"] else 2 * LAYERS) + nd
    return G.sglang_decode_writes(is_mla=cfg["mla"], total_heads=cfg["heads"],
                                  prefill_tp=cfg["prefill_tp"], decode_tp=cfg["decode_tp"],
                                  decode_rank=rank, page_size=PAGE, num_pages=pages,
                                  num_buffers=n, num_aux=n_aux, writes_per_op=PER_OP,
                                  draft=group)


def _check_draft_pair(cfg: dict, res: dict, per_page_ops: int) -> None:
    """Every target and draft page, and SGLang's `get_buf` view of the draft's metadata rows,
    arrived byte-exact; every decode rank counted geometry's figure, which is also
    `per_page_ops` operations per (PER_OP pages, buffer) + one per metadata buffer."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    sizes = cfg["metadata"]
    for rank, (tag, out, bufs, aux, remote_writes, stale, _) in enumerate(res["decode"]):
        assert tag == "done"
        assert len(bufs) == len(expected_decode(cfg, rank, next(iter(cfg["rooms"]))))
        seen = MetadataBuffers(AUX_ROWS, **sizes)
        for (data, _ilen), t in zip(aux, _buffers(seen), strict=True):
            t.view(-1).view(torch.uint8).numpy()[...] = np.frombuffer(data, dtype=np.uint8)
        want = {}
        for room, req in cfg["rooms"].items():
            assert out[room]["states"][-1] == 4, out[room]  # KVPoll.Success
            for i, (buf, exp) in enumerate(zip(bufs, expected_decode(cfg, rank, room),
                                               strict=True)):
                got = buf.reshape(SLOTS // PAGE, PAGE, *buf.shape[1:])[req["dst_pages"]]
                assert np.array_equal(got, exp), f"room {room} rank {rank}: buffer {i} differs"
            row = seen.get_buf(req["dst_aux"])
            token, topk_p, topk_index, hidden = draft_row(req["aux_index"])
            assert int(row[0][0]) == token and torch.equal(row[11], hidden)
            assert torch.equal(row[9][:TOPK], topk_p) and torch.equal(row[10][:TOPK], topk_index)
            pages = len(req["dst_pages"])
            want[room] = _draft_counts(cfg, rank, pages, len(aux))
            assert want[room] == ops(pages) * per_page_ops + len(aux)
        assert {r: o["count"] for r, o in out.items()} == want
        assert remote_writes == sum(want.values()) and stale == 0


def _eagle_cfg(**kw) -> dict:
    """A pair with a draft pool; the plan's PDTOOL_DRAFT_LAYERS set as the worker sets it."""
    layers = str(kw["draft"]["layers"])
    return {"rooms": ROOMS, "metadata": scheduler_metadata_sizes("EAGLE"),
            "fill_metadata": fill_draft_rows, "extra_env": {"PDTOOL_DRAFT_LAYERS": layers},
            **kw}


def start_manager(cfg: dict, rank: int, conn) -> None:
    """A prefill rank process that only builds its manager: "started" or the start-up error."""
    import os

    os.environ.update(cfg["env"])
    from helpers.sglang_pair import setup_rank
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolBackendError, PdtoolKVManager

    sa, args, _keep, _aux = setup_rank("prefill", cfg, rank)
    try:
        PdtoolKVManager(args, DisaggregationMode.PREFILL, sa, cfg["mla"]).teardown()
        conn.send("started")
    except PdtoolBackendError as exc:
        conn.send(str(exc))
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_backend_refuses_a_draft_pool_the_plan_did_not_count() -> None:
    """model.draft_layers=2 in the plan (PDTOOL_DRAFT_LAYERS), a 1-layer draft pool in SGLang:
    the rank stops at start-up naming both, instead of serving counts the plan misprinted."""
    import multiprocessing as mp

    from helpers.sglang_pair import free_port

    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "bootstrap_port": free_port(),
           "http_port": free_port(), "draft": {"mla": False, "layers": 1, "heads": 2,
                                                 "head_dim": 8},
           "env": {"PDTOOL_FI_PROVIDER": "shm", "PDTOOL_SECRET": "t0p-secret-of-16+bytes",
                   "PDTOOL_DRAFT_LAYERS": "2"}}
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=start_manager, args=(cfg, 0, b), daemon=True)
    p.start()
    try:
        assert a.poll(180), "the rank did not start"
        got = a.recv()
    finally:
        p.join(20)
        if p.is_alive():
            p.kill()
    assert "draft-model KV of 2 buffers" in got and "model.draft_layers=2" in got, got
    assert "PDTOOL_DRAFT_LAYERS" in got and "makes 4" in got, got


@pytest.mark.timeout(400)
def test_eagle_draft_kv_equal_tp_arrives_byte_exact_and_counted() -> None:
    """EAGLE: a 1-layer draft with heads and head_dim of its own (4 × 16 vs the target's 2 × 8)
    beside the target, TP1 -> TP1 over shm: the draft's K and V are two more layer buffers,
    one write per (page, buffer), addressed with the target's pages."""
    cfg = _eagle_cfg(mla=False, heads=2, prefill_tp=1, decode_tp=1,
                     draft={"mla": False, "layers": 1, "heads": 4, "head_dim": 16})
    res = run_pair(cfg)
    _check_draft_pair(cfg, res, 2 * LAYERS + 2)
    assert res["prefill"][0][1] == {11: 4, 12: 4}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_draft_kv_gqa_prefill_tp2_to_decode_tp1_reassembles_both_pools() -> None:
    """GQA TP2 -> TP1 over tcp;ofi_rxm: each prefill rank holds half of the target's 4 heads
    and half of a 2-layer draft's 2 heads (head_dim 16): every page of both pools comes from
    both ranks, each rank's page (its whole slice) written into the decoder's landing area and
    scattered into the pools at its head offset before Success."""
    cfg = _eagle_cfg(mla=False, heads=4, prefill_tp=2, decode_tp=1, provider="tcp;ofi_rxm",
                     rooms={11: ROOMS[11]},
                     draft={"mla": False, "layers": 2, "heads": 2, "head_dim": 16})
    res = run_pair(cfg)
    _check_draft_pair(cfg, res, (2 * LAYERS + 2 * 2) * 2)  # every buffer from both ranks
    assert [p[2] for p in res["prefill"]] == [0, 0]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nextn_mla_draft_prefill_tp2_to_decode_tp1_from_the_drawn_source() -> None:
    """DeepSeek's NEXTN (MTP): an MLA draft layer beside the MLA target, TP2 -> TP1 over
    tcp;ofi_rxm: both latents are replicated, so the one prefill rank drawn real for a
    request sends the target's and the draft's pages (one write per page and buffer)."""
    cfg = _eagle_cfg(mla=True, heads=1, prefill_tp=2, decode_tp=1, provider="tcp;ofi_rxm",
                     draft={"mla": True, "layers": 1})
    res = run_pair(cfg)
    _check_draft_pair(cfg, res, LAYERS + 1)
    assert [p[1] for p in res["prefill"]] == [{11: 4, 12: 4}] * 2  # the dummy rank too


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_draft_kv_prefill_tp1_to_decode_tp2_packs_the_drafts_own_heads() -> None:
    """TP1 -> TP2 over shm: each decode rank takes half of the target's 4 heads and half of a
    1-layer draft's 4 heads × 16 (twice the target's head bytes): the prefill packs each half
    into a bounce buffer, the draft's in units of its own (64 B, not the target's 16 B)."""
    cfg = _eagle_cfg(mla=False, heads=4, prefill_tp=1, decode_tp=2, rooms={12: ROOMS[12]},
                     draft={"mla": False, "layers": 1, "heads": 4, "head_dim": 16})
    res = run_pair(cfg)
    _check_draft_pair(cfg, res, 2 * LAYERS + 2)
    (_, _, _, stats), = res["prefill"]
    assert stats["gathers"] > 0  # the head slices went through the bounce buffers

"""Speculative decoding through the `pdtool` SGLang backend: what SGLang 0.5.23 needs of the
transfer, and that it arrives.

SGLang's PD path for speculative decoding carries the draft's state of the first decode step in
its metadata buffers (`MetadataBuffers.output_topk_p`, `output_topk_index`,
`output_hidden_states`, written by the prefill's `set_buf`, read by the decode's `get_buf`);
the scheduler sizes the hidden-state row from the draft model's config for the EAGLE family
(`get_draft_recurrent_hidden_state_spec_from_config`). Algorithms whose draft model keeps a KV
pool of its own also append that pool to the KV buffers (`KVArgs.num_draft_entries`), which
the backend does not carry; validate refuses them and accepts the others.

The pair test builds the metadata buffers exactly as the scheduler does for a draft config,
fills the prefill rows the way `set_buf` does, and reads the decode rows back with SGLang's
own `get_buf`: byte-exact, and counted (one write per metadata buffer, as geometry says).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
import torch
from pdtool_cfg import assert_error, recipe
from test_geometry import sglang_backend_writes
from test_sglang_backend import (
    AUX_ROWS,
    LAYERS,
    PAGE,
    PER_OP,
    ROOMS,
    SLOTS,
    expected_decode,
    ops,
    run_pair,
)

from pdtool.plan import aux_buffers, build_plan
from pdtool.rules import validate
from transfer import geometry as G

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


@pytest.mark.parametrize("algorithm", ["EAGLE", "NEXTN", "EAGLE3", "STANDALONE", "DFLASH"])
def test_validate_refuses_algorithms_with_draft_model_kv(algorithm) -> None:
    f = assert_error(_spec_cfg(algorithm), "engine.extra_args", f"--speculative-algorithm "
                     f"{algorithm}", "draft-model KV", "pdtool SGLang transfer backend")
    assert "NGRAM" in f.fix and "mooncake" in f.fix


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
    cfg = _spec_cfg("EAGLE", "transfer.backend=mooncake")
    assert not [f for f in validate(cfg) if "draft-model KV" in f.message]


# --------------------------------------------------------------------------- the transfer
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

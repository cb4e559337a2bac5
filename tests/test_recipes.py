"""Every recipe in recipes/ composes, validates clean, and plans routes as docs/sharding.md says."""

from __future__ import annotations

import pytest
from helpers.pdtool_cfg import recipe

from pdtool.compose import recipe_description, recipe_files
from pdtool.plan import build_plan
from pdtool.rules import validate

RECIPES = sorted(recipe_files())

#: HND counts are the reference engine's (its pages follow transfer.layout); SGLang recipes keep
#: SGLang's NHD pools. A byte vocabulary makes these model shapes ones it could run.
#: the same deployment on the reference engine, whose MLP is dense (no experts: the recipes'
#: SGLang --ep-size goes, and so do their SGLang flags)
REFERENCE = ("engine=reference", "model.vocab_size=256", "model.num_experts=0", "prefill.ep=1",
             "decode.ep=1", "engine.extra_args=[]", "prefill.extra_args=[]", "decode.extra_args=[]")


def test_the_required_recipes_exist():
    assert {
        "tiny-local",
        "deepseek-r1",
        "deepseek-r1-dp-attention",
        "qwen3-coder-480b",
        "llama-3.1-70b",
    } <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_validates_clean_and_plans(name):
    cfg = recipe(name)
    assert cfg.recipe == name, "a recipe sets `recipe:` to its file name"
    assert recipe_description(recipe_files()[name])
    findings = validate(cfg)
    assert [f for f in findings if f.severity == "error"] == [], findings
    if cfg.prefill.tp == cfg.decode.tp:
        assert findings == [], findings  # equal sharding: not even a warning
    plan = build_plan(cfg)
    assert plan.recipe == name
    # every GPU rank placed once, with a NIC its provider drives
    seats = [(r.node, r.gpu) for r in plan.all_ranks()]
    assert len(seats) == len(set(seats))
    assert all(r.nics and r.nic_affinity in ("switch", "host") for r in plan.all_ranks())
    assert plan.transfer.routes


def test_deepseek_r1_production_shape():
    cfg = recipe("deepseek-r1")
    m = cfg.model
    assert (m.attention, m.num_layers, m.kv_lora_rank, m.qk_rope_head_dim) == ("mla", 61, 512, 64)
    assert (m.num_experts, m.moe_intermediate_size, m.expert_params_b) == (256, 2048, 653.9)
    assert (m.dtype, m.num_params_b) == ("fp8", 671)
    assert (cfg.cluster.name, cfg.cluster.gpu_memory_gb) == ("p5en", 141)
    plan = build_plan(cfg)
    assert [(i.role, i.tp) for i in plan.instances] == [("prefill", 8)] + [("decode", 8)] * 3
    for route in plan.transfer.routes:  # MLA: one replica set, any of the 8 prefill ranks
        assert [s.src_candidates for s in route.slices] == [tuple(range(8))]
        assert route.writes_per_page == 1


def test_deepseek_r1_dp_attention_shape():
    plan = build_plan(recipe("deepseek-r1-dp-attention"))
    for inst in plan.instances:
        assert (inst.tp, inst.dp, inst.dp_attention, inst.gpus) == (8, 8, True, 8)
    dense = build_plan(recipe("deepseek-r1")).memory[0]
    dpa = plan.memory[0]
    assert dpa.expert_weights_gb == dense.expert_weights_gb  # experts still sharded over 8
    assert dpa.dense_weights_gb > dense.dense_weights_gb  # attention replicated per GPU
    (route,) = plan.transfer.routes
    assert route.slices[0].src_candidates == (0,)


def test_qwen3_coder_equal_tp_hnd():
    cfg = recipe("qwen3-coder-480b")
    m = cfg.model
    assert (m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim) == (62, 96, 8, 128)
    assert (m.num_experts, m.moe_intermediate_size, m.dtype) == (160, 2560, "fp8")
    plan = build_plan(cfg)
    assert plan.transfer.layout == "NHD"  # SGLang's pools: transfer.layout=HND does not apply
    assert [i.tp for i in plan.instances] == [8, 8, 8, 8]
    for d, route in enumerate(plan.transfer.routes):
        (s,) = route.slices
        assert s.src_candidates == (d,) and s.head_lo == d
        assert route.writes_per_page == 1  # equal TP: a whole NHD page of a buffer is contiguous
        # pages x layers x K, V + one row of each of SGLang's 10 metadata buffers
        assert route.writes_per_request == 64 * 62 * 2 + 10
    ref = recipe("qwen3-coder-480b", *REFERENCE)
    assert not [f for f in validate(ref) if f.severity == "error"]
    hnd = build_plan(ref).transfer
    assert (hnd.layout, hnd.buffers_per_layer) == ("HND", 1)
    for route in hnd.routes:
        assert route.writes_per_page == 1 and route.writes_per_request == 64 * 62 + 1


def test_llama_tp8_to_tp4_reconstructs_from_two_ranks():
    cfg = recipe("llama-3.1-70b")
    m = cfg.model
    assert (m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim) == (80, 64, 8, 128)
    plan = build_plan(cfg)
    assert (cfg.prefill.tp, cfg.decode.tp) == (8, 4)
    for route in plan.transfer.routes:  # engine=sglang: NHD pools, head slices packed
        assert len(route.slices) == 2
        assert route.writes_per_page == 2
    ref = recipe("llama-3.1-70b", *REFERENCE)
    assert not [f for f in validate(ref) if f.severity == "error"]
    for route in build_plan(ref).transfer.routes:  # HND: a K run and a V run per slice
        assert len(route.slices) == 2
        assert route.writes_per_page == 2 * 2
    nhd = build_plan(recipe("llama-3.1-70b", *REFERENCE, "transfer.layout=NHD")).transfer.routes
    assert all(r.writes_per_page == 2 * 64 for r in nhd)


def test_tiny_local_matches_the_reference_engine_model():
    cfg = recipe("tiny-local")
    assert (cfg.cluster.device, cfg.transfer.provider, cfg.launcher.kind) == ("cpu", "shm", "local")
    assert cfg.engine.kind == "reference"
    plan = build_plan(cfg)
    assert plan.transfer.summary.startswith("rank i sends to rank i")
    mla = build_plan(recipe("tiny-local-mla"))
    (route,) = mla.transfer.routes
    assert route.slices[0].src_candidates == (0, 1)

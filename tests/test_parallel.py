"""transfer.parallel.ParallelDims: the one home of GPUs per instance, attention TP, heads."""

from __future__ import annotations

import pytest
from helpers.pdtool_cfg import recipe

from pdtool.memory import kv_heads_per_rank
from pdtool.plan import build_plan, shard_spec
from pdtool.schema import attn_tp, gpus_per_instance, role_dims
from transfer.parallel import ParallelDims
from transfer.routes import RouteError, ShardSpec


def test_degrees_with_and_without_dp_attention() -> None:
    dpa = ParallelDims(tp=8, dp=4, dp_attention=True, kv_heads=1)
    assert (dpa.gpus, dpa.attn_dp, dpa.replicas, dpa.attn_tp) == (8, 4, 4, 2)
    assert dpa.replicated and dpa.replication == 2 and dpa.heads_per_rank == 1
    rep = ParallelDims(tp=4, dp=2, kv_heads=8)  # two independent TP-4 replicas
    assert (rep.gpus, rep.attn_dp, rep.replicas, rep.attn_tp) == (8, 1, 2, 4)
    assert not rep.replicated and rep.heads_per_rank == 2
    assert [list(rep.heads_of(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    gqa = ParallelDims(tp=8, kv_heads=2)
    assert [gqa.heads_of(r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gqa.holders(1) == [4, 5, 6, 7]


def test_node_span() -> None:
    assert ParallelDims(tp=2, gpus_per_node=8).node_span() == (1, 4)
    assert ParallelDims(tp=2, gpus_per_node=8).node_count(5) == 2
    assert ParallelDims(tp=16, nodes=2, gpus_per_node=8).node_span() == (2, 1)
    assert ParallelDims(tp=16, nodes=2, gpus_per_node=8).node_count(3) == 6


def test_problems_show_every_factor() -> None:
    (p,) = ParallelDims(tp=6, dp=4, dp_attention=True, role="decode").problems()
    assert p.field == "dp"
    assert "6 GPUs of decode.tp into decode.dp=4 groups: 6 % 4 = 2" in p.message
    (p,) = ParallelDims(tp=8, dp=2, dp_attention=True, kv_heads=3, role="prefill").problems()
    assert p.field == "dp"
    assert "3 KV heads (model.num_kv_heads) cannot be split over attention TP 4 " \
           "(prefill.tp=8 / prefill.dp=2): need 3 % 4 == 0" in p.message
    assert "or 4 % 3 == 0" in p.message
    (p,) = ParallelDims(tp=4, dp=3, nodes=2, gpus_per_node=8, kv_heads=4,
                        role="decode").problems()
    assert p.field == "tp"
    assert "decode.tp=4 x decode.dp=3 -> 12 / 2 = 6 GPUs per node" in p.message
    assert "cluster.gpus_per_node=8 (2 GPUs idle on each node)" in p.message
    (p,) = ParallelDims(tp=0).problems()
    assert (p.field, p.message) == ("tp", "tp=0: must be >= 1")
    assert ParallelDims(tp=8, kv_heads=8, gpus_per_node=8).problems() == []


def test_shard_spec_asks_parallel_dims() -> None:
    spec = ShardSpec(num_kv_heads=8, tp=8, dp=2)
    assert spec.dims == ParallelDims(tp=8, dp=2, dp_attention=True, kv_heads=8)
    assert (spec.attn_tp, spec.heads_per_rank, spec.replicated) == (4, 2, False)
    with pytest.raises(RouteError, match=r"3 KV heads .* cannot be split over attention TP 2"):
        ShardSpec(num_kv_heads=3, tp=2).check()


@pytest.mark.parametrize("name", ["llama-3.1-70b", "deepseek-r1-dp-attention", "tiny-local"])
def test_config_helpers_and_plan_agree_with_role_dims(name: str) -> None:
    cfg = recipe(name)
    plan = build_plan(cfg)
    for r, rc in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        d = role_dims(cfg, r)
        assert gpus_per_instance(rc) == d.gpus and attn_tp(rc) == d.attn_tp
        assert kv_heads_per_rank(cfg.model, rc) == d.heads_per_rank
        assert shard_spec(cfg, r).dims.attn_tp == d.attn_tp
        for inst in plan.role_instances(r):
            assert (inst.gpus, inst.attn_tp) == (d.gpus, d.attn_tp)
    assert plan.transfer.decode.heads_per_rank == role_dims(cfg, "decode").heads_per_rank

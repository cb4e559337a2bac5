"""The plan: placement, NICs, CPUs, ports, memory, routes, and its JSON contract."""

from __future__ import annotations

import json
import math

import pytest
from helpers.pdtool_cfg import compose, recipe
from rich.console import Console

from pdtool.commands.plan import print_plan
from pdtool.plan import (
    PLAN_VERSION,
    Plan,
    build_plan,
    compress_cpus,
    expand_cpus,
    from_json,
    plan_from_dict,
    plan_to_dict,
    rank_cpus,
    to_json,
)
from pdtool.rules import validate
from pdtool.schema import Config
from transfer import geometry as G
from transfer import routes as R


def test_cpu_lists():
    assert expand_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert compress_cpus([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    with pytest.raises(ValueError):
        expand_cpus("3-1")


def test_rank_cpu_shares():
    cl = compose("cluster=p5en").cluster
    assert rank_cpus(cl, 0) == "0-11,96-107"  # cores with their hyperthread siblings
    assert rank_cpus(cl, 7) == "84-95,180-191"
    cl.gpus_per_node, cl.gpu_numa, cl.numa_cpus = 4, [0, 0, 0, 0], ["0-15"]
    assert rank_cpus(cl, 1) == "4-7"
    cl.numa_cpus = ["0-2"]  # fewer CPUs than GPUs: everyone shares the NUMA node
    assert rank_cpus(cl, 3) == "0-2"


def test_tiny_local_placement_and_ports():
    plan = build_plan(compose())
    assert plan.nodes == 1 and plan.launcher == "local"
    names = [i.name for i in plan.instances]
    assert names == ["prefill-0", "decode-0", "decode-1"]
    ranks = plan.all_ranks()
    assert [(r.node, r.gpu) for r in ranks] == [(0, 0), (0, 1), (0, 2)]
    assert all(r.nics == ("shm",) and r.nic_kind == "shm" for r in ranks)
    assert ranks[0].env["FI_PROVIDER"] == "shm"
    p0, _, d1 = plan.instances
    assert (p0.http_port, p0.bootstrap_port, p0.dist_init_port) == (30000, 8998, 20000)
    assert (d1.http_port, d1.bootstrap_port, d1.dist_init_port) == (31001, None, 21001)
    assert [t.instance for t in plan.router.prefill] == ["prefill-0"]
    assert plan.router.prefill[0].bootstrap_port == 8998
    assert [t.http_port for t in plan.router.decode] == [31000, 31001]
    assert plan.router.port == 8000


def test_slurm_node_groups_pack_single_node_instances():
    plan = build_plan(recipe("llama-3.1-70b"))
    assert plan.nodes == 2
    pre, d0, d1 = plan.instances
    assert pre.nodes == (0,) and [r.gpu for r in pre.ranks] == list(range(8))
    assert d0.nodes == d1.nodes == (1,)
    assert [r.gpu for r in d0.ranks] == [0, 1, 2, 3]
    assert [r.gpu for r in d1.ranks] == [4, 5, 6, 7]
    # p5: GPU 4 sits on NUMA 1 with rdmap147-150s0 on its PCIe switch
    r = d1.ranks[0]
    assert r.nics == ("rdmap147s0", "rdmap148s0", "rdmap149s0", "rdmap150s0")
    assert (r.nic_kind, r.nic_affinity, r.numa) == ("efa", "switch", 1)
    assert r.cpus == "48-59,144-155"  # a quarter of NUMA 1's cores and their siblings
    assert r.env["FI_EFA_IFACE"] == "rdmap147s0,rdmap148s0,rdmap149s0,rdmap150s0"
    assert r.env["FI_PROVIDER"] == "efa"


def test_p5en_gpu_pairs_share_a_switch():
    plan = build_plan(recipe("deepseek-r1"))
    ranks = plan.instances[0].ranks
    assert ranks[0].nics == ("rdmap85s0", "rdmap86s0")
    assert ranks[1].nics == ("rdmap87s0", "rdmap88s0")
    assert ranks[7].nics == ("rdmap162s0", "rdmap163s0")
    # every NIC used exactly once per node: no two GPUs share an EFA
    used = [n for r in ranks for n in r.nics]
    assert len(used) == len(set(used)) == 16


def test_dgx_uses_compute_nics_with_verbs():
    plan = build_plan(recipe("qwen3-coder-480b"))
    r = plan.instances[0].ranks
    assert [x.nics[0] for x in r] == [
        "mlx5_0",
        "mlx5_3",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_9",
        "mlx5_10",
        "mlx5_11",
    ]
    assert r[4].cpus == "56-69,168-181"
    assert r[0].env["PDTOOL_FI_PROVIDER"] == "verbs;ofi_rxm"
    assert r[5].env["FI_VERBS_DEVICE_NAME"] == "mlx5_9"


def test_multi_node_instances():
    cfg = recipe("deepseek-r1", "prefill.tp=16", "prefill.nodes=2", "cluster.nodes=5")
    plan = build_plan(cfg)
    pre = plan.instances[0]
    assert pre.nodes == (0, 1)
    assert [(r.node, r.node_rank, r.gpu) for r in pre.ranks[6:10]] == [
        (0, 0, 6),
        (0, 0, 7),
        (1, 1, 0),
        (1, 1, 1),
    ]
    assert [i.nodes for i in plan.instances[1:]] == [(2,), (3,), (4,)]
    assert plan.nodes == 5


def test_dp_attention_ranks():
    plan = build_plan(recipe("deepseek-r1-dp-attention"))
    pre = plan.instances[0]
    assert (pre.tp, pre.dp, pre.dp_attention, pre.attn_tp, pre.gpus) == (8, 8, True, 1, 8)
    assert [(r.dp_rank, r.tp_rank) for r in pre.ranks] == [(d, 0) for d in range(8)]
    # GQA with DP attention groups of 2: tp rank cycles inside each group
    cfg = recipe("qwen3-coder-480b", "prefill.dp_attention=true", "prefill.dp=4")
    pre = build_plan(cfg).instances[0]
    assert [(r.dp_rank, r.tp_rank) for r in pre.ranks] == [(d, t) for d in range(4) for t in (0, 1)]


def test_plain_dp_replicas_use_tp_times_dp_gpus():
    cfg = recipe("llama-3.1-70b", "decode.dp=2", "decode.instances=1")
    plan = build_plan(cfg)
    d = plan.instances[1]
    assert d.gpus == 8 and d.attn_tp == 4
    assert [(r.dp_rank, r.tp_rank) for r in d.ranks] == [(g, t) for g in (0, 1) for t in range(4)]


def test_kv_sizes():
    plan = build_plan(recipe("llama-3.1-70b"))
    pre, dec = plan.memory
    # Llama-3.1-70B bf16: 80 layers x (K+V) x 128 dims x 2 bytes per KV head
    assert pre.kv_bytes_per_token == 80 * 2 * 128 * 2 * 1  # 1 head per TP8 rank
    assert dec.kv_bytes_per_token == 80 * 2 * 128 * 2 * 2  # 2 heads per TP4 rank
    assert dec.kv_bytes_per_page == dec.kv_bytes_per_token * 64
    assert dec.kv_bytes_per_token_model == 80 * 2 * 128 * 2 * 8
    r1 = build_plan(recipe("deepseek-r1")).memory[1]
    assert r1.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA latent, bf16, every rank
    assert r1.weights_gb == pytest.approx(671e9 / 8 / 2**30, rel=1e-3)


def _expected(
    tokens: int, page: int, layers: int, per_page: int, aux: int, buffers: int = 1
) -> int:
    return math.ceil((tokens - 1) / page) * layers * buffers * per_page + aux


#: The reference engine's pages follow transfer.layout (K and V fused, one buffer per layer);
#: a byte vocabulary makes the Llama shape one it could run. SGLang recipes keep NHD pools.
REFERENCE = ("engine=reference", "model.vocab_size=256")
#: Metadata writes per request: SGLang 0.5.23 writes one row of each of its 10 MetadataBuffers
#: (transfer.geometry.sglang_metadata_buffers), the reference engine its one hidden state.
SGLANG_AUX = 10


def test_routes_gqa_prefill_tp8_to_decode_tp4():
    plan = build_plan(recipe("llama-3.1-70b", *REFERENCE), tokens=1000)
    t = plan.transfer
    assert (t.layout, t.layout_source, t.buffers_per_layer) == ("HND", "transfer.layout", 1)
    assert t.pages_per_request == math.ceil(999 / 64) == 16
    assert len(t.routes) == 4
    for d, route in enumerate(t.routes):
        assert [s.src_candidates for s in route.slices] == [(2 * d,), (2 * d + 1,)]
        assert [(s.head_lo, s.dst_head_off, s.src_head_off) for s in route.slices] == [
            (2 * d, 0, 0),
            (2 * d + 1, 1, 0),
        ]
        # HND ([pages, 2, heads, page, dim]): a K run and a V run per source slice
        assert [s.writes_per_page for s in route.slices] == [2, 2]
        assert route.writes_per_page == 4
        assert route.writes_per_request == _expected(1000, 64, 80, 4, 1)
    assert "reconstructs its pages from 2 prefill ranks" in t.summary


def test_routes_nhd_counts_per_token_writes():
    plan = build_plan(recipe("llama-3.1-70b", *REFERENCE, "transfer.layout=NHD"), tokens=1000)
    assert plan.transfer.layout == "NHD" and plan.transfer.buffers_per_layer == 1
    route = plan.transfer.routes[0]
    assert [s.writes_per_page for s in route.slices] == [64, 64]
    assert route.writes_per_request == _expected(1000, 64, 80, 128, 1)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sglang_routes_count_its_own_pools(layout):
    """engine=sglang: NHD pages, K and V in separate buffers, whatever transfer.layout says."""
    cfg = recipe("llama-3.1-70b", f"transfer.layout={layout}")
    t = build_plan(cfg, tokens=1000).transfer
    assert (t.layout, t.layout_source, t.buffers_per_layer, t.kv_parts) == (
        "NHD",
        "sglang pools",
        2,
        1,
    )
    assert {i.kv_layout for i in build_plan(cfg).instances} == {"NHD"}
    for route in t.routes:  # each head slice packed into staging: one write per page shard
        assert [s.writes_per_page for s in route.slices] == [1, 1]
        assert route.writes_per_request == _expected(1000, 64, 80, 2, SGLANG_AUX,
                                                     buffers=2)


def test_sglang_plan_and_rule_count_the_same_writes():
    cfg = recipe("llama-3.1-70b")  # engine=sglang, GQA 8 KV heads, prefill TP8 -> decode TP4
    t = build_plan(cfg, tokens=4096).transfer
    # 64 pages x 80 layers x 2 buffers (K, V) x 2 source shards + 10 metadata buffers: the
    # backend packs each page's head slice into staging (before: x 64 tokens, 1,310,730)
    assert {r.writes_per_request for r in t.routes} == {64 * 80 * 2 * 2 + SGLANG_AUX}
    assert not [f for f in validate(cfg) if f.key == "decode.tp"]  # nothing to warn of
    mla = recipe("deepseek-r1")  # one latent buffer per layer, every rank holds it
    t = build_plan(mla, tokens=4096).transfer
    assert (t.layout, t.buffers_per_layer, t.kv_parts) == ("NHD", 1, 1)
    assert {r.writes_per_request for r in t.routes} == {_expected(4096, 64, 61, 1, SGLANG_AUX)}


def test_plan_output_shows_the_layout_written():
    def shown(cfg: Config) -> str:
        con = Console(record=True, width=300)
        print_plan(con, build_plan(cfg), show_ranks=False)
        return con.export_text()

    out = shown(recipe("llama-3.1-70b", "transfer.layout=HND"))
    assert "layout NHD (sglang pools, K and V buffers per layer; transfer.layout does not" in out
    assert "(64 pages x 80 layers x 2 buffers (K, V) + 10 aux)" in out
    assert "20,490" in out  # 64 x 80 x 2 x 2 source shards + 10 (head slices packed)
    out = shown(recipe("deepseek-r1"))
    assert "layout NHD (sglang pools, one buffer per layer;" in out
    out = shown(recipe("llama-3.1-70b", *REFERENCE))
    assert "layout HND, page 64 tokens" in out and "(64 pages x 80 layers + 1 aux)" in out
    data = plan_to_dict(build_plan(recipe("llama-3.1-70b")))  # what plan --json prints
    assert (data["transfer"]["layout"], data["transfer"]["layout_source"]) == (
        "NHD",
        "sglang pools",
    )
    assert data["transfer"]["buffers_per_layer"] == 2


def test_routes_gqa_decode_has_more_shards():
    cfg = recipe("llama-3.1-70b", "prefill.tp=4", "decode.tp=8", "decode.instances=1")
    routes = build_plan(cfg).transfer.routes
    assert len(routes) == 8
    for d, route in enumerate(routes):
        (s,) = route.slices
        assert s.src_candidates == (d // 2,)
        assert (s.head_lo, s.num_heads, s.src_head_off, s.dst_head_off) == (d, 1, d % 2, 0)
    assert {r.writes_per_page for r in routes} == {1}  # engine=sglang packs the slice
    nhd = build_plan(
        recipe(
            "llama-3.1-70b",
            *REFERENCE,
            "prefill.tp=4",
            "decode.tp=8",
            "decode.instances=1",
            "transfer.layout=NHD",
        )
    ).transfer.routes
    assert nhd[0].writes_per_page == 64  # half of a source's heads: one write per token


def test_routes_mla_replica_sets():
    plan = build_plan(recipe("deepseek-r1"), tokens=4096)
    t = plan.transfer
    assert t.prefill.replicated and t.decode.replicated
    assert len(t.routes) == 8
    for route in t.routes:
        (s,) = route.slices
        assert s.src_candidates == tuple(range(8))  # any of the 8 prefill ranks may send
        assert route.writes_per_request == _expected(4096, 64, 61, 1, SGLANG_AUX)
    assert "any of 8 may send" in t.summary
    assert t.kv_parts == 1 and t.head_width == 576


def test_routes_dp_attention_pairs_groups():
    t = build_plan(recipe("deepseek-r1-dp-attention")).transfer
    assert (t.prefill.dp, t.decode.dp, t.prefill.attn_tp) == (8, 8, 1)
    (route,) = t.routes
    assert route.slices[0].src_candidates == (0,)
    assert "one of 8 prefill and one of 8 decode attention groups" in t.summary


@pytest.mark.parametrize(
    ("overrides", "layout", "buffers", "aux"),
    [
        (REFERENCE, "HND", 1, 1),  # the messenger's pages: K and V fused, one buffer per layer
        ((*REFERENCE, "transfer.layout=NHD"), "NHD", 1, 1),
        # engine=sglang: its NHD pools, separate K and V buffers, head slices packed
        ((), G.sglang_pool(False), 2, SGLANG_AUX),
    ],
)
def test_routes_match_transfer_routes_module(overrides, layout, buffers, aux):
    cfg = recipe("llama-3.1-70b", *overrides)
    plan = build_plan(cfg, tokens=777)
    src, dst = R.ShardSpec(8, 8), R.ShardSpec(8, 4)
    for route in plan.transfer.routes:
        slices = R.routes_for(src, dst, route.dst_rank)
        assert route.writes_per_request == G.expected_writes(
            slices,
            src,
            dst,
            layout=layout,
            page_size=64,
            num_pages=R.pages_for(777, 64),
            num_layers=80,
            buffers_per_layer=buffers,
            aux_writes=aux,
        )


@pytest.mark.parametrize(
    "name",
    ["tiny-local", "deepseek-r1", "deepseek-r1-dp-attention", "qwen3-coder-480b", "llama-3.1-70b"],
)
def test_json_round_trip(name):
    plan = build_plan(recipe(name))
    text = to_json(plan)
    data = json.loads(text)
    assert data["version"] == PLAN_VERSION
    assert from_json(text) == plan
    assert plan_from_dict(plan_to_dict(plan)) == plan
    back = plan_from_dict(data)
    assert isinstance(back, Plan)
    assert isinstance(back.instances[0].ranks, tuple)
    assert isinstance(back.instances[0].ranks[0].nics, tuple)


def test_plan_dict_contract_fields():
    """The keys the render/launch/worker side reads: keep them stable."""
    data = plan_to_dict(build_plan(recipe("llama-3.1-70b")))
    assert set(data) >= {
        "version",
        "recipe",
        "launcher",
        "engine",
        "nodes",
        "model",
        "cluster",
        "instances",
        "router",
        "transfer",
        "memory",
    }
    inst = data["instances"][0]
    assert set(inst) >= {
        "role",
        "index",
        "name",
        "tp",
        "dp",
        "dp_attention",
        "nodes",
        "http_port",
        "bootstrap_port",
        "dist_init_port",
        "page_size",
        "ranks",
    }
    rank = inst["ranks"][0]
    assert set(rank) >= {
        "role",
        "instance",
        "rank",
        "dp_rank",
        "tp_rank",
        "node",
        "node_rank",
        "gpu",
        "nics",
        "nic_kind",
        "numa",
        "cpus",
        "env",
    }
    assert set(data["router"]) >= {"node", "port", "prefill", "decode"}
    assert set(data["transfer"]) >= {"provider", "layout", "page_size", "routes", "aux_writes"}


def test_plan_version_mismatch_is_refused():
    data = plan_to_dict(build_plan(compose()))
    data["version"] = 99
    with pytest.raises(ValueError, match="plan version 99"):
        plan_from_dict(data)


def test_rules_use_only_the_plans_public_surface():
    """The validate rules import `pdtool.plan`'s exported names, never its modules' internals."""
    import ast
    from pathlib import Path

    import pdtool.plan as plan_pkg

    rules = Path(__file__).resolve().parents[1] / "pdtool" / "rules"
    for path in sorted(rules.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdtool.plan"):
                assert node.module == "pdtool.plan", (path.name, node.module)
                names = {a.name for a in node.names}
                assert names <= set(plan_pkg.__all__), (path.name, names - set(plan_pkg.__all__))

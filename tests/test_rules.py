"""Each validation rule, with a config that breaks it: the finding names the key to change."""

from __future__ import annotations

import pytest
from helpers.pdtool_cfg import assert_error, assert_warning, compose, findings_for, recipe

from pdtool.compose import load_config
from pdtool.plan import build_plan
from pdtool.rules import validate
from pdtool.schema import NicConfig

# --- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "key", "fragment"),
    [
        ("model.attention", "sparse", "model.attention", "mha | gqa | mla"),
        ("model.dtype", "int3", "model.dtype", "not one of"),
        ("model.num_layers", 0, "model.num_layers", ">= 1"),
        ("model.head_dim", -1, "model.head_dim", ">= 1"),
        ("model.num_params_b", 0.0, "model.num_params_b", "> 0"),
        ("model.expert_params_b", 1.0, "model.expert_params_b", "must lie in"),
        ("prefill.tp", 0, "prefill.tp", ">= 1"),
        ("decode.instances", 0, "decode.instances", ">= 1"),
        ("decode.page_size", 0, "decode.page_size", ">= 1"),
        ("prefill.mem_fraction", 1.5, "prefill.mem_fraction", "(0, 1]"),
        ("decode.kv_dtype", "int4", "decode.kv_dtype", "not one of"),
        ("decode.kv_layout", "HDN", "decode.kv_layout", "not one of"),
        ("transfer.provider", "ucx", "transfer.provider", "efa | verbs;ofi_rxm"),
        ("transfer.layout", "NDH", "transfer.layout", "HND | NHD"),
        ("transfer.timeout_s", 0.0, "transfer.timeout_s", "> 0"),
        ("transfer.lanes", 9, "transfer.lanes", "0 (automatic) to 8"),
        ("launcher.kind", "k8s", "launcher.kind", "local | slurm"),
        ("launcher.job_name", " ", "launcher.job_name", "empty"),
        ("engine.kind", "vllm", "engine.kind", "reference | sglang"),
        ("router.policy", "fastest", "router.policy", "round_robin"),
        ("cluster.device", "tpu", "cluster.device", "cuda | cpu"),
        ("cluster.gpus_per_node", 0, "cluster.gpus_per_node", ">= 1"),
        ("cluster.gpu_memory_gb", 0.0, "cluster.gpu_memory_gb", "> 0"),
    ],
)
def test_value_rules_name_the_key(path, value, key, fragment):
    cfg = compose()
    obj = cfg
    *parents, leaf = path.split(".")
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, leaf, value)
    assert_error(cfg, key, fragment)


def test_expert_params_warning_for_moe_without_expert_count():
    cfg = recipe("qwen3-coder-480b")
    cfg.model.expert_params_b = 0.0
    # everything is then sharded as dense: still fits on H200, but the estimate is flagged
    assert_warning(cfg, "model.expert_params_b", "MoE")




def test_mla_needs_latent_dims_and_one_head():
    cfg = recipe("deepseek-r1")
    cfg.model.kv_lora_rank = 0
    assert_error(cfg, "model.kv_lora_rank", "kv_lora_rank=0")
    cfg = recipe("deepseek-r1")
    cfg.model.num_kv_heads = 128
    assert_error(cfg, "model.num_kv_heads", "one latent head")


def test_mha_kv_heads_equal_q_heads():
    cfg = compose("model.attention=mha")
    assert_error(cfg, "model.num_kv_heads", "num_q_heads=4")


def test_gqa_groups_evenly():
    cfg = compose("model.num_kv_heads=3")
    assert_error(cfg, "model.num_kv_heads", "not a multiple of num_kv_heads=3")


def test_cluster_numa_tables():
    cfg = recipe("deepseek-r1")
    cfg.cluster.gpu_numa = [0, 0, 1]
    assert_error(cfg, "cluster.gpu_numa", "lists 3 GPUs")
    cfg = recipe("deepseek-r1")
    cfg.cluster.numa_cpus = ["0-47", "48-x"]
    assert_error(cfg, "cluster.numa_cpus.1", "not a CPU list")
    cfg = recipe("deepseek-r1")
    cfg.cluster.gpu_numa[7] = 5
    assert_error(cfg, "cluster.gpu_numa.7", "NUMA node 5")


def test_cluster_nic_entries():
    cfg = recipe("deepseek-r1")
    cfg.cluster.nics[3].kind = "infiniband"
    assert_error(cfg, "cluster.nics.3.kind", "not one of")
    cfg = recipe("deepseek-r1")
    cfg.cluster.nics[1].name = cfg.cluster.nics[0].name
    assert_error(cfg, "cluster.nics.1.name", "listed twice")
    cfg = recipe("deepseek-r1")
    cfg.cluster.nics[0].gpus = [9]
    assert_error(cfg, "cluster.nics.0.gpus", "outside 0..7")
    cfg = recipe("deepseek-r1")
    cfg.cluster.nics[0].numa = 4
    assert_error(cfg, "cluster.nics.0.numa", "NUMA node 4")


def test_dp_attention_must_divide_tp():
    cfg = recipe("deepseek-r1-dp-attention", "decode.dp=3")
    assert_error(cfg, "decode.dp", "8 % 3 = 2")


def test_transfer_completion_is_not_a_setting():
    # the messenger counts immediate data and has no remote-counter path: a key that changed
    # nothing is refused by name instead of validated
    for override in ("transfer.completion=counter", "+transfer.completion=cq_data"):
        cfg, found = load_config([override])
        assert cfg is None and [f.key for f in found] == ["transfer.completion"], found


def test_launcher_fields():
    cfg = recipe("deepseek-r1", "launcher.time=4h")
    assert_error(cfg, "launcher.time", "not a Slurm time limit")
    cfg = recipe("deepseek-r1")
    cfg.launcher.sbatch_extra = ["--constraint=h200", "#SBATCH --exclusive"]
    assert_error(cfg, "launcher.sbatch_extra.1", "not an sbatch option")
    cfg = recipe("deepseek-r1", "launcher.container_image=img", "launcher.venv=/v")
    assert_error(cfg, "launcher.venv", "both")
    cfg = recipe("deepseek-r1")
    cfg.launcher.container_mounts = ["/fsx"]
    assert_error(cfg, "launcher.container_mounts.0", "SRC:DST")
    cfg = recipe("deepseek-r1", "+launcher.env.decode.NCCL_DEBUG=INFO")
    assert not validate(cfg)
    cfg.launcher.env.decode["1BAD"] = "x"
    assert_error(cfg, "launcher.env.decode.1BAD", "not a valid environment variable")


# --- shards ---------------------------------------------------------------------------------


def test_heads_not_divisible_by_tp():
    cfg = compose("prefill.tp=3")
    assert_error(cfg, "prefill.tp", "2 KV heads", "attention TP 3")


def test_heads_split_under_dp_attention_names_dp():
    cfg = recipe("qwen3-coder-480b", "decode.dp_attention=true", "decode.dp=1")
    assert not [f for f in validate(cfg) if f.severity == "error"]
    # 8 KV heads over attention TP 8/ 8 = 1 is fine; over TP 24 / 8 = 3 is not
    cfg = recipe("qwen3-coder-480b", "decode.dp_attention=true", "decode.tp=24", "decode.dp=8")
    cfg.decode.nodes = 3
    assert_error(cfg, "decode.dp", "attention TP 3")


def test_prefill_decode_tp_must_divide():
    cfg = compose(
        "model.num_q_heads=48",
        "model.num_kv_heads=24",
        "prefill.tp=6",
        "decode.tp=4",
        "decode.instances=1",
    )
    assert_error(cfg, "decode.tp", "one must divide the other", "6 % 4 = 2")


def test_mla_accepts_any_tp_pair():
    # tp=3 does not divide the tiny model's 4 query heads: an SGLang deployment on GPUs
    cfg = recipe("tiny-local-mla", "prefill.tp=2", "decode.tp=3", "engine=sglang", "model.seed=0",
                 "cluster.device=cuda")
    assert not validate(cfg)


def test_page_size_must_match():
    cfg = compose("decode.page_size=8", "decode.chunked_prefill_size=16")
    f = assert_error(cfg, "decode.page_size", "prefill.page_size=4 != decode.page_size=8")
    assert f.fix == "set decode.page_size=4"


def test_kv_dtype_must_match():
    cfg = compose("decode.kv_dtype=bf16")
    assert_error(cfg, "decode.kv_dtype", "fp32 != decode bf16")


def test_kv_layout_must_match():
    cfg = compose("decode.kv_layout=NHD")
    assert_error(cfg, "decode.kv_layout", "transfer.layout=HND")
    # the role layouts follow transfer.layout by default
    assert not validate(compose("transfer.layout=NHD"))


def test_chunk_must_be_whole_pages():
    cfg = compose("prefill.chunked_prefill_size=18")
    f = assert_error(cfg, "prefill.chunked_prefill_size", "18 % prefill.page_size=4 = 2")
    assert "prefill.chunked_prefill_size=16" in f.fix


def test_nhd_with_tp_mismatch_warns_with_op_count():
    # transfer.layout is the page layout of engines pdtool controls (the reference engine);
    # SGLang keeps its own NHD pools and has its own rule (rules/sglang.py)
    # (a byte vocabulary makes the Llama shape one the reference engine could run)
    # (on CPUs: the reference engine's GPU path reads HND only)
    cfg = recipe("llama-3.1-70b", "transfer.layout=NHD", "engine=reference",
                 "model.vocab_size=256", "cluster.device=cpu")
    f = assert_warning(cfg, "transfer.layout", "prefill attention TP 8 -> decode 4")
    # 64 tokens x 2 source slices per page; 4096 tokens = 64 pages x 80 layers, + 1 aux write
    # HND: 2 source slices x (K run + V run) per page
    assert "128 writes per page and layer (HND: 4)" in f.message
    assert f"costs {64 * 80 * 128 + 1} writes instead of {64 * 80 * 4 + 1}" in f.message
    # equal TP: an NHD page of all local heads is still one write: no warning
    assert not validate(recipe("llama-3.1-70b", "transfer.layout=NHD", "engine=reference",
                               "model.vocab_size=256", "cluster.device=cpu", "decode.tp=8",
                               "decode.instances=1"))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sglang_tp_mismatch_packs_head_slices_without_a_warning(layout):
    # SGLang's NHD pools (separate K and V buffers) apply whatever transfer.layout says (which
    # is why validate refuses NHD there: test_messenger_only_transfer_keys_...); the backend
    # gathers each page's head slice into staging, so TP8 -> TP4 costs one write per
    # (page, buffer, source shard) and validate has nothing to warn of
    cfg = recipe("llama-3.1-70b", f"transfer.layout={layout}")  # GQA 8 heads, TP8 -> TP4
    assert not [f for f in validate(cfg) if f.key == "decode.tp"]
    worst = max(r.writes_per_request for r in build_plan(cfg, tokens=4096).transfer.routes)
    # pages x layers x K,V x source shards + SGLang's 10 metadata buffers (was x 64 tokens)
    assert worst == 64 * 80 * 2 * 2 + 10
    assert not validate(recipe("llama-3.1-70b", "decode.tp=8", "decode.instances=1"))


# --- topology -------------------------------------------------------------------------------


def test_multi_node_instance_must_fill_its_nodes():
    cfg = recipe("deepseek-r1", "prefill.tp=12", "prefill.nodes=2")
    f = assert_error(cfg, "prefill.tp", "12 / 2 = 6 GPUs per node", "2 GPUs idle on each node")
    assert "prefill.tp=16" in f.fix


def test_instance_larger_than_a_node():
    cfg = recipe("deepseek-r1", "decode.tp=16")
    f = assert_error(cfg, "decode.nodes", "needs 16 GPUs")
    assert "decode.nodes=2" in f.fix


def test_instance_gpus_not_spread_evenly():
    cfg = recipe("deepseek-r1", "prefill.tp=16", "prefill.nodes=3")
    assert_error(cfg, "prefill.nodes", "cannot be spread evenly")


def test_idle_gpus_are_reported():
    cfg = recipe("llama-3.1-70b", "decode.instances=3", "cluster.nodes=3")
    f = assert_warning(cfg, "decode.instances", "4 GPUs idle on the last decode node")
    assert "decode.instances=4" in f.fix
    cfg = recipe(
        "tiny-local-mla",
        "launcher=slurm",
        "cluster=p5en",
        "transfer=efa",
        "prefill.tp=3",
        "decode.tp=3",
        "engine=sglang",
        "model.seed=0",
    )
    assert_warning(cfg, "prefill.tp", "2 idle on every prefill node")


def test_nodes_must_fit_the_cluster():
    cfg = recipe("deepseek-r1", "decode.instances=4")
    f = assert_error(cfg, "cluster.nodes", "1 prefill + 4 decode = 5 nodes", "cluster.nodes=4")
    assert "cluster.nodes=5" in f.fix


def test_local_launcher_is_one_machine():
    cfg = compose("decode.instances=8")
    assert_error(cfg, "launcher.kind", "= 9 workers > cluster.gpus_per_node=8")
    cfg = compose("prefill.nodes=2", "prefill.tp=16")
    assert_error(cfg, "prefill.nodes", "launcher=local")


def test_engine_must_suit_device():
    # SGLang's CPU engine serves on this machine (pdtool.engines.sglang.cpu)
    assert not [f for f in validate(compose("engine=sglang")) if f.key == "engine.kind"]
    # the R1 cluster with a model the reference engine runs (and without SGLang's flags)
    tiny = ("engine=reference", "engine.extra_args=[]", "model=tiny", "model.num_q_heads=8",
            "model.num_kv_heads=8", "model.head_dim=64", "prefill.chunked_prefill_size=64")
    cfg = recipe("deepseek-r1", *tiny, "prefill.kv_dtype=fp16", "decode.kv_dtype=fp16")
    assert_warning(cfg, "engine.kind", "FlashInfer decode attention")
    # the tiny model's own head dim (16) is none FlashInfer's decode is built for
    assert_error(recipe("deepseek-r1", *tiny, "model.head_dim=16", "prefill.kv_dtype=fp16",
                        "decode.kv_dtype=fp16"), "model.head_dim", "[64, 128, 256], got 16")
    # what the GPU path cannot read is refused, naming the key
    assert_error(recipe("deepseek-r1", *tiny, "transfer.layout=NHD", "decode.kv_dtype=fp32"),
                 "decode.kv_layout", "HND pages")
    assert_error(recipe("deepseek-r1", *tiny, "decode.kv_dtype=fp32"), "decode.kv_dtype",
                 "fp16 or bf16")


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (("model.vocab_size=300",), "model.vocab_size", "byte-level"),
        (("prefill.dp=2",), "prefill.dp", "dp=1"),
        (("decode.tp=3", "model.num_kv_heads=3", "model.num_q_heads=6"), "decode.tp",
         "must divide model.num_q_heads=6 and model.intermediate_size"),
        (("model.head_dim=15",), "model.head_dim", "even width"),
        (("decode.kv_dtype=fp8_e4m3", "prefill.kv_dtype=fp8_e4m3"), "decode.kv_dtype", "supports"),
        (("model.num_experts=8", "model.expert_params_b=0.0001"), "model.num_experts",
         "dense models"),
    ],
)
def test_reference_engine_limits(overrides, key, fragment):
    """What the reference CPU engine would refuse at start-up is refused by validate first."""
    assert_error(compose(*overrides), key, "engine=reference", fragment)
    # the same deployment on SGLang is not held to the reference engine's limits
    sglang = compose(*overrides, "engine=sglang", "cluster.device=cuda")
    assert not [f for f in validate(sglang) if "engine=reference" in f.message]


def test_provider_needs_nics_of_its_kind():
    cfg = recipe("deepseek-r1", "transfer=tcp")
    f = assert_error(cfg, "transfer.provider", "'tcp;ofi_rxm'", "NIC kinds efa")
    assert "efa" in f.fix
    cfg = recipe("qwen3-coder-480b", "transfer=efa")
    assert_error(cfg, "transfer.provider", "NIC kinds connectx")


def test_shm_only_within_one_node():
    cfg = recipe("deepseek-r1", "transfer=shm")
    assert_error(cfg, "transfer.provider", "shm moves pages within one machine")
    # one p5en box with the local launcher: shm is fine
    cfg = recipe(
        "deepseek-r1-dp-attention",
        "launcher=local",
        "transfer=shm",
        "prefill.dp=4",
        "prefill.tp=4",
        "decode.tp=4",
        "decode.dp=4",
        "decode.instances=1",
        "model=tiny",
        "model.seed=0",
        "prefill.ep=1",  # the recipe's expert parallelism: model=tiny has no experts
        "decode.ep=1",
    )
    assert not [f for f in validate(cfg) if f.severity == "error"]


def test_nic_off_switch_and_off_numa_warn():
    cfg = recipe("deepseek-r1")
    for nic in cfg.cluster.nics:  # GPU 3's EFAs wrongly listed under GPU 2
        nic.gpus = [2 if g == 3 else g for g in nic.gpus]
    f = assert_warning(cfg, "cluster.nics", "GPU 3 has no efa NIC on its PCIe switch")
    assert "same NUMA node 0" in f.message
    cfg = recipe("llama-3.1-70b")
    cfg.cluster.nics = [NicConfig(name="rdmap200s0", kind="efa", numa=1, gpus=[], gbps=100)]
    # a host NIC serves every GPU: fine
    assert not [f for f in validate(cfg) if f.key.startswith("cluster.nics")]
    cfg.cluster.nics = [
        NicConfig(name="rdmap200s0", kind="efa", numa=1, gpus=[7], gbps=100),
    ]
    f = assert_warning(cfg, "cluster.nics", "crosses the socket link")


def test_nic_numa_disagrees_with_its_gpus():
    cfg = recipe("deepseek-r1")
    cfg.cluster.nics[0].numa = 1
    assert_warning(cfg, "cluster.nics.0.numa", "serves GPUs [0] of another NUMA node")


# --- ports ----------------------------------------------------------------------------------


def test_port_collision_on_one_machine():
    cfg = compose("decode.http_port=30000")
    f = assert_error(cfg, "decode.http_port", "both listen on port 30000 on this machine")
    assert "prefill-0 HTTP" in f.message


def test_port_ranges_overlap_through_instance_offsets():
    cfg = compose("prefill.instances=2", "prefill.bootstrap_port=30001")
    # prefill-1's HTTP port (30000 + 1) lands on prefill-0's bootstrap port: both keys named
    assert_error(
        cfg, "prefill.http_port", "port 30001", "prefill.bootstrap_port", "instance i uses base + i"
    )


def test_router_port_collision():
    cfg = compose("router.port=31001")
    assert_error(cfg, "decode.http_port", "router", "31001")


def test_port_out_of_range():
    assert_error(compose("prefill.http_port=80"), "prefill.http_port", "outside 1024..65535")
    assert_error(
        compose("decode.dist_init_port=65535", "decode.instances=2"),
        "decode.dist_init_port",
        "65536",
    )
    # the fix names the range of the key itself: every port derived from it stays in range
    found = [f for f in validate(compose("decode.dist_init_port=65535", "decode.instances=2"))
             if f.key == "decode.dist_init_port"]
    assert found and "1024..65534" in found[0].fix, found
    found = [f for f in validate(compose("router.port=70000")) if f.key == "router.port"]
    assert found and "1024..65535" in found[0].fix and "65471" not in found[0].fix, found


def test_same_ports_on_different_nodes_are_fine():
    cfg = recipe("deepseek-r1", "decode.http_port=30000", "decode.dist_init_port=20000")
    assert not validate(cfg)


# --- memory ---------------------------------------------------------------------------------


def test_weights_do_not_fit():
    cfg = recipe("llama-3.1-70b", "decode.tp=1", "decode.instances=8")
    f = assert_error(cfg, "decode.mem_fraction", "weights need 131.5 GiB per GPU")
    assert "80 = 68.0 GiB" in f.message


def test_moe_weights_shard_experts_over_tp_and_replicate_attention_under_dp():
    dense = recipe("deepseek-r1")
    dpa = recipe("deepseek-r1-dp-attention")
    # experts sharded over 8 GPUs either way; attention/dense replicated per DP group
    from pdtool.memory import role_memory

    a = role_memory("decode", dense.model, dense.cluster, dense.decode)
    b = role_memory("decode", dpa.model, dpa.cluster, dpa.decode)
    assert a.expert_weights_gb == b.expert_weights_gb
    assert b.dense_weights_gb == pytest.approx(a.dense_weights_gb * 8, rel=1e-3)
    # and on 80 GB H100s R1 no longer fits at TP8
    cfg = recipe("deepseek-r1", "cluster=p5")
    assert_error(cfg, "prefill.mem_fraction", "leaves no room for the KV cache")


def test_kv_budget_smaller_than_a_chunk_and_than_a_context():
    cfg = recipe("deepseek-r1", "prefill.mem_fraction=0.56", "decode.mem_fraction=0.56")
    assert_error(cfg, "prefill.mem_fraction", "fewer than one prefill chunk (16384 tokens)")
    cfg = recipe("deepseek-r1", "decode.mem_fraction=0.6")
    assert_warning(cfg, "decode.mem_fraction", "model.context_length=163840")


def test_validate_orders_errors_first_and_stops_on_bad_values():
    cfg = compose("prefill.tp=0")
    cfg.decode.http_port = cfg.prefill.http_port  # would be a port error in a later stage
    found = validate(cfg)
    assert [f.key for f in found] == ["prefill.tp"]


# --- GPU memory ---------------------------------------------------------------------------


def test_gpu_memory_direct_needs_a_provider_with_fi_hmem():
    f = assert_error(recipe("llama-3.1-70b", "transfer=tcp", "transfer.gpu_memory=direct"),
                     "transfer.gpu_memory", "tcp;ofi_rxm cannot register GPU memory", "FI_HMEM")
    assert "staged" in f.fix
    assert not [f for f in validate(recipe("llama-3.1-70b", "transfer.gpu_memory=direct"))
                if f.key == "transfer.gpu_memory"]  # efa may: the worker checks at start-up
    assert_error(recipe("llama-3.1-70b", "transfer.gpu_memory=yes"), "transfer.gpu_memory",
                 "'yes' is not one of auto | direct | staged")


def test_gpu_memory_does_not_apply_to_the_reference_engine():
    assert_error(compose("transfer.gpu_memory=staged"), "transfer.gpu_memory",
                 "reference engine keeps its KV in host memory")
    plan = build_plan(compose()).transfer
    assert (plan.gpu_memory, plan.gpu_memory_path.split(" ")[0]) == ("auto", "host")
    sg = build_plan(recipe("llama-3.1-70b", "transfer=tcp", "transfer.gpu_memory=staged"))
    assert sg.transfer.gpu_memory_path.startswith("transfer.gpu_memory=staged: staged")


# --- engine.version, router.policy -------------------------------------------------------


def test_engine_version_is_the_sglang_release_pdtool_is_written_for():
    assert not [f for f in validate(recipe("deepseek-r1")) if f.key == "engine.version"]
    f = assert_error(recipe("deepseek-r1", "engine.version=0.5.22"), "engine.version",
                     "'0.5.22'", "written for SGLang 0.5.23")
    assert "engine.version=0.5.23" in f.fix
    assert_error(recipe("deepseek-r1", "engine.version="), "engine.version", "''")
    assert_error(compose("engine.version=2.0"), "engine.version", "reference engine")
    assert build_plan(recipe("deepseek-r1")).engine_version == "0.5.23"


def test_router_policy_the_reference_front_does_not_implement_is_refused():
    assert not [f for f in validate(compose()) if f.key == "router.policy"]
    for policy in ("random", "cache_aware", "power_of_two"):
        f = assert_error(compose(f"router.policy={policy}"), "router.policy",
                         "reference engine's front routes round_robin only")
        assert "router.policy=round_robin" in f.fix
        assert not [f for f in validate(recipe("deepseek-r1", f"router.policy={policy}"))
                    if f.key == "router.policy"]  # sglang-router implements them all


def test_gpu_memory_is_pdtools_backend_only():
    f = assert_error(recipe("deepseek-r1", "transfer.backend=nixl", "transfer.gpu_memory=staged"),
                     "transfer.gpu_memory", "transfer.backend=nixl is SGLang's own backend")
    assert "transfer.gpu_memory=auto" in f.fix
    t = build_plan(recipe("deepseek-r1", "transfer.backend=mooncake")).transfer
    assert (t.backend, t.gpu_memory_path.split(" ")[:2]) == ("mooncake", ["SGLang's", "mooncake"])


def test_aggregated_sglang_twin_says_when_roles_carry_phase_flags():
    """mode=aggregated runs both phases on every instance with its role's extra_args: the
    DP-attention recipe's DeepEP modes (normal on prefill, low_latency on decode) are named;
    roles with the same flags, and the disaggregated deployment, get no warning."""
    cfg = recipe("deepseek-r1-dp-attention", "mode=aggregated")
    f = assert_warning(cfg, "mode", "prefill-side instances", "'low_latency'")
    assert "--deepep-mode auto" in f.fix
    assert not [f for f in validate(recipe("deepseek-r1-dp-attention")) if f.key == "mode"]
    assert not [f for f in validate(recipe("deepseek-r1", "mode=aggregated")) if f.key == "mode"]


def test_aggregated_mode_says_which_keys_it_does_not_read():
    """mode=aggregated keeps the disaggregated deployment's transfer.* and bootstrap port (the
    twin of `--compare aggregated`) but runs nothing that reads them: validate says so."""
    f = assert_warning(recipe("deepseek-r1", "mode=aggregated"), "transfer",
                       "nothing reads transfer.*", "prefill.bootstrap_port")
    assert "mode=disaggregated" in f.fix
    assert not [f for f in validate(recipe("deepseek-r1")) if f.key == "transfer"
                and f.severity == "warning" and "mode=aggregated" in f.message]


@pytest.mark.parametrize(("override", "names"), [
    ("transfer.peer_timeout_s=10", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"),
    ("transfer.heartbeat_s=1", "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"),
    ("transfer.lanes=2", "cluster.nics"),
    ("transfer.layout=NHD", "SGLang's own KV pools"),
])
def test_messenger_only_transfer_keys_are_refused_with_sglang(override: str, names: str):
    """engine=sglang keeps SGLang's own timers and a lane per NIC: a messenger key set away
    from its default would change nothing, so validate refuses it and names what to set."""
    key = override.split("=")[0]
    assert_error(recipe("deepseek-r1", override), key, "with engine=sglang nothing reads it",
                 names)
    assert not [f for f in validate(recipe("deepseek-r1")) if f.key == key]
    assert not [f for f in validate(recipe("tiny-local", override)) if f.key == key
                and f.severity == "error"]  # the reference engine's messenger reads it


def test_a_model_seed_is_refused_where_no_weights_are_drawn_from_it():
    """model.seed draws the reference engine's built-in weights; SGLang, and the reference
    engine serving a checkpoint folder, load weights instead and would read nothing."""
    f = assert_error(recipe("llama-3.1-70b", "model.seed=7"), "model.seed",
                     "with engine=sglang nothing reads it")
    assert "--random-seed" in f.fix
    assert not findings_for(recipe("llama-3.1-70b"), "model.seed")
    assert_error(recipe("hf-local", "model.seed=7"), "model.seed", "engine=reference",
                 "checkpoint")
    assert not findings_for(recipe("hf-local"), "model.seed")
    assert not findings_for(recipe("tiny-local", "model.seed=7"), "model.seed")


@pytest.mark.parametrize(("override", "key", "fragment"), [
    ("decode.extra_args=[--enable-mixed-chunk]", "decode.extra_args", "read by nothing"),
    ("engine.extra_args=[--foo]", "engine.extra_args", "read by nothing"),
    ("launcher.container_mounts=[/data:/data]", "launcher.container_mounts",
     "no launcher.container_image"),
    ("launcher.watchdog_s=-1", "launcher.watchdog_s", ">= 0"),
    ("decode.bootstrap_port=9998", "decode.bootstrap_port", "listen on no bootstrap port"),
])
def test_keys_nothing_would_read_are_refused(override: str, key: str, fragment: str):
    """A value validate accepted and nothing then read: flags for SGLang's line on the
    reference engine, container mounts without a container, a negative watchdog period (the
    rendered scripts would take it for a health wait and stop the deployment once ready), a
    decode instance's bootstrap port."""
    assert_error(recipe("tiny-local", override), key, fragment)


def test_builtin_checkpoint_is_refused_where_nothing_loads_it():
    assert_error(compose("+recipe=sglang-local", "model.path=builtin:nope"), "model.path",
                 "not a builtin checkpoint")
    assert_error(compose("+recipe=sglang-local", "engine=reference"), "model.path",
                 "only engine=sglang loads it")


def test_the_head_split_suggests_only_degrees_the_next_check_accepts():
    """prefill.tp=3 on the tiny model (2 KV heads, 4 query heads, MLP 256) suggested 6, which
    the reference engine's own check then refused: the suggestion now divides the query heads
    (and, for the reference engine, the MLP) too."""
    found = [f for f in validate(compose("prefill.tp=3")) if "KV heads" in f.message]
    assert found and found[0].fix == "choose an attention TP in {1, 2, 4}", found
    for tp in (1, 2, 4):
        assert not [f for f in validate(compose(f"prefill.tp={tp}"))
                    if f.severity == "error" and f.key == "prefill.tp"], tp


def test_sglang_hnd_pools_are_refused_for_disaggregation():
    """SGLang 0.5.23 asserts NHD slot rows when a PD server starts with SGLANG_USE_HND_KVCACHE;
    validate names the variable's key instead (aggregated instances transfer nothing)."""
    key = "launcher.env.decode.SGLANG_USE_HND_KVCACHE"
    for value in ("1", "True", "yes"):
        assert_error(recipe("sglang-local", f"+{key}={value}"), key, "HND KV pools")

    def hnd_findings(*overrides: str) -> list:
        return [f for f in validate(recipe("sglang-local", *overrides)) if "HND" in f.key]

    assert not hnd_findings("+launcher.env.all.SGLANG_USE_HND_KVCACHE=0")
    assert not hnd_findings("mode=aggregated", "+launcher.env.all.SGLANG_USE_HND_KVCACHE=1")


def test_launcher_verify_needs_pairs_to_compare():
    """On SGLang the check compares prefill->decode pairs with each other: it needs two, and
    an aggregated deployment has none; the reference engine compares with its model."""
    assert_error(recipe("sglang-local", "launcher.verify=2", "decode.instances=1"),
                 "launcher.verify", "this deployment has 1")
    assert_error(recipe("sglang-local", "launcher.verify=2", "mode=aggregated"),
                 "launcher.verify", "aggregated deployment has none")
    assert_error(recipe("tiny-local", "launcher.verify=-1"), "launcher.verify", "-1 prompts")
    for ok in (recipe("sglang-local", "launcher.verify=2"),
               recipe("tiny-local", "launcher.verify=2", "decode.instances=1")):
        assert not [f for f in validate(ok) if f.key == "launcher.verify"]


def test_the_pairs_outvote_the_damaged_one():
    """Each prompt's reference is the tokens most pairs gave; an even split names both."""
    from pdtool.launch.verify import compare_pairs, pairs, prompts

    outs = {"prefill-0 -> decode-0": [[1, 2, 3], [4, 5]],
            "prefill-0 -> decode-1": [[1, 9, 3], [4, 5]],
            "prefill-0 -> decode-2": [[1, 2, 3], [4, 5]]}
    assert compare_pairs(outs) == [
        "prompt 0 through prefill-0 -> decode-1: differs from the tokens of 2 other pair(s) "
        "at token 1: got [9, 3], want [2, 3]"]
    even = compare_pairs({"a": [[7, 8]], "b": [[7, 6]]})
    assert len(even) == 1 and "split evenly" in even[0] and "at token 1" in even[0]
    texts = prompts(4)
    assert len(set(texts)) == 4 and len({t.split()[0] + t.split()[1] for t in texts}) == 4
    plan = build_plan(recipe("sglang-local"))
    (pre,), dec = plan.router.prefill, plan.router.decode
    assert [(p.name, p.prefill_url, p.decode_url, p.bootstrap_port)
            for p in pairs(plan, ["10.0.0.1"])] == [
        (f"prefill-0 -> decode-{k}", f"http://10.0.0.1:{pre.http_port}",
         f"http://10.0.0.1:{d.http_port}", pre.bootstrap_port) for k, d in enumerate(dec)]
    assert len(dec) == 2

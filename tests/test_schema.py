"""Hydra composition into the typed schema: every option composes; bad input names its key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.pdtool_cfg import compose, option_args

from pdtool.compose import (
    ComposeError,
    config_to_yaml,
    expand_sweeps,
    load_config,
    load_recipe,
    recipe_description,
)
from pdtool.paths import conf_dir
from pdtool.schema import GROUP_SCHEMAS, ClusterConfig, Config, NicConfig, RoleConfig

GROUP_OPTIONS = [
    (group, p.stem) for group in GROUP_SCHEMAS for p in sorted((conf_dir() / group).glob("*.yaml"))
]


def test_every_group_has_options():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert groups == set(GROUP_SCHEMAS)
    names = {f"{g}/{o}" for g, o in GROUP_OPTIONS}
    for must in (
        "cluster/p5",
        "cluster/p5en",
        "cluster/dgx-h100",
        "cluster/dgx-h200",
        "cluster/local",
        "launcher/local",
        "launcher/slurm",
        "engine/reference",
        "engine/sglang",
        "model/deepseek-r1",
        "model/qwen3-coder-480b",
        "model/llama-3.1-70b",
        "model/tiny",
        "model/tiny-mla",
    ):
        assert must in names


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=lambda x: str(x))
def test_each_group_option_composes_typed(group, option):
    cfg, problems = load_config([f"{group}={option}", *option_args(group, option)])
    assert problems == []
    assert isinstance(cfg, Config)
    node = getattr(cfg, group)
    assert isinstance(node, GROUP_SCHEMAS[group])


def test_default_is_the_tiny_local_deployment():
    cfg = compose()
    tiny = compose("+recipe=tiny-local")
    assert cfg.model == tiny.model
    assert (cfg.prefill, cfg.decode, cfg.transfer) == (tiny.prefill, tiny.decode, tiny.transfer)
    assert (cfg.launcher, cfg.engine, cfg.cluster) == (tiny.launcher, tiny.engine, tiny.cluster)
    m = cfg.model
    # what the reference engine builds: a tiny GQA byte-level transformer
    assert (m.attention, m.num_layers, m.hidden_size, m.num_q_heads, m.num_kv_heads) == (
        "gqa",
        4,
        64,
        4,
        2,
    )
    assert (m.head_dim, m.vocab_size, cfg.prefill.page_size) == (16, 256, 4)
    assert cfg.prefill.chunked_prefill_size == 16
    assert (cfg.transfer.provider, cfg.launcher.kind, cfg.engine.kind) == (
        "shm",
        "local",
        "reference",
    )


def test_typed_nested_nodes():
    cfg = compose("cluster=p5en")
    assert isinstance(cfg.cluster, ClusterConfig)
    assert all(isinstance(n, NicConfig) for n in cfg.cluster.nics)
    assert isinstance(cfg.prefill, RoleConfig)
    assert len(cfg.cluster.nics) == 16
    assert cfg.cluster.gpu_memory_gb == 141


def test_short_keys_exist():
    cfg = compose(
        "model.attention=gqa",
        "model.num_layers=8",
        "model.num_kv_heads=2",
        "model.head_dim=32",
        "prefill.tp=2",
        "prefill.dp=1",
        "prefill.instances=1",
        "decode.tp=1",
        "decode.dp=1",
        "decode.instances=1",
        "transfer.provider='tcp;ofi_rxm'",
        "transfer.layout=NHD",
    )
    assert cfg.model.num_layers == 8 and cfg.prefill.tp == 2
    assert cfg.transfer.provider == "tcp;ofi_rxm"


def test_role_layout_follows_transfer_layout():
    cfg = compose("transfer.layout=NHD")
    assert cfg.prefill.kv_layout == cfg.decode.kv_layout == "NHD"


def test_env_per_role_is_added_with_plus():
    cfg = compose("+launcher.env.prefill.NCCL_DEBUG=INFO", "+launcher.env.all.HF_HOME=/hf")
    assert cfg.launcher.env.prefill == {"NCCL_DEBUG": "INFO"}
    assert cfg.launcher.env.all == {"HF_HOME": "/hf"}


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["model.layers=4"], "model.layers", "Could not override"),
        # metadata writes are the engine's (transfer.geometry), not a setting
        (["transfer.aux_writes=1"], "transfer.aux_writes", "Could not override"),
        (["prefill.tp=four"], "prefill.tp", "four"),
        (["prefill.dp_attention=maybe"], "prefill.dp_attention", "maybe"),
        (["cluster.gpu_memory_gb=lots"], "cluster.gpu_memory_gb", "lots"),
        (["+prefill.foo=1"], "prefill.foo", "not a pdtool setting"),
        (["+bar=1"], "bar", "not a pdtool setting"),
        (["+cluster.nics.0.speed=9"], "cluster.nics.0.speed", "not a pdtool setting"),
        # keys no code read are gone: naming one is refused (issue 12; experts_per_token came
        # back with a reader, pdtool size)
        (["model.num_shared_experts=1"], "model.num_shared_experts", "not in 'ModelConfig'"),
        (["model.num_mtp_layers=1"], "model.num_mtp_layers", "not in 'ModelConfig'"),
        (["+recipe=no-such-recipe"], "recipe", "no-such-recipe"),
        (["recipe=tiny-local"], "recipe", "No match in the defaults list"),
        (["+recipe="], "recipe", "empty recipe name"),
        (["model=null"], "model", "must be a string"),
        (["launcher.env.all={A:1}"], "launcher.env.all.A", "not in struct"),
        (["cluster=no-such-cluster"], "cluster", "no-such-cluster"),
        (["model.num_layers=???"], "model.num_layers", "missing mandatory value"),
        (["decode.instances=1,2"], "decode.instances", "Ambiguous value"),
        (["=="], "==", "Error parsing override"),
        (["transfer.provider=tcp;ofi_rxm"], "transfer.provider", "LexerNoViableAlt"),
    ],
)
def test_bad_input_is_a_finding_naming_the_key(overrides, key, fragment):
    cfg, problems = load_config(overrides)
    assert cfg is None
    assert len(problems) >= 1
    f = problems[0]
    assert f.severity == "error"
    assert f.key == key, problems
    assert fragment in f.message, problems
    assert f.fix


def test_sweep_without_multirun_says_so():
    _, problems = load_config(["decode.instances=1,2"])
    assert "-m/--multirun" in problems[0].fix


def test_expand_sweeps_is_a_cartesian_product():
    combos = expand_sweeps(["+recipe=deepseek-r1", "decode.instances=1,2,3", "prefill.tp=4,8"])
    assert len(combos) == 6
    assert combos[0] == ["+recipe=deepseek-r1", "decode.instances=1", "prefill.tp=4"]
    assert ["+recipe=deepseek-r1", "decode.instances=3", "prefill.tp=8"] in combos
    assert expand_sweeps(["decode.instances=range(1,4)"]) == [
        [f"decode.instances={i}"] for i in (1, 2, 3)
    ]
    assert expand_sweeps([]) == [[]]


def test_expand_sweeps_rejects_unsupported_sweeps():
    with pytest.raises(ComposeError) as e:
        expand_sweeps(["decode.instances=interval(1,4)"])
    assert e.value.findings[0].key == "decode.instances"
    with pytest.raises(ComposeError) as e:
        expand_sweeps(["a b c"])
    assert e.value.findings[0].severity == "error"


def test_broken_recipe_file_names_the_file(tmp_path: Path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("description: a: b\n")
    with pytest.raises(ComposeError) as e:
        load_recipe(bad)
    f = e.value.findings[0]
    assert f.key == "recipe=broken"
    assert "not valid YAML" in f.message


def test_recipe_description_sources(tmp_path: Path):
    a = tmp_path / "a.yaml"
    a.write_text('# @package _global_\n# header line\ndescription: "from key"\n')
    b = tmp_path / "b.yaml"
    b.write_text("# @package _global_\n# only a header comment\nrecipe: b\n")
    assert recipe_description(a) == "from key"
    assert recipe_description(b) == "only a header comment"


def test_resolved_config_yaml_round_trips():
    cfg = compose("+recipe=deepseek-r1", "decode.instances=2")
    text = config_to_yaml(cfg)
    data = yaml.safe_load(text)
    assert data["decode"]["instances"] == 2
    assert data["prefill"]["kv_layout"] == "HND"  # resolved, not "${transfer.layout}"
    assert data["cluster"]["nics"][0]["name"] == "rdmap85s0"


@pytest.mark.parametrize(
    ("overrides", "key", "in_fix"),
    [
        (["prefill.tpp=2"], "prefill.tpp", "did you mean prefill.tp?"),
        (["launcher.zzz=1"], "launcher.zzz", "its keys: kind, job_name"),
        (["prefill.tp=two"], "prefill.tp", "prefill.tp takes an int, e.g. prefill.tp=1"),
        (["prefill.tp=2.5"], "prefill.tp", "takes an int"),
        (["transfer.timeout_s=abc"], "transfer.timeout_s", "takes a float"),
        (["prefill.dp_attention=maybe"], "prefill.dp_attention", "takes a bool"),
        (["cluster=locl"], "cluster", "did you mean cluster=local?"),
        (["cluster=p6"], "cluster", "cluster options: dgx-h100, dgx-h200, local, p5, p5en"),
        # the checkpoint recipe without its folder names the folder, not num_layers
        (["+recipe=hf-local"], "model.path", "set model.path=/path/to/checkpoint"),
        (["+recipe=hf-local", "model.path=Qwen/Qwen3-0.6B"], "model.path",
         "hf download Qwen/Qwen3-0.6B --local-dir"),
    ],
)
def test_bad_input_teaches_the_fix(overrides, key, in_fix):
    """A misspelt key gets the closest key of its node; a value of the wrong type the type
    and an example; an unknown group option the options, the closest first."""
    cfg, problems = load_config(overrides)
    assert cfg is None and problems[0].key == key, problems
    assert in_fix in problems[0].fix, problems

"""The rendered SGLang lines against SGLang's own parsers (sglang==0.5.23, sglang-router),
so no flag is misspelt and every value lands in the field the plan meant.

`--disaggregation-transfer-backend pdtool` is accepted once pdtool's plugin has extended SGLang's
choices; here the choice is registered the way the plugin does it (docs/sglang.md, step 1:
`arg_groups.choices.add_disagg_transfer_backend_choices`), without importing the backend.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from helpers.pdtool_cfg import recipe_args

from pdtool.adapters.sglang import CPU_MEM_FRACTION_STATIC
from pdtool.checkpoints import local_path
from pdtool.compose import load_config, recipe_files
from pdtool.launch.health import WATCHDOG_MISSES
from pdtool.launch.shell import resolve
from pdtool.plan import build_plan
from pdtool.render import write_job_folder


def _sglang_recipes() -> list[str]:
    out = []
    for name in sorted(recipe_files()):
        cfg, findings = load_config([f"+recipe={name}", *recipe_args(name)])
        assert cfg is not None, findings
        if cfg.engine.kind == "sglang":
            out.append(name)
    return out


#: every recipe that runs SGLang
SGLANG_RECIPES = _sglang_recipes()
#: extra shapes: a prefill instance spanning two nodes (TP16), plain DP replicas, an explicit
#: KV dtype
SHAPES = {
    "deepseek-r1-tp16": ["+recipe=deepseek-r1", "prefill.tp=16", "prefill.nodes=2"],
    "llama-dp2": ["+recipe=llama-3.1-70b", "decode.tp=2", "decode.dp=2",
                  "decode.kv_dtype=fp8_e4m3"],
    # SGLang's own transfer backends, on the plan's per-GPU NICs
    "deepseek-r1-mooncake": ["+recipe=deepseek-r1", "transfer.backend=mooncake"],
    "qwen3-coder-nixl": ["+recipe=qwen3-coder-480b", "transfer.backend=nixl"],
}


@pytest.fixture(scope="module")
def server_parser() -> argparse.ArgumentParser:
    from sglang.srt.arg_groups import choices
    from sglang.srt.server_args import ServerArgs

    if "pdtool" not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices(["pdtool"])
    # no abbreviations: a rendered flag must be SGLang's full name (`--tp` only parsed as a
    # prefix of `--tp-size`)
    p = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
    ServerArgs.add_cli_args(p)
    return p


@pytest.fixture(scope="module")
def router_parser() -> argparse.ArgumentParser:
    from sglang_router.router_args import RouterArgs

    p = argparse.ArgumentParser(exit_on_error=False)
    RouterArgs.add_cli_args(p)
    return p


def render_slurm(overrides: list[str], out: Path):
    cfg, findings = load_config([*overrides, "launcher=slurm", "cluster.nodes=16"])
    assert cfg is not None, findings
    plan = build_plan(cfg)
    return cfg, plan, write_job_folder(cfg, plan, out)


def variables(nodes: int) -> dict[str, str]:
    v = {"RUN_DIR": "/job", "LOG_DIR": "/job/logs/1"}
    for k in range(nodes):
        v[f"HOSTS[{k}]"] = f"10.0.0.{k + 1}"
        v[f"NODE_NAMES[{k}]"] = f"gpu{k + 1}"
    return v


CASES = [[f"+recipe={r}"] for r in SGLANG_RECIPES] + list(SHAPES.values())


@pytest.mark.parametrize("overrides", CASES, ids=SGLANG_RECIPES + list(SHAPES))
def test_server_lines_parse(overrides, server_parser, tmp_path: Path) -> None:
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_ib_devices_for_gpu,
    )
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.numa_utils import get_numa_node_if_available

    cfg, plan, rendered = render_slurm(overrides, tmp_path)
    hosts = variables(plan.nodes)
    insts = {(i.role, i.index): i for i in plan.instances}
    seen_nodes = set()
    for p in rendered.spec.procs:
        argv = resolve(p.engine_argv, hosts)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        # the worker entry runs exactly this line after `--`
        full = resolve(p.argv, hosts)
        assert full[full.index("--") + 1:] == argv
        a = server_parser.parse_args(argv[3:])
        # no deprecated spelling (SGLang warns and maps them; they go away after 2026-12-31)
        deprecated = {f for act in server_parser._actions for f in act.option_strings
                      if (act.help or "").startswith("Deprecated")}
        assert not deprecated & set(argv), deprecated & set(argv)
        inst = insts[(p.role, p.instance)]
        rc = cfg.prefill if p.role == "prefill" else cfg.decode
        ranks = [r for r in inst.ranks if r.rank in p.ranks]
        assert a.disaggregation_mode == p.role
        assert a.disaggregation_transfer_backend == {"pdtool": "pdtool"}.get(
            cfg.transfer.backend, cfg.transfer.backend)
        assert a.model_path == (local_path(cfg.model.path) or cfg.model.name)
        assert a.tp_size == inst.tp
        assert a.page_size == inst.page_size
        assert a.port == inst.http_port
        assert a.host == hosts[f"HOSTS[{p.node}]"]
        if p.role == "prefill":
            assert a.disaggregation_bootstrap_port == inst.bootstrap_port
        assert not a.enable_dp_attention
        if inst.dp_attention:
            assert (a.attn_dp_size, a.dp_size) == (inst.dp, 1)
        else:
            assert (a.attn_dp_size, a.dp_size) == (1, inst.dp)
        assert a.ep_size == rc.ep
        assert a.max_running_requests == (rc.max_running_requests or None)
        assert a.context_length == cfg.model.context_length
        if cfg.cluster.device == "cpu":
            # SGLang takes the fraction of the machine's free RAM there: the plan's pool
            # reaches it as --max-total-tokens, and the fraction only keeps 10 % aside
            assert a.mem_fraction_static == CPU_MEM_FRACTION_STATIC
            mem = next(m for m in plan.memory if m.role == p.role)
            assert a.max_total_tokens == mem.kv_tokens
        else:
            assert a.mem_fraction_static == rc.mem_fraction
        assert a.kv_cache_dtype == {"auto": "auto", "bf16": "bfloat16"}.get(
            rc.kv_dtype, rc.kv_dtype)
        assert a.trust_remote_code == cfg.model.name.startswith("deepseek")
        if len(inst.nodes) > 1:
            assert a.dist_init_addr == f"{hosts[f'HOSTS[{inst.nodes[0]}]']}:{inst.dist_init_port}"
            assert a.nnodes == len(inst.nodes)
            assert a.node_rank == ranks[0].node_rank
            seen_nodes.add(a.node_rank)
        # one NIC list per GPU of this node, as SGLang's per-GPU JSON map
        ib = json.loads(a.disaggregation_ib_device)
        assert ib == {str(r.gpu): ",".join(r.nics) for r in ranks}
        for r in ranks:  # as SGLang's backends read it for each GPU
            assert get_ib_devices_for_gpu(a.disaggregation_ib_device, r.gpu).replace(
                " ", "") == ",".join(r.nics)
        if cfg.cluster.device != "cuda":
            continue  # --numa-node is rendered for GPUs only
        # SGLang indexes --numa-node by absolute GPU id (numa_utils: numa_node[gpu_id]):
        # one entry per GPU of the node, and each rank's GPU finds its own NUMA node
        assert len(a.numa_node) == cfg.cluster.gpus_per_node
        server_args = ServerArgs.from_cli_args(a)
        for k, r in enumerate(sorted(ranks, key=lambda x: x.gpu)):
            gpu_id = a.base_gpu_id + k * a.gpu_id_step  # the scheduler's gpu_id
            assert gpu_id == r.gpu
            assert get_numa_node_if_available(server_args, gpu_id) == r.numa
    if overrides == SHAPES["deepseek-r1-tp16"]:
        assert seen_nodes == {0, 1}


@pytest.mark.parametrize("recipe", SGLANG_RECIPES)
def test_router_line_parses(recipe, router_parser, tmp_path: Path) -> None:
    from sglang_router.router_args import RouterArgs

    _cfg, plan, rendered = render_slurm([f"+recipe={recipe}"], tmp_path)
    hosts = variables(plan.nodes)
    (router,) = rendered.spec.router
    argv = resolve(router.engine_argv, hosts)
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    a = RouterArgs.from_cli_args(router_parser.parse_args(argv[3:]), use_router_prefix=False)
    assert a.pd_disaggregation
    want_prefill = [(f"http://{hosts[f'HOSTS[{t.node}]']}:{t.http_port}", t.bootstrap_port)
                    for t in plan.router.prefill]
    want_decode = [f"http://{hosts[f'HOSTS[{t.node}]']}:{t.http_port}" for t in plan.router.decode]
    assert a.prefill_urls == want_prefill
    assert a.decode_urls == want_decode
    assert a.port == plan.router.port and a.policy == plan.router.policy
    # its Prometheus exporter beside its port; its workers probed as the watchdog probes
    assert (a.prometheus_port, a.prometheus_host) == (plan.router.port + 1,
                                                      hosts[f"HOSTS[{plan.router.node}]"])
    assert (a.health_check_interval_secs, a.health_failure_threshold,
            a.health_check_timeout_secs) == (math.ceil(_cfg.launcher.watchdog_s),
                                             WATCHDOG_MISSES,
                                             math.ceil(_cfg.launcher.probe_timeout_s))
    assert a.request_timeout_secs == math.ceil(_cfg.router.request_timeout_s)


@pytest.mark.parametrize("recipe", SGLANG_RECIPES)
def test_aggregated_lines_parse(recipe, server_parser, router_parser, tmp_path: Path) -> None:
    """mode=aggregated, the baseline `pdtool bench --compare aggregated` measures against:
    every instance is a plain SGLang server (SGLang's default mode, no --disaggregation-*
    flag) with its role's sharding on its own GPUs, and the router takes them all as regular
    workers."""
    from sglang_router.router_args import RouterArgs

    _cfg, plan, rendered = render_slurm([f"+recipe={recipe}", "mode=aggregated"], tmp_path)
    hosts = variables(plan.nodes)
    insts = {(i.role, i.index): i for i in plan.instances}
    assert {(p.role, p.instance) for p in rendered.spec.procs} == set(insts)
    for p in rendered.spec.procs:
        argv = resolve(p.engine_argv, hosts)
        assert not [f for f in argv if f.startswith("--disaggregation")], argv
        a = server_parser.parse_args(argv[3:])
        inst = insts[(p.role, p.instance)]
        assert a.disaggregation_mode == "null"
        assert (a.tp_size, a.port, a.chunked_prefill_size) == (
            inst.tp, inst.http_port, inst.chunked_prefill_size)
        assert a.base_gpu_id == min(r.gpu for r in inst.ranks if r.rank in p.ranks)
    (router,) = rendered.spec.router
    argv = resolve(router.engine_argv, hosts)
    a = RouterArgs.from_cli_args(router_parser.parse_args(argv[3:]), use_router_prefix=False)
    assert not a.pd_disaggregation and not a.prefill_urls and not a.decode_urls
    assert a.worker_urls == [f"http://{hosts[f'HOSTS[{t.node}]']}:{t.http_port}"
                             for t in (*plan.router.prefill, *plan.router.decode)]
    assert resolve([router.ready], hosts)[0].endswith(f"/workers#regular={len(plan.instances)}")


def test_misspelt_flag_is_caught(server_parser) -> None:
    """The parser really rejects unknown flags (so the tests above prove something)."""
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        server_parser.parse_args(["--model-path", "m", "--disagregation-mode", "prefill"])


def test_fp8_moe_without_expert_parallelism_is_refused() -> None:
    """Qwen3-Coder-480B-FP8 at TP8: 2560/8 = 320 expert columns per GPU, not whole 128-column
    FP8 blocks; the recipe's ep=8 keeps experts whole."""
    from helpers.pdtool_cfg import assert_error, findings_for, recipe

    assert findings_for(recipe("qwen3-coder-480b"), "decode.ep") == []
    f = assert_error(recipe("qwen3-coder-480b", "decode.ep=1"), "decode.ep", "320", "128")
    assert "decode.ep=2" in f.fix
    assert_error(recipe("qwen3-coder-480b", "prefill.ep=3"), "prefill.ep", "divisor")
    assert_error(recipe("llama-3.1-70b", "decode.ep=2"), "decode.ep", "dense model")
    # DeepSeek-R1's 2048 columns split in whole blocks at TP8 without EP
    assert findings_for(recipe("deepseek-r1"), "decode.ep") == []


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_kv_dtype_sglang_has_not_is_refused(dtype: str) -> None:
    from helpers.pdtool_cfg import assert_error, recipe

    assert_error(recipe("llama-3.1-70b", f"prefill.kv_dtype={dtype}", f"decode.kv_dtype={dtype}"),
                 "decode.kv_dtype",
                 "no " + dtype)


DPA_PACKED = ["+recipe=llama-3.1-70b", "decode.dp=2", "decode.dp_attention=true"]


def test_packed_dp_attention_instances_never_share_a_port(tmp_path: Path) -> None:
    """Two DP-attention decoders on one node: SGLang derives +13 and +233..+239 from each one's
    --port, so their bases are spaced until none of those meet (with base + i they did)."""
    from sglang.srt import server_args as sa

    from pdtool import ports

    assert ports.ZMQ_TCP_PORT_DELTA == sa.ZMQ_TCP_PORT_DELTA
    assert ports.DP_ATTENTION_HANDSHAKE_PORT_DELTA == sa.DP_ATTENTION_HANDSHAKE_PORT_DELTA
    cfg, plan, rendered = render_slurm(DPA_PACKED, tmp_path)
    d0, d1 = (i for i in plan.instances if i.role == "decode")
    assert d0.nodes == d1.nodes  # packed
    taken: set[int] = set()
    for inst in (d0, d1):
        mine = {p for p, _, _ in ports.instance_ports(cfg, "decode", inst.index)}
        assert inst.http_port in mine and inst.dist_init_port in mine
        assert {inst.http_port + 13, *range(inst.http_port + 233, inst.http_port + 240)} <= mine
        assert not taken & mine
        taken |= mine
    # the rendered lines use the plan's ports
    hosts = variables(plan.nodes)
    got = {p.name: resolve(p.engine_argv, hosts) for p in rendered.spec.procs}
    for inst in (d0, d1):
        argv = got[f"{inst.name}.n0"]
        assert argv[argv.index("--port") + 1] == str(inst.http_port)
        assert argv[argv.index("--nccl-port") + 1] == str(inst.dist_init_port)


def test_port_overlap_with_a_derived_port_is_refused() -> None:
    """On one machine, decode's HTTP port on prefill's DP-attention dist-init port (+233)."""
    from helpers.pdtool_cfg import assert_error, recipe

    numa = "[" + ",".join(["0"] * 8 + ["1"] * 8) + "]"
    cfg = recipe("llama-3.1-70b", "launcher=local", "cluster.gpus_per_node=16",
                 f"cluster.gpu_numa={numa}", "prefill.dp=2", "prefill.dp_attention=true",
                 "decode.http_port=30233")
    f = assert_error(cfg, "decode.http_port", "30233", "prefill.http_port + 233")
    assert "prefill-0 DP-attention dist-init" in f.message


def test_transfer_backend_is_checked() -> None:
    from helpers.pdtool_cfg import assert_error, recipe

    assert_error(recipe("deepseek-r1", "transfer.backend=ucx"), "transfer.backend", "unknown")
    assert_error(recipe("tiny-local", "transfer.backend=nixl"), "transfer.backend",
                 "reference engine")

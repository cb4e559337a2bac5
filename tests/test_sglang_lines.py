"""The rendered SGLang lines against SGLang's own parsers (sglang==0.5.23, sglang-router),
so no flag is misspelt and every value lands in the field the plan meant.

`--disaggregation-transfer-backend pdtool` is accepted once pdtool's plugin has extended SGLang's
choices; here the choice is registered the way the plugin does it (docs/sglang.md, step 1:
`arg_groups.choices.add_disagg_transfer_backend_choices`), without importing the backend.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdtool.compose import load_config
from pdtool.launch.shell import resolve
from pdtool.planner import build_plan
from pdtool.render import write_job_folder

SGLANG_RECIPES = ["deepseek-r1", "deepseek-r1-dp-attention", "qwen3-coder-480b", "llama-3.1-70b"]
#: extra shapes: a prefill instance spanning two nodes (TP16), DP attention across two nodes
SHAPES = {
    "deepseek-r1-tp16": ["+recipe=deepseek-r1", "prefill.tp=16", "prefill.nodes=2"],
}


@pytest.fixture(scope="module")
def server_parser() -> argparse.ArgumentParser:
    from sglang.srt.arg_groups import choices
    from sglang.srt.server_args import ServerArgs

    if "pdtool" not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices(["pdtool"])
    p = argparse.ArgumentParser(exit_on_error=False)
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
        inst = insts[(p.role, p.instance)]
        ranks = [r for r in inst.ranks if r.rank in p.ranks]
        assert a.disaggregation_mode == p.role
        assert a.disaggregation_transfer_backend == "pdtool"
        assert a.model_path == (cfg.model.path or cfg.model.name)
        assert a.tp_size == inst.tp
        assert a.page_size == inst.page_size
        assert a.port == inst.http_port
        assert a.host == hosts[f"HOSTS[{p.node}]"]
        if p.role == "prefill":
            assert a.disaggregation_bootstrap_port == inst.bootstrap_port
        if inst.dp_attention:
            assert a.dp_size == inst.dp and a.enable_dp_attention
        else:
            assert not a.enable_dp_attention
        if len(inst.nodes) > 1:
            assert a.dist_init_addr == f"{hosts[f'HOSTS[{inst.nodes[0]}]']}:{inst.dist_init_port}"
            assert a.nnodes == len(inst.nodes)
            assert a.node_rank == ranks[0].node_rank
            seen_nodes.add(a.node_rank)
        # one NIC list per GPU of this node, as SGLang's per-GPU JSON map
        ib = json.loads(a.disaggregation_ib_device)
        assert ib == {str(r.gpu): ",".join(r.nics) for r in ranks}
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


def test_misspelt_flag_is_caught(server_parser) -> None:
    """The parser really rejects unknown flags (so the tests above prove something)."""
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        server_parser.parse_args(["--model-path", "m", "--disagregation-mode", "prefill"])

"""Property tests over random configs: validate never raises, every accepted config plans, and
accepted plans keep their invariants (one process per GPU, NIC per rank, unique ports)."""

from __future__ import annotations

import copy
from functools import cache

import pytest
from helpers.pdtool_cfg import compose
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdtool.compose import load_config
from pdtool.plan import build_plan, plan_from_dict, plan_to_dict
from pdtool.rules import has_errors, validate
from pdtool.schema import PROVIDERS, Config

BASES = (
    "tiny-local",
    "tiny-local-mla",
    "deepseek-r1",
    "deepseek-r1-dp-attention",
    "qwen3-coder-480b",
    "llama-3.1-70b",
)
CLUSTERS = ("local", "p5", "p5en", "dgx-h100", "dgx-h200")
MODELS = ("tiny", "tiny-mla", "deepseek-r1", "qwen3-coder-480b", "llama-3.1-70b")


@cache
def _parts() -> dict[str, dict[str, object]]:
    return {
        "cluster": {c: compose(f"cluster={c}").cluster for c in CLUSTERS},
        "model": {m: compose(f"model={m}").model for m in MODELS},
    }


@cache
def _base(name: str) -> Config:
    return compose(f"+recipe={name}")


def _knobs() -> list[tuple[str, object]]:
    """(path, value) mutations: mostly plausible values, some broken ones."""
    out: list[tuple[str, object]] = []
    for r in ("prefill", "decode"):
        out += [(f"{r}.tp", v) for v in (0, 1, 2, 3, 4, 8, 8, 16)]
        out += [(f"{r}.dp", v) for v in (0, 1, 1, 2, 4, 8)]
        out += [(f"{r}.dp_attention", v) for v in (True, False)]
        out += [(f"{r}.nodes", v) for v in (0, 1, 1, 2, 3)]
        out += [(f"{r}.instances", v) for v in (0, 1, 2, 3, 4)]
        out += [(f"{r}.page_size", v) for v in (0, 16, 64)]
        out += [(f"{r}.chunked_prefill_size", v) for v in (18, 4096, 8192)]
        out += [(f"{r}.mem_fraction", v) for v in (-0.1, 0.3, 0.85, 0.95, 1.2)]
        out += [(f"{r}.kv_dtype", v) for v in ("auto", "bf16", "fp8_e4m3", "int4")]
        out += [(f"{r}.kv_layout", v) for v in ("HND", "NHD", "XYZ")]
        out += [(f"{r}.http_port", v) for v in (80, 8000, 30000, 31000)]
        out += [(f"{r}.bootstrap_port", v) for v in (8998, 30001, 70000)]
        out += [(f"{r}.dist_init_port", v) for v in (20000, 31000)]
    out += [("cluster", c) for c in CLUSTERS] + [("model", m) for m in MODELS]
    out += [("model.num_kv_heads", v) for v in (0, 1, 2, 3, 8, 16)]
    out += [("model.attention", v) for v in ("mha", "gqa", "mla", "sparse")]
    out += [("cluster.nodes", v) for v in (0, 1, 2, 4, 8)]
    out += [("transfer.provider", v) for v in (*PROVIDERS, "ucx")]
    out += [("transfer.layout", v) for v in ("HND", "NHD", "HDN")]
    out += [("transfer.lanes", v) for v in (-1, 0, 2, 9)]
    out += [("transfer.gpu_memory", v) for v in ("auto", "direct", "staged", "host")]
    out += [("launcher.kind", v) for v in ("local", "slurm", "pbs")]
    out += [("engine.kind", v) for v in ("reference", "sglang", "vllm")]
    out += [("router.port", v) for v in (8000, 30000, 31001, 99999)]
    return out


KNOBS = _knobs()
config_st = st.fixed_dictionaries(
    {
        "base": st.sampled_from(BASES),
        "mutations": st.lists(st.sampled_from(KNOBS), max_size=4),
        "tokens": st.integers(min_value=1, max_value=200_000),
    }
)


def build(d: dict) -> Config:
    cfg = copy.deepcopy(_base(d["base"]))
    for path, value in d["mutations"]:
        if path in ("cluster", "model"):
            setattr(cfg, path, copy.deepcopy(_parts()[path][value]))
            continue
        obj = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


@pytest.mark.slow
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config_st)
def test_validate_never_raises_and_accepted_configs_plan(d):
    cfg = build(d)
    findings = validate(cfg)  # must not raise, whatever the values
    for f in findings:
        assert f.severity in ("error", "warning") and f.key and f.message
    event("rejected" if has_errors(findings) else "accepted")
    if has_errors(findings):
        return
    plan = build_plan(cfg, tokens=d["tokens"])
    assert plan_from_dict(plan_to_dict(plan)) == plan
    ranks = plan.all_ranks()
    seats = [(r.node, r.gpu) for r in ranks]
    assert len(seats) == len(set(seats)), "two processes on one GPU"
    assert all(0 <= r.gpu < cfg.cluster.gpus_per_node for r in ranks)
    assert all(r.nics for r in ranks), "a rank without a NIC"
    if cfg.launcher.kind == "slurm":
        assert plan.nodes <= cfg.cluster.nodes
    binds = [(0, plan.router.port)]
    for i in plan.instances:
        host = 0 if cfg.launcher.kind == "local" else i.head_node
        binds += [(host, i.http_port), (host, i.dist_init_port)]
        if i.bootstrap_port is not None:
            binds.append((host, i.bootstrap_port))
    assert len(binds) == len(set(binds)), "two sockets on one port"
    assert len(plan.transfer.routes) == plan.transfer.decode.attn_tp
    for route in plan.transfer.routes:
        heads = sum(s.num_heads for s in route.slices)
        assert heads == plan.transfer.decode.heads_per_rank


override_keys = st.sampled_from(
    [
        "prefill.tp",
        "decode.instances",
        "model.attention",
        "transfer.layout",
        "cluster",
        "+recipe",
        "launcher.time",
        "model.nope",
        "+x",
        "~decode",
        "router.port",
    ]
)
override_values = st.one_of(
    st.integers(min_value=-3, max_value=20).map(str),
    st.sampled_from(["p5en", "deepseek-r1", "HND", "x y", "'q'", "${oops}", "[1,2]", "null"]),
    st.text(alphabet="abc=,;:+~$ {}[]'\"", max_size=8),
)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(override_keys, override_values), max_size=3))
def test_load_config_never_raises(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    cfg, problems = load_config(overrides)
    assert (cfg is None) == bool(problems)
    for f in problems:
        assert f.severity == "error" and f.key and f.message
    if cfg is not None:
        validate(cfg)


# -- reliability issue: `pdtool validate` itself over hostile override strings ------------------
raw_override = st.one_of(
    st.tuples(override_keys | st.sampled_from(["decode.tp", "prefill.page_size", "transfer",
                                                "engine", "launcher", "router.host"]),
              st.text(alphabet="abcxyz019.=+~-_,:/\\'\"$ {}[]()\n\t\x00é", max_size=12))
    .map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(alphabet="abc.=+~_-,:'\"$ {}[]\x00", min_size=1, max_size=16),
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(raw_override, max_size=3), st.booleans())
def test_validate_cli_never_crashes_on_hostile_overrides(overrides, multirun):
    """Through the real CLI entry (in-process, PDTOOL_DEBUG=1 so an internal error raises
    instead of being reported): a clear exit code, never an exception."""
    import contextlib
    import io
    import os

    from pdtool.cli import main

    os.environ["PDTOOL_DEBUG"] = "1"
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["validate", *(["-m"] if multirun else []), "+recipe=tiny-local",
                             *overrides])
            except SystemExit as exc:  # argparse usage error (an override like "-x")
                code = exc.code
    finally:
        os.environ.pop("PDTOOL_DEBUG", None)
    assert code in (0, 1, 2), (code, out.getvalue(), err.getvalue())
    assert "Traceback" not in out.getvalue() + err.getvalue()
    if code == 1:
        assert (out.getvalue() + err.getvalue()).strip()  # says why


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.integers(1, 9))
def test_port_stride_is_the_smallest_spacing_whose_instances_never_share_a_port(offs, n):
    from pdtool.ports import stride

    s = stride(tuple((o, "port") for o in offs), n)
    ports = [{s * i + o for o in offs} for i in range(n)]
    assert sum(map(len, ports)) == len(set().union(*ports))  # no two instances meet
    if s > 1:  # and one less would make two of them meet
        tighter = [{(s - 1) * i + o for o in offs} for i in range(n)]
        assert sum(map(len, tighter)) > len(set().union(*tighter))

"""transfer.backend=mooncake|nixl (SGLang 0.5.23's own backends) on the GPU recipes, rendered for
Slurm: each worker line carries its per-GPU NIC map and the environment the backend reads for
the provider (MOONCAKE_PROTOCOL / MC_FORCE_TCP, SGLANG_DISAGGREGATION_NIXL_BACKEND), with
launcher.env still winning; validate names what a TP mismatch costs with each backend."""

from __future__ import annotations

import json

import pytest
from helpers.pdtool_cfg import recipe

from pdtool.launch.backends import backend_env
from pdtool.launch.shell import resolve
from pdtool.launch.spec import build_launch
from pdtool.plan import build_plan
from pdtool.rules import validate

CASES = [  # recipe overrides, backend, the variable it reads and its value
    (("transfer=efa", "cluster=p5"), "mooncake", "MOONCAKE_PROTOCOL", "efa"),
    (("transfer=verbs", "cluster=dgx-h100"), "mooncake", "MOONCAKE_PROTOCOL", "rdma"),
    (("transfer=tcp", "cluster=dgx-h100"), "mooncake", "MC_FORCE_TCP", "1"),
    (("transfer=efa", "cluster=p5"), "nixl", "SGLANG_DISAGGREGATION_NIXL_BACKEND", "LIBFABRIC"),
    (("transfer=verbs", "cluster=dgx-h100"), "nixl", "SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX"),
]


def _workers(cfg):
    spec = build_launch(cfg, build_plan(cfg), "/jobs/x")
    variables = {"RUN_DIR": "/jobs/x", "LOG_DIR": "/jobs/x/logs/1"}
    variables |= {f"HOSTS[{k}]": f"10.0.0.{k}" for k in range(cfg.cluster.nodes)}
    variables |= {f"NODE_NAMES[{k}]": f"n{k}" for k in range(cfg.cluster.nodes)}
    return [(p, resolve(p.argv, variables)) for p in spec.procs]


@pytest.mark.parametrize(("over", "backend", "var", "value"), CASES)
def test_each_backend_gets_its_environment_and_nic_map(over, backend, var, value):
    cfg = recipe("llama-3.1-70b", "launcher=slurm", f"transfer.backend={backend}", *over)
    assert backend_env(cfg) == {var: value}
    for p, argv in _workers(cfg):
        assert f"{var}={value}" in argv[argv.index("env"):argv.index("pdtool.worker")], p.name
        line = argv[argv.index("--") + 1:]
        assert line[line.index("--disaggregation-transfer-backend") + 1] == backend
        if var == "MC_FORCE_TCP":  # TCP: host interfaces, no RDMA device map to render
            assert "--disaggregation-ib-device" not in line
            continue
        ib = json.loads(line[line.index("--disaggregation-ib-device") + 1])
        gpus = [int(g) for g in ib]
        assert len(gpus) == len(p.ranks) and all(ib.values()), ib  # one entry per GPU


@pytest.mark.parametrize("backend", ["pdtool", "mooncake", "nixl"])
def test_sglang_timers_follow_the_transfer_keys(backend):
    """Every backend runs under SGLang's request timers: transfer.timeout_s and
    transfer.connect_timeout_s set them (whole seconds, rounded up), and validate accepts
    both with engine=sglang. Every server's /health answers without a generation (the
    probes must not queue behind a long prompt: launch.backends.LIVENESS)."""
    over = ("transfer.timeout_s=45.5", "transfer.connect_timeout_s=30")
    cfg = recipe("llama-3.1-70b", "launcher=slurm", f"transfer.backend={backend}", *over)
    assert not [f for f in validate(cfg) if f.key.startswith("transfer.")
                and f.severity == "error"]
    for p, argv in _workers(cfg):
        env = argv[argv.index("env"):argv.index("pdtool.worker")]
        assert "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=46" in env, p.name
        assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=30" in env, p.name
        assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0" in env, p.name


def test_launcher_env_overrides_the_backend_default():
    cfg = recipe("llama-3.1-70b", "launcher=slurm", "transfer.backend=nixl", "transfer=efa",
                 "cluster=p5", "+launcher.env.all.SGLANG_DISAGGREGATION_NIXL_BACKEND=UCX")
    for _p, argv in _workers(cfg):
        env = argv[argv.index("env"):argv.index("pdtool.worker")]
        assert "SGLANG_DISAGGREGATION_NIXL_BACKEND=UCX" in env
        assert "SGLANG_DISAGGREGATION_NIXL_BACKEND=LIBFABRIC" not in env


def test_pdtool_backend_gets_none_of_it():
    cfg = recipe("llama-3.1-70b", "launcher=slurm")
    assert cfg.transfer.backend == "pdtool" and backend_env(cfg) == {}
    for _p, argv in _workers(cfg):
        assert not any(a.startswith(("MOONCAKE_", "MC_", "SGLANG_DISAGGREGATION_NIXL"))
                       for a in argv)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_validate_names_the_tp_mismatch_cost(backend):
    """llama-3.1-70b: prefill TP8, decode TP4 (GQA): head slices per token, unless staged."""
    cfg = recipe("llama-3.1-70b", f"transfer.backend={backend}")
    (w,) = [f for f in validate(cfg) if f.key == "transfer.backend"]
    assert w.severity == "warning" and "send_kvcache_slice" in w.message
    assert "SGLANG_DISAGG_STAGING_BUFFER=1" in w.fix
    staged = recipe("llama-3.1-70b", f"transfer.backend={backend}",
                    "+launcher.env.all.SGLANG_DISAGG_STAGING_BUFFER=1")
    (w,) = [f for f in validate(staged) if f.key == "transfer.backend"]
    assert "4096 MB GPU buffer" in w.message
    # MLA: the latent head is on every rank, whole pages whatever the TP
    mla = recipe("deepseek-r1", f"transfer.backend={backend}")
    assert not [f for f in validate(mla) if f.key == "transfer.backend"]

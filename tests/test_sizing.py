"""`pdtool size`: the sizing model's pieces against hand-computed values, calibration round
trips (synthetic, the published fit, and `pdtool bench` results), and every suggested
deployment validating clean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.pdtool_cfg import recipe

from pdtool.compose import load_config
from pdtool.rules import validate
from pdtool.sizing.calibrate import Point, fit, model_value
from pdtool.sizing.hardware import Hardware, for_gpu
from pdtool.sizing.model import (
    Workload,
    _fixed_point_batch,
    _mg1_wait,
    active_params,
    decode_step_seconds,
    deployment,
    parse_lengths,
    predict,
    prefill_seconds,
    sides,
)

#: round constants, so the expected values below are plain arithmetic
HW = Hardware(name="test", peak_tflops={"bf16": 1000.0, "fp8": 2000.0}, hbm_tbps=4.0,
              link_gbps=500.0, prefill_mfu=0.5, decode_mbu=0.5, decode_mfu=0.5,
              prefill_overhead_ms=10.0, step_overhead_ms=2.0, comm_eff=1.0, nic_eff=1.0,
              write_us=0.0, default_nic_gbps=400.0)


def _size(*args: str) -> subprocess.CompletedProcess:
    return run_cli("size", *args)


def test_prefill_is_flops_over_the_instance_plus_its_all_reduces() -> None:
    cfg = recipe("llama-3.1-70b", "prefill.tp=8")  # bf16, 80 layers, hidden 8192, 64 q heads
    side = sides(cfg)["prefill"]
    s, compute = prefill_seconds(cfg, side, HW, 1000, 400.0)
    flops = 2 * 70.6e9 * 1000 + 2 * 80 * 64 * 128 * 1000**2
    assert compute == pytest.approx(flops / (8 * 1000e12 * 0.5))
    # two ring all-reduces per layer of 1000 x 8192 bf16 values over NVLink
    comm = 2 * 80 * 2 * 7 / 8 * 1000 * 8192 * 2 / 500e9
    assert s == pytest.approx(compute + comm + 0.010)


def test_a_decode_step_reads_its_weights_and_kv_or_computes_whichever_is_longer() -> None:
    cfg = recipe("llama-3.1-70b", "decode.tp=4")
    side = sides(cfg)["decode"]
    step = decode_step_seconds(cfg, side, HW, 32, 2048, 400.0)
    weights = 70.6e9 * 2 / 4
    kv = 32 * 2048 * (80 * 2 * 128 * 2 * 2)  # 2 of 8 KV heads per rank, K and V, bf16
    memory = (weights + kv) / (4e12 * 0.5)
    flops = 2 * 70.6e9 * 32 + 4 * 80 * 64 * 128 * 2048 * 32
    assert memory > flops / (4 * 1000e12 * 0.5)
    comm = 2 * 80 * 2 * 3 / 4 * 32 * 8192 * 2 / 500e9
    assert step == pytest.approx(memory + comm + 0.002)


def test_moe_counts_the_top_k_experts_and_their_all_to_all() -> None:
    cfg = recipe("deepseek-r1")
    assert active_params(cfg) == pytest.approx((671 - 653.9 + 653.9 * 8 / 256) * 1e9)
    with pytest.raises(ValueError, match=r"model\.experts_per_token"):
        active_params(recipe("deepseek-r1", "model.experts_per_token=0"))


def test_the_transfer_is_the_plans_bytes_and_writes() -> None:
    cfg = recipe("llama-3.1-70b")
    dep = deployment(cfg, 4096)
    from pdtool.plan import build_plan

    plan = build_plan(cfg, tokens=4096)
    (mem,) = [m for m in plan.memory if m.role == "decode"]
    assert dep.transfer.bytes == 4096 * mem.kv_bytes_per_token_model
    assert dep.transfer.writes == sum(r.writes_per_request for r in plan.transfer.routes)
    assert dep.transfer.streamed
    assert dep.nics["prefill"] == (100.0,) * 4  # p5: 4 EFAs of 100 Gb/s per GPU


def test_queueing_pieces() -> None:
    assert _mg1_wait(1.0, 0.5, 0.25) == pytest.approx(0.25)
    assert _mg1_wait(2.0, 0.5, 0.25) == float("inf")
    # B = 10/s x 10 steps x (10 ms + 1 ms x B)  ->  B = 1 + 0.1 B
    assert _fixed_point_batch(10, 10, lambda b: 0.01 + 0.001 * b, 1e6) == pytest.approx(10 / 9)
    assert _fixed_point_batch(10, 10, lambda b: 0.01 + 0.001 * b, 1.0) is None
    assert parse_lengths("512-1536", "--isl")[0] == (576, 0.125)
    with pytest.raises(ValueError, match="--isl"):
        parse_lengths("many", "--isl")


def test_load_raises_ttft_and_tpot_until_the_deployment_saturates() -> None:
    dep = deployment(recipe("llama-3.1-70b"), 2048)
    wl = Workload(isl=((2048, 1.0),), osl=256)
    hw = for_gpu("H100-80GB")
    low, high = predict(dep, wl, hw, 0.1), predict(dep, wl, hw, 5.0)
    assert low.feasible and high.feasible
    assert low.ttft_ms < high.ttft_ms and low.tpot_ms < high.tpot_ms
    assert not predict(dep, wl, hw, 1e4).feasible


@pytest.mark.slow
def test_a_fit_recovers_the_constants_that_made_the_measurements() -> None:
    truth = HW.with_fit(prefill_overhead_ms=30.0, step_overhead_ms=7.0)
    dep = deployment(recipe("llama-3.1-70b"), 1024)
    points = [Point(f"{k}@{c}", dep, Workload(isl=((1024, 1.0),), osl=64), k, 1.0,
                    concurrency=c) for c in (1, 8) for k in ("ttft_ms", "tpot_ms")]
    points = [Point(p.name, p.dep, p.workload, p.kind, model_value(p, truth),
                    concurrency=p.concurrency) for p in points]
    fitted, err = fit(points, HW, ["prefill_overhead_ms", "step_overhead_ms"])
    assert err < 1e-6
    assert fitted.prefill_overhead_ms == pytest.approx(30.0, rel=1e-2)
    assert fitted.step_overhead_ms == pytest.approx(7.0, rel=1e-2)


def test_the_stored_h100_constants_are_the_fit_of_the_published_points() -> None:
    res = _size("--published", "--refit", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    hw = for_gpu("H100-80GB")
    assert set(doc["fit"]["fitted"]) == {"prefill_mfu", "comm_eff"}
    for name, value in doc["fit"]["fitted"].items():
        assert getattr(hw, name) == pytest.approx(value, rel=1e-3), name
    errors = {r["point"]: r["error"] for r in doc["points"]}
    assert abs(errors["deepseek-h800-decode"]) < 0.25  # an independent source, within 25 %


@pytest.mark.slow
def test_every_suggestion_validates_clean() -> None:
    for args in (["+recipe=llama-3.1-70b", "decode.tp=8", "--gpus", "24"],
                 ["+recipe=deepseek-r1", "--isl", "1000-3000", "--osl", "500",
                  "--slo", "ttft_ms=3000,tpot_ms=100"]):
        res = _size(*args, "--json")
        assert res.returncode == 0, res.stderr
        found = json.loads(res.stdout)["deployments"]
        assert found, args
        assert any(d["aggregated"] for d in found) and not all(d["aggregated"] for d in found)
        for d in found:
            cfg, findings = load_config(d["overrides"])
            assert cfg is not None, findings
            errors = [f for f in [*findings, *validate(cfg)] if f.severity == "error"]
            assert errors == [], d["overrides"]
            assert d["ttft_ms"] <= 3000 and d["tokens_per_s_gpu"] > 0


def test_a_rate_asks_for_the_fewest_gpus_and_a_plot_is_drawn(tmp_path: Path) -> None:
    png = tmp_path / "size.png"
    res = _size("+recipe=llama-3.1-70b", "--rate", "4", "--gpus", "32", "--json", "--plot",
                str(png))
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)["deployments"]
    gpus = [d["gpus"] for d in found if not d["aggregated"]]
    assert gpus == sorted(gpus) and all(d["rate"] == 4 for d in found)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_named() -> None:
    res = _size("+recipe=llama-3.1-70b", "--slo", "ttft=3")
    assert res.returncode == 2 and "--slo: 'ttft' is not ttft_ms or tpot_ms" in res.stderr
    res = _size("+recipe=deepseek-r1", "model.experts_per_token=0")
    assert res.returncode == 2 and "model.experts_per_token" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_calibration_from_a_bench_run_on_this_machine(tmp_path: Path) -> None:
    """`pdtool bench` on tiny-local at two loads, then `pdtool size --calibrate` on its
    results.json: the fit lowers the model's error on those points, and the entry it writes
    is one `--hardware` reads."""
    out = tmp_path / "bench"
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "bench", "+recipe=tiny-local", "--launch",
         "--concurrency", "1,4", "--requests", "12", "--isl", "64", "--osl", "16",
         "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    written = tmp_path / "cpu.yaml"
    res = _size("--calibrate", str(out / "results.json"), "--write", str(written), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["hardware"] == "cpu" and len(doc["points"]) == 4
    import math

    before = sum(math.log(p["before"] / p["measured"]) ** 2 for p in doc["points"])
    assert doc["error"] <= before
    hw = for_gpu("cpu", written)
    assert hw.step_overhead_ms == pytest.approx(doc["fitted"]["step_overhead_ms"])
    assert "fitted:" in hw.sources["step_overhead_ms"]

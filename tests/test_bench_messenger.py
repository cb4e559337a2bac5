"""The messenger benchmarks in bench/ run their whole code path on tiny sizes (no timing
assertions: the figures of a shared 2-core box say nothing here), and print what they promise:
every figure with its baseline from the same run, or the reason it was left out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, timeout: float = 240) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the checkout's packages, as a script run from it sees them
    res = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--json"],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_transfer_bench_reports_the_two_thread_copy_and_the_targets() -> None:
    out = _run("transfer.py", "--systems", "copy,copy2,fabric,messenger", "--gib", "0.01",
               "--region-mib", "8", "--rounds", "1", "--page-kib", "64")
    assert not out.get("not_measured"), out["not_measured"]
    for system in ("copy", "copy2"):
        assert set(out[system]) == {"memcpy/64KiB"}
    assert set(out["messenger"]) == {"shm/64KiB", "tcp;ofi_rxm/64KiB"}
    assert all(v > 0 for row in ("copy2", "fabric", "messenger") for v in out[row].values())
    whats = {t["what"] for t in out["targets"]}
    assert {"messenger shm 64KiB / two-thread copy", "messenger tcp;ofi_rxm 64KiB / raw binding",
            "messenger shm 64KiB CPU s/GiB / two-thread copy's"} <= whats
    assert "copy2/memcpy/64KiB" in out["cpu_s_per_gib"]


def test_transfer_bench_pairs_each_round_with_its_baseline() -> None:
    """A ratio is the median of each round's figure over the same round's baseline: with the
    machine twice as fast in one round, best-of-rounds would compare two phases of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_transfer", ROOT / "bench" / "transfer.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    res = mod.Results()
    for raw, messenger in ((4.0, 3.6), (8.0, 7.6), (4.2, 4.6)):  # the middle round: a fast phase
        res.add("fabric", "tcp;ofi_rxm/64KiB", raw)
        res.add("messenger", "tcp;ofi_rxm/64KiB", messenger)
    r = res.ratio(("messenger", "tcp;ofi_rxm/64KiB"), ("fabric", "tcp;ofi_rxm/64KiB"))
    assert r == pytest.approx(0.95)  # median of 0.9, 0.95, 1.095 (best-of: 7.6 / 8.0)
    assert res.gbps["messenger"]["tcp;ofi_rxm/64KiB"] == 4.6
    for mooncake in (1.0, 3.0, 1.2):
        res.add("mooncake", "tcp/64KiB", mooncake)
    raw, mooncake = mod.targets(res, [64 * 1024])
    assert (raw["what"], raw["met"]) == ("messenger tcp;ofi_rxm 64KiB / raw binding", False)
    assert (mooncake["what"], mooncake["met"]) == ("messenger tcp;ofi_rxm 64KiB / Mooncake-TCP",
                                                   True)
    assert mooncake["value"] == pytest.approx(3.6)  # median of 3.6, 2.53, 3.83
    assert res.ratio(("messenger", "shm/64KiB"), ("copy2", "memcpy/64KiB")) is None


@pytest.mark.slow
def test_latency_bench_measures_messenger_and_raw_baselines() -> None:
    out = _run("messenger_latency.py", "--providers", "shm,tcp;ofi_rxm", "--requests", "5",
               "--pings", "20", "--rate-pages", "64", "--rma-iters", "200", "--rounds", "1")
    missing = {k: v for k, v in out["not_measured"].items() if not k.startswith("fi_rma_bw")}
    assert not missing, missing
    for prov in ("shm", "tcp;ofi_rxm"):
        c = out["providers"][prov]
        for key in ("messenger_latency_p50_us", "messenger_latency_p99_us",
                    "pingpong_rtt_p50_us", "pingpong_rtt_p99_us", "raw_ops_per_s",
                    "messenger_ops_per_s", "messenger_writes_per_s"):
            assert c[key] > 0, (prov, key, c)
        # fabtests' figure, or the reason it is missing (not installed, or it failed)
        assert "rma_bw_ops_per_s" in c or any(k.startswith("fi_rma_bw")
                                              for k in out["not_measured"])


@pytest.mark.slow
def test_scale_bench_tables() -> None:
    out = _run("messenger_scale.py", "--inflight", "1,8", "--decoders", "1,2", "--requests",
               "2", "--pages", "1", "--nodes", "1,4", "--repeat", "1", "--page-kib", "4")
    assert [r["inflight"] for r in out["inflight"]] == [1, 8]
    assert all(r["check_us"] >= 0 and r["per_request_us"] > 0 for r in out["inflight"])
    assert [(r["decoders"], r["requests"]) for r in out["decoders"]] == [(1, 2), (2, 4)]
    assert [r["nodes"] for r in out["plan"]] == [1, 4]
    assert out["plan"][1]["recipe"] == "deepseek-r1"


@pytest.mark.slow
def test_idle_penalty_times_each_work_after_each_gap() -> None:
    out = _run("idle_penalty.py", "--gaps-ms", "0", "1", "--runs", "3")
    assert out["gaps_ms"] == [0, 1]
    assert set(out["median_us"]) == {"messenger's request checks", "first decode step"}
    assert all(len(row) == 2 and all(v > 0 for v in row) for row in out["median_us"].values())

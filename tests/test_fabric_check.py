"""The fabric check of preflight runs: which NIC pairs are measured (from the plan's routes),
the probe's counts, the floor, and real preflight runs over shm and tcp;ofi_rxm that record
their figures and stop, naming the pair and the key, when a pair is under the floor. The
emulated Slurm cluster's preflight (tests/test_slurm_launch.py) measures across its nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.pdtool_cfg import assert_error, recipe

from pdtool import fabric_check
from pdtool.fabric_check import RankId, floor_gbps, sources_by_target
from pdtool.plan import build_plan
from pdtool.worker import parse_args, resolve
from transfer.probe import ProbeSource, ProbeTarget, expected_writes, rail_pairs, writes_per_pair


def _names(sources: list[RankId]) -> list[str]:
    return [str(s) for s in sources]


def test_each_decode_rank_is_probed_by_the_prefill_ranks_that_hold_its_heads() -> None:
    # GQA, 8 KV heads: prefill TP8 holds one head per rank, decode TP4 two per rank
    pairs = sources_by_target(build_plan(recipe("llama-3.1-70b")))
    assert len(pairs) == 8  # two decode instances of four ranks
    assert _names(pairs[RankId("decode-1", 3)]) == ["prefill-0 rank 6", "prefill-0 rank 7"]
    # MLA: the latent is on every prefill rank, any of which may send
    pairs = sources_by_target(build_plan(recipe("deepseek-r1")))
    assert len(pairs) == 24
    assert all(_names(s) == [f"prefill-0 rank {r}" for r in range(8)] for s in pairs.values())
    # the decode side wider than the prefill: each prefill rank feeds two decode ranks
    pairs = sources_by_target(build_plan(recipe("tiny-local", "decode.tp=2",
                                                "decode.instances=1")))
    assert {str(k): _names(v) for k, v in pairs.items()} == {
        "decode-0 rank 0": ["prefill-0 rank 0"], "decode-0 rank 1": ["prefill-0 rank 0"]}
    assert sources_by_target(build_plan(recipe("tiny-local", "mode=aggregated"))) == {}


def test_nic_pairs_cover_every_nic_on_both_sides_and_the_counts_agree() -> None:
    assert rail_pairs(4, 4) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert rail_pairs(2, 4) == [(0, 0), (1, 1), (0, 2), (1, 3)]
    assert rail_pairs(1, 2) == [(0, 0), (0, 1)]
    assert writes_per_pair(256 << 20) == 64 + 1  # 4 MiB writes, after one untimed
    # two sources of 2 and 4 NICs into a target of 4 NICs: 4 pairs each
    assert expected_writes([2, 4], 4, 8 << 20) == 8 * 3


def test_the_floor_is_the_key_or_a_quarter_of_the_slower_link() -> None:
    plan = build_plan(recipe("llama-3.1-70b"))
    nic = next(iter(plan.transfer.nic_gbps))
    assert plan.transfer.nic_gbps[nic] == 100
    assert floor_gbps(plan, nic, nic) == 25.0
    assert floor_gbps(plan, nic, "unknown") == 0.0  # no link speed: report only
    plan = build_plan(recipe("llama-3.1-70b", "transfer.preflight_min_gbps=40"))
    assert floor_gbps(plan, nic, nic) == 40.0


def test_fabric_check_keys_are_checked() -> None:
    assert_error(recipe("tiny-local", "transfer.preflight_mib=-1"), "transfer.preflight_mib",
                 "0 (none) to 4096")
    assert_error(recipe("tiny-local", "transfer.preflight_min_gbps=-2"),
                 "transfer.preflight_min_gbps", "must be -1")


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_the_probe_lands_every_write_in_the_targets_slot(provider: str) -> None:
    nics, ip = ((), None) if provider == "shm" else (("lo",), "127.0.0.1")
    nbytes = 8 << 20
    target = ProbeTarget(provider, nics, ip, nbytes, sources=2)
    source = ProbeSource(provider, nics, ip, nbytes)
    try:
        for slot in (0, 1):
            (pair,) = source.probe(json.loads(json.dumps(target.descriptor())), slot, 30.0)
            assert pair.nbytes == nbytes and pair.gbps > 0
        assert target.wait(expected_writes([1, 1], 1, nbytes), 30.0)
        assert target.rails.primary.recv_counts[:2].tolist() == [writes_per_pair(nbytes)] * 2
    finally:
        source.close()
        target.close()


def _preflight(tmp_path: Path, *over: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local",
         "transfer.preflight_mib=32", *over, "--preflight", "--exit-when-healthy", "--out",
         str(tmp_path / "job")], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["shm", "tcp"])
def test_a_preflight_run_measures_every_pair_and_records_it(transfer: str,
                                                            tmp_path: Path) -> None:
    res = _preflight(tmp_path, f"transfer={transfer}")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = fabric_check.results(tmp_path / "job")
    nic = "shm" if transfer == "shm" else "lo"
    assert sorted((r["src"], r["src_nic"], r["dst"], r["dst_nic"]) for r in rows) == [
        ("prefill-0 rank 0", nic, f"decode-{d} rank 0", nic) for d in (0, 1)]
    assert all(r["gbps"] > 0 and r["mib"] == 32 for r in rows)
    for r in rows:  # the launch says it too
        assert f"fabric check: {r['src']} ({nic}) -> {r['dst']} ({nic}):" in res.stdout
    if transfer == "shm":  # `pdtool size --fabric` sizes with the fabric as measured
        from statistics import median

        from pdtool.commands.size import _with_fabric
        from pdtool.sizing.hardware import for_gpu

        hw = _with_fabric(for_gpu("cpu"), tmp_path / "job")  # shm: no line rate to share
        assert hw.default_nic_gbps == median(r["gbps"] for r in rows) and hw.nic_eff == 1.0
        sized = subprocess.run([sys.executable, "-m", "pdtool.cli", "size", "+recipe=tiny-local",
                                "--isl", "64", "--osl", "16", "--fabric", str(tmp_path / "job"),
                                "--json"], capture_output=True, text=True, timeout=120)
        assert sized.returncode == 0 and json.loads(sized.stdout)["deployments"], sized.stderr
    # a second run measures afresh (the folder is cleared when a preflight starts)
    stale = tmp_path / "job" / fabric_check.FOLDER / "results" / "prefill-9.r0.json"
    stale.write_text("[]")
    assert _preflight(tmp_path, f"transfer={transfer}").returncode == 0
    assert not stale.exists()


@pytest.mark.slow
def test_a_pair_under_the_floor_stops_the_preflight_naming_it(tmp_path: Path) -> None:
    res = _preflight(tmp_path, "transfer=tcp", "transfer.preflight_min_gbps=100000")
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert ("transfer.preflight_min_gbps: prefill-0 rank 0 (lo) -> decode-0 rank 0 (lo) "
            "moved ") in out and "under the floor of 100000 Gbit/s" in out
    assert "Traceback" not in out
    # what was measured is kept for the user, and `pdtool plan --fabric` shows it
    assert len(fabric_check.results(tmp_path / "job")) == 2
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "plan", "+recipe=tiny-local", "transfer=tcp",
         "transfer.preflight_min_gbps=100000", "--no-ranks", "--fabric", str(tmp_path / "job")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert "floor 100000 Gbit/s (transfer.preflight_min_gbps)" in res.stdout
    assert res.stdout.count("SLOW") == 2 and "decode-1 rank 0" in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "plan", "+recipe=tiny-local", "--json", "--fabric",
         str(tmp_path / "job")], capture_output=True, text=True, timeout=60)
    assert json.loads(res.stdout)["fabric_check"] == fabric_check.results(tmp_path / "job")
    res = subprocess.run([sys.executable, "-m", "pdtool.cli", "plan", "+recipe=tiny-local",
                          "--fabric", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "holds no fabric check results" in res.stderr
    # and a prefill worker started again (as the supervisor restarts one) does not measure
    # again, and is stopped by the slow pair it recorded
    ctx = resolve(parse_args(["--plan", str(tmp_path / "job" / "plan.json"), "--role",
                              "prefill", "--instance", "0", "--rank", "0",
                              "--host", "127.0.0.1"]))
    said: list[str] = []
    with pytest.raises(fabric_check.FabricCheckError, match="under the floor of 100000"):
        fabric_check.run(ctx, said.append)
    assert said == []  # nothing was written


@pytest.mark.slow
def test_no_fabric_check_when_the_key_is_zero(tmp_path: Path) -> None:
    res = _preflight(tmp_path, "transfer.preflight_mib=0")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (tmp_path / "job" / fabric_check.FOLDER).exists()
    assert "fabric check" not in res.stdout

"""Time budgets (pdtool.budgets): each limit against the timers that must fit in it, refused
by validate naming the keys, and printed by `pdtool validate`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.pdtool_cfg import compose

from pdtool.budgets import (
    bench_timeout_s,
    budgets,
    in_job_bench_timeout_s,
    slurm_seconds,
    stop_lead_s,
)
from pdtool.rules import validate


@pytest.mark.parametrize(("limit", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("04:00:00", 14400), ("1-00", 86400),
    ("1-02:30", 95400), ("2-00:00:10", 172810), ("infinite", None), ("UNLIMITED", None),
])
def test_slurm_time_limits_in_seconds(limit, seconds):
    """sbatch(1) --time's formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    assert slurm_seconds(limit) == seconds


def _errors(cfg, key):
    return [f for f in validate(cfg) if f.severity == "error" and f.key == key]


def test_the_router_must_outwait_the_engines_transfer_timers():
    """SGLang waits on a request's KV for its bootstrap timer and then its waiting timer
    (transfer.connect_timeout_s + transfer.timeout_s); the reference engine connects at
    start, so only transfer.timeout_s counts per request."""
    over = ("router.request_timeout_s=100", "transfer.connect_timeout_s=60",
            "transfer.timeout_s=60")
    (err,) = _errors(compose("+recipe=sglang-local", *over), "router.request_timeout_s")
    assert "transfer.connect_timeout_s 60 s + transfer.timeout_s 60 s = 120 s" in err.message
    assert "router.request_timeout_s" in err.fix
    assert not _errors(compose("+recipe=tiny-local", *over), "router.request_timeout_s")
    # nothing moves between aggregated instances
    assert not _errors(compose("+recipe=sglang-local", *over, "mode=aggregated"),
                       "router.request_timeout_s")


def test_the_in_job_benchmark_client_must_outwait_the_transfer():
    bench = ('launcher.benchmark=[--timeout,"100",--requests,"4"]',)
    cfg = compose("+recipe=sglang-local", "launcher=slurm", *bench)
    assert bench_timeout_s(list(cfg.launcher.benchmark)) == 100
    (err,) = _errors(cfg, "launcher.benchmark")
    assert "--timeout" in err.message and "transfer.connect_timeout_s" in err.message
    # without --timeout the job picks one that outlasts the transfer timers: the bench
    # default 300 s for 120 + 60 s; 600 s for a DeepSeek recipe's 300 + 300 s
    cfg = compose("+recipe=sglang-local", "launcher=slurm", 'launcher.benchmark=[--requests,"4"]')
    assert bench_timeout_s(list(cfg.launcher.benchmark)) is None
    assert in_job_bench_timeout_s(cfg) == 300 and not _errors(cfg, "launcher.benchmark")
    cfg = compose("+recipe=deepseek-r1", 'launcher.benchmark=[--requests,"4"]')
    assert in_job_bench_timeout_s(cfg) == 600 and not _errors(cfg, "launcher.benchmark")


def test_a_slurm_time_limit_holds_the_health_wait_and_the_stop():
    cfg = compose("+recipe=llama-3.1-70b", "launcher.time=00:20:00",
                  "launcher.health_timeout_s=1800")
    (err,) = _errors(cfg, "launcher.time")  # said once, though the restarts' budget fails too
    assert err.message.startswith("the job's start: 20 min")
    assert "launcher.health_timeout_s 30 min" in err.message
    assert f"{stop_lead_s(cfg.launcher.stop_grace_s)} s" in err.message
    assert not _errors(compose("+recipe=llama-3.1-70b", "launcher.time=infinite"),
                       "launcher.time")


def test_restart_back_offs_that_outlast_the_job_are_refused():
    """5 s doubled over 8 restarts is 1275 s (21 min) of back-off alone:
    launcher.max_restarts=8 could never be reached in 20 minutes beside a 10 minute health
    wait."""
    over = ("launcher.time=00:20:00", "launcher.health_timeout_s=600")
    assert not _errors(compose("+recipe=llama-3.1-70b", *over), "launcher.time")
    cfg = compose("+recipe=llama-3.1-70b", *over, "launcher.max_restarts=8")
    (err,) = _errors(cfg, "launcher.time")
    assert err.message.startswith("restart back-offs")
    assert "launcher.restart_backoff_s x (2^8 - 1) 21 min" in err.message
    # never restarting, or running locally (no time limit), has no such budget
    assert not _errors(compose("+recipe=llama-3.1-70b", *over, "launcher.max_restarts=8",
                               "launcher.restart=never"), "launcher.time")
    assert not [b for b in budgets(compose("+recipe=tiny-local", "launcher.max_restarts=8"))
                if b.key == "launcher.time"]


def test_a_probe_must_end_before_the_next_is_due():
    (err,) = _errors(compose("+recipe=tiny-local", "launcher.watchdog_s=2"),
                     "launcher.watchdog_s")
    assert "launcher.probe_timeout_s 5 s" in err.message
    assert not _errors(compose("+recipe=tiny-local", "launcher.watchdog_s=2",
                               "launcher.probe_timeout_s=2"), "launcher.watchdog_s")
    assert not _errors(compose("+recipe=tiny-local", "launcher.watchdog_s=0"),
                       "launcher.watchdog_s")


def test_validate_prints_the_budget_table():
    argv = [sys.executable, "-m", "pdtool.cli", "validate", "+recipe=llama-3.1-70b"]
    text = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    for name in ("a request waiting on its KV", "the job's start", "restart back-offs",
                 "one watchdog probe"):
        assert f"budget  {name}: " in text
    doc = json.loads(subprocess.run([*argv, "--json", "router.request_timeout_s=10"],
                                    capture_output=True, text=True).stdout)
    (request,) = [b for b in doc["budgets"] if b["key"] == "router.request_timeout_s"]
    assert request["limit_s"] == 10 and not request["fits"]
    assert request["need_s"] == sum(p["seconds"] for p in request["parts"])
    assert not doc["ok"]

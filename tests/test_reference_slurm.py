"""The tiny-local deployment served by the reference engine as a Slurm job (4 emulated nodes).

Prefill TP2 spans nodes 0-1 (gloo across "nodes"), the two decode instances run on nodes 2 and
3, KV travels over `tcp;ofi_rxm`. The test talks to the router like a user, checks every token
against the oracle, then cancels the job: every worker stops cleanly with all pages free.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdtool.engines.reference.fromplan import model_fields
from pdtool.engines.reference.local import free_port, free_port_run, get_json
from pdtool.engines.reference.model import TinyConfig, TinyModel
from pdtool.engines.reference.oracle import encode, generate
from pdtool.plan import from_json


@pytest.mark.slow
def test_tiny_local_serves_as_a_slurm_job(slurm, tmp_path: Path) -> None:
    out = tmp_path / "job"
    router, prefill, decode = free_port(), free_port(), free_port_run(2)
    overrides = [
        "+recipe=tiny-local", "launcher=slurm", "transfer=tcp", "cluster.nodes=4",
        "cluster.one_host=true",  # the emulated nodes are this machine: loopback reaches them
        "cluster.gpus_per_node=1", "cluster.gpu_numa=[0]", "prefill.tp=2", "prefill.nodes=2",
        "decode.instances=2", f"prefill.http_port={prefill}", f"decode.http_port={decode}",
        f"prefill.bootstrap_port={free_port()}", f"prefill.dist_init_port={free_port()}",
        f"decode.dist_init_port={free_port_run(2)}", f"router.port={router}",
        "launcher.health_timeout_s=120", "launcher.job_name=pdtool-serve",
    ]
    res = subprocess.run([sys.executable, "-m", "pdtool.cli", "launch", *overrides, "--out",
                          str(out)], env=slurm.env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    batch = out / "logs" / f"slurm-{job}.out"
    try:
        url = f"http://127.0.0.1:{router}"
        deadline = time.monotonic() + 150
        while True:
            try:
                if get_json(f"{url}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            state, _ = slurm.job_state(job)
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), batch.read_text()
            assert time.monotonic() < deadline, batch.read_text()
            time.sleep(0.3)
        plan = from_json((out / "plan.json").read_text())
        cfg = TinyConfig(**model_fields(plan.model, plan.transfer.kv_dtype))
        model = TinyModel(cfg)
        seen = set()
        for prompt in ("Slurm says hello from four emulated nodes", "tiny", "a b c d e f g"):
            code, body = get_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 10})
            assert code == 200, body
            assert body["pdtool"]["token_ids"] == generate(cfg, encode(prompt), 10, model)
            seen.add(body["pdtool"]["decode_instance"])
        assert seen == {0, 1}
    finally:
        slurm.run("scancel", job)
        slurm.wait_job(job, timeout=60)
    stats = [json.loads(line[6:]) for log in (out / "logs" / job).glob("*.log")
             for line in log.read_text().splitlines() if line.startswith("STATS ")]
    assert sorted((s["role"], s["rank"]) for s in stats) == [
        ("decode", 0), ("decode", 0), ("prefill", 0), ("prefill", 1)]
    assert all(s["pages_free"] == s["pages_total"] for s in stats)
    assert sum(s.get("prompt_tokens_seen", 0) for s in stats) == 3

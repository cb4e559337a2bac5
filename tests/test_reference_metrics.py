"""Prometheus `/metrics` of a deployment launched as a user launches it (`pdtool launch
+recipe=tiny-local`), read with prometheus-client's own parser: the front's request counters
and latency histograms move with traffic, and the KV messenger's counters on the instance leads
say exactly what the plan says each request writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdtool.engines.reference.local import free_port_overrides

PROMPT_TOKENS, REQUESTS, MAX_TOKENS = 64, 6, 4


def scrape(url: str) -> dict[str, float]:
    """Every sample of `url`'s /metrics by name (labels folded into the name: `a{k="v"}`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@pytest.mark.slow
def test_metrics_follow_traffic_and_the_plans_write_counts(tmp_path: Path) -> None:
    job = tmp_path / "job"
    ports = free_port_overrides()
    proc = subprocess.Popen([sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local",
                             *ports, "--out", str(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    said: list[str] = []
    try:
        for line in proc.stdout:
            said.append(line)
            if "deployment ready" in line:
                break
        else:
            raise AssertionError("".join(said))
        plan = json.loads((job / "plan.json").read_text())
        router = f"http://127.0.0.1:{plan['router']['port']}"
        leads = {f"{i['role']}-{i['index']}": f"http://127.0.0.1:{i['http_port']}"
                 for i in plan["instances"]}
        before = scrape(router)
        assert before['pdtool_decode_instances_up'] == 2
        assert before.get('pdtool_requests_total{status="200"}', 0) == 0

        client = openai.OpenAI(base_url=f"{router}/v1", api_key="none")
        for i in range(REQUESTS):
            prompt = [(7 * i + k) % 256 for k in range(PROMPT_TOKENS)]
            out = client.completions.create(model=plan["model"]["name"], prompt=prompt,
                                            max_tokens=MAX_TOKENS, temperature=0)
            assert out.usage.completion_tokens == MAX_TOKENS
        bad = urllib.request.Request(f"{router}/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(bad, timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 400

        front = scrape(router)
        assert front['pdtool_requests_total{status="200"}'] == REQUESTS
        assert front['pdtool_requests_total{status="400"}'] == 1
        assert front["pdtool_time_to_first_token_seconds_count"] == REQUESTS
        assert front["pdtool_request_seconds_count"] == REQUESTS
        assert 0 < front["pdtool_time_to_first_token_seconds_sum"] <= \
            front["pdtool_request_seconds_sum"]
        assert front["pdtool_prompt_tokens_total"] == REQUESTS * PROMPT_TOKENS
        assert front["pdtool_output_tokens_total"] == REQUESTS * MAX_TOKENS

        # what the plan says one request of this length writes (`pdtool plan --tokens`)
        routes = json.loads(subprocess.run(
            [sys.executable, "-m", "pdtool.cli", "plan", "+recipe=tiny-local", *ports,
             "--tokens", str(PROMPT_TOKENS), "--json"], capture_output=True, text=True,
            check=True).stdout)["transfer"]
        writes = sum(r["writes_per_request"] for r in routes["routes"])
        mem = next(m for m in plan["memory"] if m["role"] == "prefill")
        hidden_row = plan["model"]["hidden_size"] * 4  # the aux row: a float32 hidden state
        kv_bytes = routes["pages_per_request"] * mem["kv_bytes_per_page"]
        prefill = scrape(leads["prefill-0"])
        assert prefill["pdtool_kv_page_writes_total"] == REQUESTS * writes
        # bytes by NIC and decode peer: each decode got what its own transfers carried
        by_peer = {k: v for k, v in prefill.items() if k.startswith("pdtool_kv_sent_bytes_total")}
        assert sum(by_peer.values()) == REQUESTS * (kv_bytes + hidden_row)
        assert prefill["pdtool_kv_write_errors_total"] == 0
        assert prefill["pdtool_kv_retired_tags_total"] == 0
        # a decode's transfers by the prefill instance they came from (the only one here)
        decode = [scrape(leads[f"decode-{i}"]) for i in range(2)]
        ok = [d['pdtool_kv_transfers_succeeded_total{peer="prefill-0"}'] for d in decode]
        assert sum(ok) == REQUESTS
        assert by_peer == {
            f'pdtool_kv_sent_bytes_total{{nic="shm",peer="decode{i}-r0"}}':  # shm's domain
            ok[i] * (kv_bytes + hidden_row) for i in range(2)}, by_peer
        assert [d['pdtool_kv_transfer_seconds_count{peer="prefill-0"}'] for d in decode] == ok
        assert all(d['pdtool_kv_transfers_failed_total{peer="prefill-0"}'] == 0 for d in decode)
        # every slot is free again
        assert sum(d["pdtool_kv_slots_in_use"] for d in decode) == 0
        # the job folder's scrape config names every one of them, labelled
        import yaml

        scrape_cfg = yaml.safe_load((job / "prometheus.yml").read_text())["scrape_configs"]
        named = {g["labels"].get("instance", g["labels"]["role"]): f"http://{t}"
                 for sc in scrape_cfg for g in sc["static_configs"] for t in g["targets"]}
        assert named == {"router": router, **leads}
        assert all(scrape(url) for url in named.values())
        # the front logs one line per request
        router_log = next((job / "logs").glob("local-*/router.log")).read_text()
        assert router_log.count(f"request: {PROMPT_TOKENS} prompt + {MAX_TOKENS} output") == \
            REQUESTS, router_log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)


def test_sglang_deployments_scrape_the_router_and_opted_in_servers() -> None:
    """SGLang: sglang-router's exporter always, each server's /metrics when its launch line
    asks SGLang for them (`--enable-metrics`)."""
    from helpers.pdtool_cfg import recipe

    from pdtool.launch.scrape import scrape_config
    from pdtool.plan import build_plan

    cfg = recipe("sglang-local")
    plan = build_plan(cfg)
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    (job,) = scrape_config(cfg, plan, hosts)["scrape_configs"]
    assert job["job_name"] == "sglang-router"
    assert job["static_configs"][0]["targets"] == [
        f"{hosts[plan.router.node]}:{plan.router.metrics_port}"]
    cfg = recipe("sglang-local", "decode.extra_args=[--enable-metrics]")
    jobs = scrape_config(cfg, build_plan(cfg), hosts)["scrape_configs"]
    servers = [g["labels"]["instance"] for j in jobs if j["job_name"] == "sglang-instances"
               for g in j["static_configs"]]
    assert servers == ["decode-0", "decode-1"]

"""The SGLang path served end to end: real SGLang 0.5.23 servers (its CPU engine), pdtool's KV
messenger as their transfer backend, the real sglang-router, all started by `pdtool launch
+recipe=sglang-local` as a user starts them.

The oracle is the aggregated deployment of the same checkpoint (`mode=aggregated`: the same
SGLang servers without disaggregation), itself checked against transformers' `generate`.
Greedy tokens must be identical through every disaggregated deployment: pdtool's backend over
shm and over tcp;ofi_rxm, page sizes 16 and 1, prefix-cache hits on the prefill, concurrent
requests. A decode server that received no KV would produce other tokens (checked: the
oracle's tokens differ from those of a prompt without its prefix). What the backend does is
read from the real servers' own logs and /metrics: per-layer streaming on the prefill, the
writes per page, a decode's scheduler asleep while its room waits.

One deployment per fixture, module-scoped, stopped before the next module starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_checkpoints import greedy, hub_cache
from helpers.sglang_servers import (
    MAX_NEW,
    PROMPTS,
    Served,
    metric_samples,
    metric_totals,
    plan_writes,
    tokenize,
)

from pdtool.checkpoints import ensure

pytestmark = pytest.mark.sglang_servers


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens from the aggregated SGLang deployment, which must equal
    transformers' on the same checkpoint.

    This deployment names the checkpoint as a Hub id, as sites do, with launcher.model_cache
    and launcher.stage_to: the shared cache holds it (laid out as a download leaves it), the
    launch copies it to the "node's disk" and the server reads that copy offline
    (HF_HUB_OFFLINE=1 in its environment), so the tokens also show that SGLang loaded the
    staged weights and tokenizer."""
    folder = Path(ensure("builtin:tiny-llama"))
    tmp = tmp_path_factory.mktemp("aggregated")
    hub_cache(tmp / "hf-cache", "acme/tiny-llama", folder)
    served = Served(tmp, "mode=aggregated", "decode.instances=1",
                    "model.path=acme/tiny-llama", f"launcher.model_cache={tmp / 'hf-cache'}",
                    f"launcher.stage_to={tmp / 'node-disk'}")
    served.start()
    try:
        # each prompt, and its last token alone (what a decode without the prompt's KV sees)
        prompts = [*PROMPTS, tokenize(), *([p[-1]] for p in PROMPTS)]
        out = {tuple(p): served.generate(p) for p in prompts}
    finally:
        served.stop()
    assert "model weights: acme/tiny-llama found in" in served.output()
    assert f"GiB copied to {tmp / 'node-disk' / 'hub'}" in served.output()
    for p in PROMPTS[:3]:
        assert out[tuple(p)] == greedy(folder, p, MAX_NEW)
    return out


#: a watchdog (and router health checks) far stricter than the default 10 s: three probes
#: missed in a row, WATCHDOG_S apart, restart an instance
WATCHDOG_S = 3
#: a forward pass of the slowed prefill: three missed probes (WATCHDOG_S apart, each given
#: WATCHDOG_S) fit in it
FORWARD_S = 20


@pytest.fixture(scope="module")
def pd_shm(tmp_path_factory: pytest.TempPathFactory):
    served = Served(tmp_path_factory.mktemp("pd-shm"), f"launcher.watchdog_s={WATCHDOG_S}",
                    f"launcher.probe_timeout_s={WATCHDOG_S}", "launcher.verify=3",
                    "prefill.extra_args=[--enable-metrics]",
                    "decode.extra_args=[--enable-metrics]").start()
    yield served
    served.stop()


@pytest.mark.slow
def test_the_kv_matters(oracle) -> None:
    """The tokens depend on the prompt's earlier tokens, so a decode server that ran without
    the prompt's KV would not produce the oracle's tokens."""
    for p in PROMPTS:
        if len(p) > 1:
            assert oracle[tuple(p)] != oracle[(p[-1],)], p


@pytest.mark.slow
def test_pd_over_shm_is_token_exact(oracle, pd_shm: Served) -> None:
    prompts = [*PROMPTS, tokenize()]
    # one at a time (the second of the shared-prefix pair hits the prefill's prefix cache),
    # then all together, twice over, across both decode instances
    for p in prompts:
        assert pd_shm.generate(p) == oracle[tuple(p)], p
    got = pd_shm.generate_all(prompts * 2, concurrency=8)
    assert got == [oracle[tuple(p)] for p in prompts * 2]
    assert not pd_shm.failures()


def test_the_launch_checked_every_pair_before_serving(pd_shm: Served) -> None:
    """launcher.verify: once healthy, and before it called the deployment ready, the
    supervisor sent 3 greedy prompts through each prefill->decode pair (addressed directly,
    as the router addresses a pair) and they agreed."""
    out = pd_shm.output()
    assert "launcher.verify: 3 greedy prompts through each of 2 prefill->decode pairs: every " \
        "pair gave the same tokens" in out, pd_shm.tail()
    assert out.index("launcher.verify:") < out.index("deployment ready")  # then it serves


def test_prefill_streams_layer_by_layer(pd_shm: Served) -> None:
    logs = pd_shm.logs()
    assert "per-layer KV streaming: a forward streamed 2 layers" in logs["prefill-0.n0"]
    for name in ("prefill-0.n0", "decode-0.n0", "decode-1.n0"):
        assert "pdtool-worker: SGLang on CPU:" in logs[name]
        # (SGLang's own "post-warmup freeze_gc failed" traceback is benign: with
        # --skip-server-warmup it may post /freeze_gc before its HTTP port listens)
        assert "Scheduler hit an exception" not in logs[name], logs[name][-3000:]
        assert "pdtool-worker: ERROR" not in logs[name], logs[name][-3000:]


def test_openai_client_through_the_router(pd_shm: Served) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{pd_shm.url}/v1", api_key="none")
    out = client.completions.create(model="tiny-llama", prompt="The quick brown fox",
                                    max_tokens=8, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        temperature=0, stream=True))
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 1


@pytest.mark.slow
def test_pdtool_bench_against_the_router(pd_shm: Served, tmp_path: Path) -> None:
    """`pdtool bench --url` through sglang-router: text prompts of the drawn lengths (the
    router takes no token ids), every request completed, the server's prompt token counts."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench"
    p = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "bench", "+recipe=sglang-local", "--url",
         pd_shm.url, "--concurrency", "2", "--requests", "6", "--isl", "40", "--osl", "4",
         "--out", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["summary"]["completed"] == 6
    assert [r["input_tokens"] for r in run["records"]] == [40] * 6
    assert run["summary"]["output_tokens"] == 6 * 4
    # without the deployment's overrides the bench sends token ids, which the router
    # refuses: the failure says what to give instead (it listed one HTTP 422 per column)
    p = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "bench", "--url", pd_shm.url, "--concurrency",
         "1", "--requests", "2", "--isl", "8", "--osl", "2", "--out", str(tmp_path / "ids")],
        capture_output=True, text=True, timeout=300, check=False)
    failures = json.loads((tmp_path / "ids" / "results.json").read_text())["runs"][0]
    assert failures["summary"]["errors"] == {
        "HTTP 422: the front takes text prompts, not token ids (sglang-router): give the "
        "bench the deployment's overrides (engine=sglang, e.g. +recipe=sglang-local) or "
        "--job DIR": 2}, p.stdout + p.stderr


def test_sglang_servers_export_the_transfer_metrics(pd_shm: Served) -> None:
    """pdtool's backend counts its KV writes inside SGLang's scheduler processes and SGLang's
    own /metrics (--enable-metrics) shows them: on the prefill, operations, page writes and
    bytes per NIC and decode peer; on each decode, transfers that succeeded and their time.
    Two requests, alone, of 1 and 3 pages (prompts no cache holds): each one's page writes are
    what `pdtool plan --tokens N` says a request of its length writes, the prefill's bytes grow
    by the plan's KV bytes per page for each page more (each request's aux rows are the same
    size and cancel out), and the decodes count one transfer per request."""
    import json

    urls = pd_shm.server_urls()
    decodes = [u for name, u in urls.items() if name.startswith("decode-")]
    page_bytes = next(m["kv_bytes_per_page"] for m in json.loads(
        (pd_shm.run_dir / "plan.json").read_text())["memory"] if m["role"] == "prefill")

    def snapshot() -> tuple[float, ...]:
        pre = metric_totals(urls["prefill-0"])
        dec = [metric_totals(u) for u in decodes]
        return (pre["pdtool_kv_sent_bytes_total"], pre["pdtool_kv_write_operations_total"],
                pre["pdtool_kv_page_writes_total"],
                sum(d.get("pdtool_kv_transfers_succeeded_total", 0) for d in dec),
                sum(d.get("pdtool_kv_transfer_seconds_count", 0) for d in dec))

    before = snapshot()
    short = [(17 * i + 5) % 290 + 3 for i in range(16)]            # one page of 16 tokens
    long = [(29 * i + 11) % 290 + 3 for i in range(48)]           # three pages
    pd_shm.generate([271, *short[1:]], 2)
    middle = snapshot()
    pd_shm.generate([283, *long[1:]], 2)
    after = snapshot()
    first, second = (b - a for a, b in zip(before, middle, strict=True)), \
        (b - a for a, b in zip(middle, after, strict=True))
    (bytes1, ops1, writes1, ok1, timed1), (bytes2, ops2, writes2, ok2, timed2) = first, second
    print(f"prefill sent {bytes1:.0f} B in {writes1:.0f} page writes ({ops1:.0f} operations), "
          f"then {bytes2:.0f} B in {writes2:.0f} ({ops2:.0f}); page {page_bytes} B")
    assert (writes1, writes2) == (plan_writes("sglang-local", 16),
                                  plan_writes("sglang-local", 48))
    assert 0 < ops1 <= writes1 and 0 < ops2 <= writes2
    assert bytes2 - bytes1 == 2 * page_bytes
    assert (ok1, ok2, timed1, timed2) == (1, 1, 1, 1)
    pre = metric_samples(urls["prefill-0"])
    for labels, _ in pre["pdtool_kv_sent_bytes_total"]:
        assert labels["rank"] == "0" and labels["nic"] and ":" in labels["peer"], labels
    assert sum(v for _, v in pre.get("pdtool_kv_write_errors_total", [])) == 0
    for u in decodes:
        d = metric_samples(u)
        assert sum(v for _, v in d.get("pdtool_kv_transfers_failed_total", [])) == 0
        for labels, _ in d.get("pdtool_kv_transfer_seconds_count", []):  # the prefill rank
            assert labels["rank"] == "0" and ":" in labels["peer"], labels
        assert "pdtool_kv_slots_in_use" in d  # every decode's, with or without traffic
    # a decode with nothing to run while its room waited for the prefill slept until the
    # room changed (idle_wait.py: --sleep-on-idle, which pdtool sets on CPU) instead of
    # polling again at once; the serving decode's waits were ended by that news
    waits = [{labels["ended"]: v for labels, v in metric_samples(u).get(
        "pdtool_scheduler_idle_waits_total", [])} for u in decodes]
    assert any(w.get("news", 0) > 0 for w in waits), waits


def _post(url: str, body: dict) -> None:
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60):
        pass


def test_a_busy_prefill_is_not_taken_for_a_hung_one(pd_shm: Served) -> None:
    """SGLang's /health runs a one-token generation; a busy scheduler acknowledges it after
    its current forward pass, so a probe waits up to a whole forward pass (and up to 1 s
    more). A forward pass longer than launcher.probe_timeout_s (a long chunk of a long
    context on a large model) made the watchdog's probes, and the router's, miss and restart
    a busy, healthy server. Here SGLang's own /slow_down makes each of the prefill's forward
    passes last FORWARD_S, longer than three missed probes, over a prompt of two chunks:
    /health answers without queueing behind it (pdtool.launch.backends.LIVENESS), nothing is
    restarted, and the request's tokens are transformers'."""
    import threading

    from pdtool.launch.health import check

    prefill = pd_shm.server_urls()["prefill-0"]
    prompt = [(13 * i) % 300 + 3 for i in range(40)]  # 2 chunks of chunked_prefill_size 32
    got: list[list[int]] = []
    _post(f"{prefill}/slow_down", {"forward_sleep_time": FORWARD_S})
    try:
        worker = threading.Thread(target=lambda: got.append(pd_shm.generate(prompt, 4,
                                                                            timeout=300)))
        worker.start()
        answers = []
        while worker.is_alive():
            answers.append(check(f"{prefill}/health", timeout=WATCHDOG_S))
            worker.join(1)
    finally:
        _post(f"{prefill}/slow_down", {"forward_sleep_time": None})
    print(f"{len(answers)} probes of the busy prefill's /health, "
          f"{sum(not a for a in answers)} answered")
    assert got == [greedy(Path(ensure("builtin:tiny-llama")), prompt, 4)]
    assert len(answers) >= 2 * FORWARD_S // (WATCHDOG_S + 1)  # it really was busy that long
    assert "stopped answering" not in pd_shm.output(), pd_shm.tail()
    assert "restarting" not in pd_shm.output(), pd_shm.tail()

"""Disaggregated serving end to end: real processes, gloo TP, KV over the libfabric messenger (shm).

Each deployment is a prefill instance, decode instance(s) and the HTTP front: `tiny-local` is
started the user's way (`pdtool launch +recipe=tiny-local`, plan → worker entry), the TP
variants straight from RankSpecs. Every generated token is compared with the single-process
oracle (greedy, TP1, whole prompt in one pass). The decoder's counters prove it never ran the
prompt (one prompt token per request), and every KV page on both sides is free once the
requests are done.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zmq

from pdtool.engines.reference.client import complete
from pdtool.engines.reference.fromplan import model_fields
from pdtool.engines.reference.local import (
    Deployment,
    free_port,
    free_port_run,
    get_json,
    new_secret,
)
from pdtool.engines.reference.model import TinyModel
from pdtool.engines.reference.oracle import encode, generate
from pdtool.engines.reference.serve import RankSpec
from pdtool.engines.reference.spec import LinkSpec
from pdtool.engines.reference.tokens import decode
from pdtool.engines.reference.wire import Wire, dealer
from pdtool.plan import from_json
from transfer.wire import read_secret

torch.set_num_threads(1)
CHUNK = 16  # prefill chunk (tokens); page size 4: prompts below span up to 9 chunks

CONFIGS = {
    # name: (attention, prefill tp, decode tp, decode instances); tiny-local is the recipe's
    # 1 prefill (TP1) : 2 decode (TP1), launched with `pdtool launch`
    "gqa-tp2-tp1": ("gqa", 2, 1, 1),  # the decoder rebuilds each page from 2 prefill ranks
    "gqa-tp4-tp1": ("gqa", 4, 1, 1),  # 2 KV heads on 4 ranks: replicated, random sources
    "gqa-tp1-tp2": ("gqa", 1, 2, 1),
    "mla-tp2-tp1": ("mla", 2, 1, 1),
    # as gqa-tp2-tp1, but the prefill announces every 8 KiB of KV (a chunk or two of this
    # tiny model per rank; LinkSpec.announce_bytes), so the prompts below stream
    # their pages mid-prompt, where the default (4 MiB, which the plan keeps) waits for their
    # ends
    "gqa-tp2-tp1-streamed": ("gqa", 2, 1, 1),
}


class Served:
    """A running deployment: front URL, leaders' base URLs (prefill first), the oracle."""

    proc: subprocess.Popen | None = None
    dep: Deployment | None = None

    def __init__(self, name: str, tmp, overrides: tuple[str, ...] = ()) -> None:
        if name == "tiny-local":
            self._launch(tmp, overrides)
        else:
            self._specs(name, tmp)
        self.cfg = RankSpec(role="decode", model=self.model).cfg
        self.oracle_model = TinyModel(self.cfg)

    def _launch(self, tmp, overrides: tuple[str, ...] = ()) -> None:
        """`pdtool launch +recipe=tiny-local` on free ports, fault hooks enabled by env."""
        p, d, r = free_port(), free_port_run(2), free_port()
        out = tmp / "job"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local",
             f"prefill.http_port={p}", f"decode.http_port={d}", f"router.port={r}",
             f"prefill.dist_init_port={free_port()}",
             f"decode.dist_init_port={free_port_run(2)}",
             "+launcher.env.decode.PDTOOL_REFERENCE_ALLOW_FAULTS=1", *overrides,
             "--out", str(out)],
            stdout=open(tmp / "launch.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True)
        self.url = f"http://127.0.0.1:{r}"
        self.leaders = [f"http://127.0.0.1:{p}", f"http://127.0.0.1:{d}",
                        f"http://127.0.0.1:{d + 1}"]
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, (tmp / "launch.log").read_text()
            try:
                if get_json(f"{self.url}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp / "launch.log").read_text()
            time.sleep(0.2)
        self.secret = read_secret(out / "secret.key").hex()
        plan = from_json((out / "plan.json").read_text())
        self.model = model_fields(plan.model, plan.transfer.kv_dtype)

    def stop(self) -> None:
        if self.dep is not None:
            self.dep.stop()
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)  # the supervisor stops every process
            self.proc.wait(timeout=60)

    def _specs(self, name: str, tmp) -> None:
        attention, ptp, dtp, ndec = CONFIGS[name]
        self.model = {"attention": attention}
        self.secret = new_secret()
        p_dist, p_http, f_http = free_port(), free_port(), free_port()
        link = LinkSpec(prefill_tp=ptp, decode_tp=dtp, provider="shm",
                        prefill=[f"http://127.0.0.1:{p_http}/health"],
                        announce_bytes=(8 << 10) if name.endswith("-streamed") else 0)
        common = {"secret_hex": self.secret, "link": link, "model": self.model,
                  "page_size": 4, "chunk": CHUNK}
        specs = [RankSpec(role="prefill", tp=ptp, rank=r, dist_port=p_dist, http_port=p_http,
                          **common) for r in range(ptp)]
        self.leaders = [f"http://127.0.0.1:{p_http}"]
        for i in range(ndec):
            d_dist, d_http = free_port(), free_port()
            specs += [RankSpec(role="decode", instance=i, tp=dtp, rank=r, dist_port=d_dist,
                               http_port=d_http, allow_faults=True, **common)
                      for r in range(dtp)]
            self.leaders.append(f"http://127.0.0.1:{d_http}")
        specs.append(RankSpec(role="front", http_port=f_http, secret_hex=self.secret,
                              decoders=[f"{u}/health" for u in self.leaders[1:]]))
        self.url = f"http://127.0.0.1:{f_http}"
        self.dep = Deployment(specs, tmp / name)
        self.dep.start()  # waits for every leader's /health, the front's once decoders answer

    def oracle(self, prompt: str, max_tokens: int) -> list[int]:
        return generate(self.cfg, encode(prompt), max_tokens, self.oracle_model)

    def complete(self, prompt: str, max_tokens: int) -> dict:
        code, body = get_json(f"{self.url}/v1/completions",
                              {"prompt": prompt, "max_tokens": max_tokens})
        assert code == 200, body
        return body

    def stats(self) -> list[dict]:
        return [get_json(f"{u}/stats")[1] for u in self.leaders]

    def wait_idle(self) -> list[dict]:
        """Stats once every request has left both sides (prefill frees after its writes)."""
        for _ in range(200):
            st = self.stats()
            if all(s["pages_free"] == s["pages_total"] for s in st):
                return st
            time.sleep(0.05)
        return self.stats()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    running: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name not in running:
            for other in list(running):  # one deployment at a time: 2 shared cores
                running.pop(other).stop()
            running[name] = Served(name, tmp_path_factory.mktemp("serve"))
        return running[name]

    yield get
    for s in running.values():
        s.stop()


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 150) -> list[str]:
    rng = random.Random(seed)
    text = ("Disaggregated prefill streams KV pages layer by layer; the decoder counts "
            "writes, never waits for a done message. ünïcödé ✓ 0123456789 ")
    out = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        start = rng.randint(0, len(text) - 1)
        out.append((text * 3)[start : start + k])
    return out


def _check_exact(s: Served, prompts: list[str], max_tokens: list[int], workers: int) -> list:
    with ThreadPoolExecutor(workers) as pool:
        bodies = list(pool.map(s.complete, prompts, max_tokens))
    for p, m, b in zip(prompts, max_tokens, bodies, strict=True):
        assert b["pdtool"]["token_ids"] == s.oracle(p, m), p
    return bodies


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gqa-tp2-tp1", "gqa-tp4-tp1", "mla-tp2-tp1", "gqa-tp1-tp2",
                                  "gqa-tp2-tp1-streamed"])
def test_token_exact_across_tp(served, name):
    s = served(name)
    prompts = [*_prompts(5, seed=7, lo=40, hi=140), "ab", "x"]
    assert max(len(p.encode()) for p in prompts) > 4 * CHUNK
    _check_exact(s, prompts, [8] * len(prompts), workers=4)
    prefill, decode = s.wait_idle()
    assert prefill["pages_free"] == prefill["pages_total"]
    assert decode["pages_free"] == decode["pages_total"]
    # the decoder's forward passes saw one prompt token per request, never the rest
    assert decode["prompt_tokens_seen"] == len(prompts)
    assert decode["tokens_seen"] <= 2 * len(prompts) + 8 * len(prompts)
    # prefill ran every prompt but its last token (one-token prompts skip it)
    assert prefill["tokens_seen"] == sum(len(p.encode()) - 1 for p in prompts if len(p) > 1)


@pytest.mark.slow
def test_front_http_surface_streaming_and_errors(served):
    s = served("gqa-tp1-tp2")  # still running from the test above
    c = complete(s.url, "Stream me", max_tokens=7)
    want = s.oracle("Stream me", 7)
    assert c.tokens == 7 and c.text == decode(want) and c.ttft_s > 0
    code, body = get_json(f"{s.url}/v1/completions", {"prompt": "", "max_tokens": 3})
    assert code == 400 and body["error"]["message"].startswith("prompt:")
    code, body = get_json(f"{s.url}/v1/completions", {"prompt": [72, 105], "max_tokens": 2})
    assert code == 200 and body["pdtool"]["token_ids"] == s.oracle("Hi", 2)
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    code, models = get_json(f"{s.url}/v1/models")
    assert code == 200 and models["data"][0]["id"] == "reference"
    code, health = get_json(f"{s.url}/health")
    assert code == 200 and health["decode_up"] == 1


@pytest.mark.slow
def test_64_concurrent_mixed_requests_through_front(served):
    s = served("tiny-local")
    prompts = _prompts(64, seed=11)
    rng = random.Random(5)
    max_tokens = [rng.randint(1, 12) for _ in prompts]
    bodies = _check_exact(s, prompts, max_tokens, workers=64)
    assert {b["pdtool"]["decode_instance"] for b in bodies} == {0, 1}
    prefill, *decoders = s.wait_idle()
    for st in (prefill, *decoders):
        assert st["pages_free"] == st["pages_total"], st
        assert st.get("in_transfer", 0) == st["running"] == st["waiting"] == 0
    assert sum(d["prompt_tokens_seen"] for d in decoders) == 64
    assert max(d["max_batch"] for d in decoders) > 1  # continuous batching: requests step together
    assert prefill["tokens_seen"] == sum(len(p.encode()) - 1 for p in prompts)


def _direct(s: Served, prompt: str, max_tokens: int, faults: dict | None) -> dict:
    """GEN straight to decode instance 0 (faults are a wire field, not an HTTP one)."""
    _, health = get_json(f"{s.leaders[1]}/health")
    wire = Wire(bytes.fromhex(s.secret))
    ctx = zmq.Context.instance()
    sock = dealer(ctx, health["engine"], wire)
    decoder = wire.handshake(sock)
    body = {"rid": f"fault-{time.monotonic_ns()}", "tokens": encode(prompt),
            "max_tokens": max_tokens, "faults": faults}
    sock.send_multipart(wire.pack("GEN", body, peer=decoder))
    toks, info = [], {}
    try:
        while True:
            assert sock.poll(60_000), "no answer from the decoder"
            _, out = wire.unpack(sock.recv_multipart(), ("OUT",))
            toks += out["tokens"]
            if out["done"]:
                info = out["info"]
                break
    finally:
        sock.close(0)
    return {"tokens": toks, **info}


@pytest.mark.slow
def test_decoder_uses_the_transferred_pages_and_hidden_state(served):
    s = served("tiny-local")
    prompts = _prompts(8, seed=3, lo=20, hi=60)
    changed = drafts_moved = 0
    for p in prompts:
        want = s.oracle(p, 8)
        clean = _direct(s, p, 8, None)
        assert clean["tokens"] == want
        # noise on one received page of layer 0: the decoder attends over what arrived
        changed += _direct(s, p, 8, {"page": [0, 0]})["tokens"] != want
        # noise on the shipped hidden state: the MTP draft changes, verification keeps the text
        moved = _direct(s, p, 8, {"hidden": True})
        assert moved["tokens"] == want
        drafts_moved += moved["draft"] != clean["draft"]
    assert changed >= len(prompts) - 1
    assert drafts_moved >= len(prompts) // 2  # a random-weight draft head: often, not always
    assert all(st["pages_free"] == st["pages_total"] for st in s.wait_idle())

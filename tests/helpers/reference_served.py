"""Reference-engine deployments to test against: `tiny-local` started the user's way
(`pdtool launch +recipe=tiny-local`, plan -> worker entry) and TP variants straight from
RankSpecs (`CONFIGS`), each with its single-process oracle (greedy, TP1, whole prompt in one
pass). Used by the serving, aggregated-mode and reliability tests."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch

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


def sample_prompts(n: int, seed: int, lo: int = 1, hi: int = 150) -> list[str]:
    """`n` prompts of `lo`..`hi` characters cut from one text (multi-byte characters
    included), seeded."""
    rng = random.Random(seed)
    text = ("Disaggregated prefill streams KV pages layer by layer; the decoder counts "
            "writes, never waits for a done message. ünïcödé ✓ 0123456789 ")
    out = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        start = rng.randint(0, len(text) - 1)
        out.append((text * 3)[start : start + k])
    return out

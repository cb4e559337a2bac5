"""Soak a running reference deployment: many requests of random sizes through its front.

Every output is compared token for token with the single-process oracle; the resident memory
(RSS) of every deployment process is sampled after a warm-up share of the requests and at the
end, and every leader's `/stats` must show all KV pages free once the requests are done.
`bench/soak.py` starts a deployment and runs the long version; the tests run a short one.
"""

from __future__ import annotations

import contextlib
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .local import Deployment, free_port, get_json, new_secret
from .model import TinyModel
from .oracle import encode, generate
from .serve import RankSpec
from .spec import LinkSpec

TEXT = ("Disaggregated prefill streams KV pages layer by layer; the decoder counts writes, "
        "never waits for a done message. ünïcödé ✓ 0123456789 ")


@dataclass
class SoakResult:
    requests: int = 0
    tokens: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rss_warm_mib: dict[int, float] = field(default_factory=dict)
    rss_end_mib: dict[int, float] = field(default_factory=dict)
    pages_leaked: dict[str, int] = field(default_factory=dict)

    @property
    def rss_growth_mib(self) -> float:
        return max((self.rss_end_mib[p] - self.rss_warm_mib.get(p, self.rss_end_mib[p])
                    for p in self.rss_end_mib), default=0.0)

    def summary(self) -> str:
        return (f"soak: {self.requests} requests, {self.tokens} tokens in {self.seconds:.1f} s "
                f"({self.requests / max(self.seconds, 1e-9):.1f} req/s); mismatches "
                f"{len(self.mismatches)}, errors {len(self.errors)}; RSS after warm-up "
                f"{sum(self.rss_warm_mib.values()):.0f} MiB -> end "
                f"{sum(self.rss_end_mib.values()):.0f} MiB over {len(self.rss_end_mib)} "
                f"processes (max growth of one {self.rss_growth_mib:+.1f} MiB); pages leaked "
                f"{self.pages_leaked}")


def prompts(n: int, seed: int, lo: int = 1, hi: int = 200) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs of random sizes, deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        start = rng.randint(0, len(TEXT) - 1)
        out.append(((TEXT * (hi // len(TEXT) + 2))[start:start + k], rng.randint(1, 12)))
    return out


def rss_mib(pids: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # a process that is gone has no RSS
            out[pid] = psutil.Process(pid).memory_info().rss / (1 << 20)
    return out


def run_soak(url: str, leaders: list[str], pids: list[int], model: dict[str, Any], *,
             requests: int, workers: int = 16, seed: int = 0, max_seconds: float = 600.0,
             warm_share: float = 0.2) -> SoakResult:
    """Send `requests` requests (stops early after `max_seconds`) with `workers` clients."""
    cfg = RankSpec(role="decode", model=model).cfg
    oracle = TinyModel(cfg)
    res = SoakResult()
    work = prompts(requests, seed)
    warm_at = max(1, int(len(work) * warm_share))
    t0 = time.monotonic()

    def one(item: tuple[str, int]) -> tuple[str, int, Any]:
        if time.monotonic() - t0 > max_seconds:
            return item[0], item[1], None
        code, body = get_json(f"{url}/v1/completions",
                              {"prompt": item[0], "max_tokens": item[1]}, timeout=120)
        return item[0], item[1], (code, body)

    with ThreadPoolExecutor(workers) as pool:
        for i, (prompt, max_tokens, got) in enumerate(pool.map(one, work)):
            if i == warm_at:
                res.rss_warm_mib = rss_mib(pids)
            if got is None:
                continue
            code, body = got
            res.requests += 1
            if code != 200:
                res.errors.append(f"{code}: {body}")
                continue
            toks = body["pdtool"]["token_ids"]
            res.tokens += len(toks)
            if toks != generate(cfg, encode(prompt), max_tokens, oracle):
                res.mismatches.append(prompt)
    res.seconds = time.monotonic() - t0
    for _ in range(200):  # prefill frees its pages once its writes completed: let it settle
        stats = [get_json(f"{u}/stats")[1] for u in leaders]
        if all(s["pages_free"] == s["pages_total"] for s in stats):
            break
        time.sleep(0.05)
    res.pages_leaked = {f"{s['role']}{s['instance']}": s["pages_total"] - s["pages_free"]
                        for s in stats}
    res.rss_end_mib = rss_mib(pids)
    return res


def deployment(log_dir: Path, decoders: int = 2, peer_timeout_s: float = 5.0
               ) -> tuple[Deployment, str, list[str], dict]:
    """1 prefill (TP1) + `decoders` decode instances (TP1) + the front, from RankSpecs (no
    supervisor: a test may kill one process and watch the others). Not started yet; returns
    (deployment, front URL, leaders' base URLs prefill first, model fields)."""
    secret, model = new_secret(), {"attention": "gqa"}
    p_http, f_http = free_port(), free_port()
    link = LinkSpec(prefill_tp=1, decode_tp=1, prefill=[f"http://127.0.0.1:{p_http}/health"],
                    provider="shm", peer_timeout_s=peer_timeout_s)
    common = {"secret_hex": secret, "link": link, "model": model, "page_size": 4,
              "chunk": 16}
    specs = [RankSpec(role="prefill", dist_port=free_port(), http_port=p_http, **common)]
    leaders = [f"http://127.0.0.1:{p_http}"]
    for i in range(decoders):
        d_http = free_port()
        specs.append(RankSpec(role="decode", instance=i, dist_port=free_port(),
                              http_port=d_http, **common))
        leaders.append(f"http://127.0.0.1:{d_http}")
    specs.append(RankSpec(role="front", http_port=f_http, secret_hex=secret,
                          decoders=[f"{u}/health" for u in leaders[1:]]))
    return Deployment(specs, log_dir), f"http://127.0.0.1:{f_http}", leaders, model

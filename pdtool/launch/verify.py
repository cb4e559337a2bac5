"""`launcher.verify N`: a running deployment's correctness gate, before it serves or benchmarks.

A deployment that answers HTTP 200 with wrong tokens (a faulty NIC or host, a page written to
the wrong place) passes every health check and every load test. So, once the deployment is
healthy, pdtool's supervisor (local and Slurm alike) sends N greedy prompts and compares the
tokens:

* SGLang: every prompt goes through every prefill->decode pair of the plan, addressed
  directly the way sglang-router addresses a pair (the same `/generate` body to the prefill and
  the decode server, with the prefill's bootstrap host and port and a fresh bootstrap room). A
  pair whose KV path is damaged gives other tokens than the rest. For each prompt the tokens
  most pairs gave are the reference; a pair that differs is named with the prompt and the first
  differing token, and pairs that split evenly fail too (which is right cannot be told). So the
  check needs two pairs or more (validate refuses fewer).
* The reference engine: the prompts through its OpenAI front, compared with the model computed
  in this process (`client.oracle_texts`, what `pdtool bench --verify` uses).

`run` says what matched in one line, or raises VerifyFailed naming every difference.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdtool.bench.verify import first_difference

#: tokens generated per prompt: enough for a damaged page to show in the continuation
MAX_NEW = 16
#: prompt lengths in words, in turn: one page, a few, several chunks of a small model's prefill
LENGTHS = (6, 30, 90)
_TEXT = ("the river carried light across a quiet valley where seven old bridges stood in the "
         "morning fog and every traveller counted stones before crossing toward the market of "
         "glass and copper bells")


class VerifyFailed(RuntimeError):
    """The deployment's tokens differ (between pairs, or from the model), or a prompt failed."""


def prompts(n: int) -> list[str]:
    """N deterministic text prompts of the LENGTHS in turn, no two sharing a first word pair
    (a prefix cache must not serve one from another)."""
    words, out = _TEXT.split(), []
    for i in range(n):
        length = LENGTHS[i % len(LENGTHS)]
        out.append(" ".join(words[(7 * i + 3 * k + k * k) % len(words)]
                            for k in range(length)) + f" ({i})")
    return out


@dataclass(frozen=True)
class Pair:
    """One prefill->decode path of an SGLang deployment, as the router addresses it."""

    prefill: str
    decode: str
    prefill_url: str
    decode_url: str
    bootstrap_host: str
    bootstrap_port: int

    @property
    def name(self) -> str:
        return f"{self.prefill} -> {self.decode}"


def pairs(plan: Any, hosts: Sequence[str]) -> list[Pair]:
    """Every (prefill, decode) instance pair of the plan's router, at the allocation's hosts."""
    r = plan.router
    return [Pair(p.instance, d.instance, f"http://{hosts[p.node]}:{p.http_port}",
                 f"http://{hosts[d.node]}:{d.http_port}", hosts[p.node], int(p.bootstrap_port))
            for p in r.prefill for d in r.decode]


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise VerifyFailed(f"{url}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
    except (OSError, ValueError) as exc:
        raise VerifyFailed(f"{url}: {exc}") from None


def generate_on(pair: Pair, text: str, timeout: float) -> list[int]:
    """One greedy request through `pair`: the decode server's output token ids."""
    body = {"text": text, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                              "ignore_eos": True},
            "bootstrap_host": pair.bootstrap_host, "bootstrap_port": pair.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    failed: list[VerifyFailed] = []

    def to_prefill() -> None:
        try:
            _post(f"{pair.prefill_url}/generate", body, timeout)
        except VerifyFailed as exc:
            failed.append(exc)

    t = threading.Thread(target=to_prefill, daemon=True)
    t.start()
    try:
        out = _post(f"{pair.decode_url}/generate", body, timeout)
    finally:
        t.join(timeout)
    if failed:
        raise VerifyFailed(f"{pair.name}: the prefill's answer: {failed[0]}")
    return list(out["output_ids"])


def compare_pairs(outs: dict[str, list[list[int]]]) -> list[str]:
    """Every difference between pairs, prompt by prompt, against the tokens most pairs gave."""
    problems = []
    n = len(next(iter(outs.values())))
    for i in range(n):
        votes = Counter(tuple(got[i]) for got in outs.values())
        (want, agree), *rest = votes.most_common()
        if rest and rest[0][1] == agree:
            pos = first_difference(list(want), list(rest[0][0]))
            split = "; ".join(f"{name}: {got[i][pos:pos + 6]}" for name, got in outs.items())
            problems.append(f"prompt {i}: the pairs split evenly (which is right cannot be "
                            f"told) and differ at token {pos}: {split}")
            continue
        for name, got in outs.items():
            pos = first_difference(got[i], list(want))
            if pos is not None:
                problems.append(f"prompt {i} through {name}: differs from the tokens of "
                                f"{agree} other pair(s) at token {pos}: got "
                                f"{got[i][pos:pos + 6]}, want {list(want[pos:pos + 6])}")
    return problems


def check_sglang(plan: Any, hosts: Sequence[str], n: int, timeout: float) -> str:
    texts = prompts(n)
    outs = {p.name: [generate_on(p, t, timeout) for t in texts] for p in pairs(plan, hosts)}
    problems = compare_pairs(outs)
    if problems:
        raise VerifyFailed(f"{len(problems)} difference(s) between prefill->decode pairs: "
                           + "; ".join(problems))
    return (f"{n} greedy prompts through each of {len(outs)} prefill->decode pairs: every "
            "pair gave the same tokens")


def check_reference(cfg: Any, plan: Any, hosts: Sequence[str], n: int, timeout: float) -> str:
    from pdtool.engines.reference.client import oracle_texts

    texts = prompts(n)
    oracle = oracle_texts(plan, texts, MAX_NEW)
    if isinstance(oracle, str):
        raise VerifyFailed(f"the model cannot be computed here to compare with ({oracle})")
    url = f"http://{hosts[plan.router.node]}:{plan.router.port}/v1/completions"
    problems = []
    for i, (text, (want, _)) in enumerate(zip(texts, oracle, strict=True)):
        got = _post(url, {"model": cfg.model.name, "prompt": text, "max_tokens": MAX_NEW,
                          "temperature": 0.0}, timeout)["choices"][0]["text"]
        pos = first_difference(got, want)
        if pos is not None:
            lo = max(0, pos - 10)
            problems.append(f"prompt {i} through the front: differs from the model computed "
                            f"here at character {pos}: got {got[lo:pos + 20]!r}, want "
                            f"{want[lo:pos + 20]!r}")
    if problems:
        raise VerifyFailed(f"{len(problems)} of {n} outputs differ from the model: "
                           + "; ".join(problems))
    return f"{n} greedy prompts through the front: every text is the model's own"


def run(cfg: Any, plan: Any, hosts: Sequence[str],
        say: Callable[[str], None] = print) -> None:
    """launcher.verify's check (raises VerifyFailed); `say` gets its one-line result."""
    n, timeout = cfg.launcher.verify, cfg.router.request_timeout_s
    from pdtool.launch.engines import engine_launch

    result = engine_launch(cfg).verify(cfg, plan, hosts, n, timeout)
    say(f"launcher.verify: {result}")

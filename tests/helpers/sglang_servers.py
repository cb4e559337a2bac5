"""Real SGLang 0.5.23 servers on this machine, started the way a user starts them.

`Served(tmp, *overrides)` runs `pdtool launch +recipe=sglang-local ...` (pdtool's supervisor,
real SGLang prefill/decode servers on its CPU engine, the real sglang-router) on free ports,
waits for its "deployment ready" line and stops it with SIGINT, as Ctrl-C would. Requests go
through the router: `generate` uses SGLang's native `/generate` with token ids (the tokens
come back as ids, so outputs are compared exactly), and the official `openai` client is used
where the OpenAI surface is the point.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdtool.checkpoints import TEXT
from pdtool.engines.reference.local import free_port_run

#: greedy prompts as token ids of the tiny tokenizer's range: short, multi-page and
#: multi-chunk (chunked_prefill_size 32), and two that share a long prefix (a prefix-cache hit
#: on the prefill once the first has run)
PROMPTS = [
    [5, 17, 99, 2],
    list(range(40, 77)),
    [(7 * i) % 300 + 3 for i in range(90)],
    [(11 * i) % 300 + 3 for i in range(48)] + [9, 9, 9],
    [(11 * i) % 300 + 3 for i in range(48)] + [250, 1, 77, 5, 6],
    [42],
]
MAX_NEW = 12
START_TIMEOUT_S = 420.0
#: what SGLang logs for a failed transfer (decode, prefill) and pdtool's prefill for a failed room
FAILURE_MARKS = ("transfer failed", "KVTransferError", "pdtool room ")


#: every deployment a test started: stopped at exit should a test end without stopping it
#: (each runs in its own session, so nothing else would: four SGLang processes left spinning)
_started: list[Served] = []


@atexit.register
def _stop_all() -> None:
    for served in _started:
        served.stop()


class Served:
    """One deployment of `+recipe=RECIPE` (default sglang-local) with `overrides`."""

    def __init__(self, tmp: Path, *overrides: str, recipe: str = "sglang-local") -> None:
        self.run_dir = tmp / "job"
        self.log = tmp / "launch.log"
        router = free_port_run(2)  # router.port and its metrics port
        ports = [f"prefill.http_port={free_port_run(4)}",
                 f"prefill.bootstrap_port={free_port_run(4)}",
                 f"prefill.dist_init_port={free_port_run(4)}",
                 f"decode.http_port={free_port_run(4)}",
                 f"decode.dist_init_port={free_port_run(4)}", f"router.port={router}"]
        self.argv = [sys.executable, "-m", "pdtool.cli", "launch", f"+recipe={recipe}", *ports,
                     *overrides, "--out", str(self.run_dir)]
        self.url = f"http://127.0.0.1:{router}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Served:
        _started.append(self)
        self.proc = subprocess.Popen(
            self.argv, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "deployment ready" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the deployment did not come up:\n{self.tail()}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def logs(self) -> dict[str, str]:
        """Each process's log of the (one) run, by process name (`prefill-0.n0`, ...)."""
        runs = sorted((self.run_dir / "logs").glob("local-*"))
        return {p.stem: p.read_text(errors="replace") for p in runs[-1].glob("*.log")}

    def failures(self) -> list[str]:
        """Log lines of failed transfers. The router retries a request that failed, so a
        test that only compares tokens would not see them."""
        return [f"{name}: {line}" for name, text in self.logs().items()
                for line in text.splitlines() if any(m in line for m in FAILURE_MARKS)]

    def server_urls(self) -> dict[str, str]:
        """Each SGLang server's base URL by instance (prefill-0, decode-0, ...), from the
        supervisor's health lines."""
        import re

        return dict(re.findall(r"healthy: (\S+)\.n0 \((http://[^/]+)/health\)",
                               self.output()))

    def tail(self, n: int = 4000) -> str:
        out = [self.output()[-n:]]
        with contextlib.suppress(IndexError, OSError):
            out += [f"--- {k} ---\n{v[-n:]}" for k, v in self.logs().items()]
        return "\n".join(out)

    def generate(self, ids: list[int], max_new: int = MAX_NEW, timeout: float = 120.0,
                 url: str | None = None) -> list[int]:
        """Greedy `/generate` through the router (or `url`): the new token ids."""
        body = json.dumps({"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}).encode()
        req = urllib.request.Request(f"{url or self.url}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())["output_ids"]
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from None

    def generate_all(self, prompts: list[list[int]], concurrency: int = 4,
                     max_new: int = MAX_NEW) -> list[list[int]]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: self.generate(p, max_new), prompts))


def transformers_tokens(builtin: str = "builtin:tiny-llama") -> dict[tuple[int, ...], list[int]]:
    """Each prompt (PROMPTS and the tokenized TEXT) -> transformers' greedy tokens on the
    builtin checkpoint: what every deployment of it must produce."""
    from helpers.hf_checkpoints import greedy
    from pdtool.checkpoints import ensure

    folder = Path(ensure(builtin))
    return {tuple(p): greedy(folder, p, MAX_NEW) for p in [*PROMPTS, tokenize()]}


def tokenize(text: str = TEXT) -> list[int]:
    """Token ids of `text` in the builtin tiny tokenizer (as the servers tokenize it)."""
    from tokenizers import Tokenizer

    from pdtool.checkpoints import ensure

    return Tokenizer.from_file(f"{ensure('builtin:tiny-llama')}/tokenizer.json").encode(
        text).ids


def metric_samples(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A server's /metrics, parsed with prometheus-client's own parser: sample name ->
    [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def metric_totals(url: str) -> dict[str, float]:
    """Each sample name of a server's /metrics with its values summed over their labels."""
    return {name: sum(v for _, v in got) for name, got in metric_samples(url).items()}


def plan_writes(recipe: str, tokens: int, *overrides: str) -> int:
    """Page writes (aux rows included) the plan says one request of `tokens` prompt tokens
    makes, over every prefill rank (`pdtool plan --tokens N --json`)."""
    out = subprocess.run([sys.executable, "-m", "pdtool.cli", "plan", f"+recipe={recipe}",
                          *overrides, "--tokens", str(tokens), "--json"], capture_output=True,
                         text=True, check=True).stdout
    return sum(r["writes_per_request"] for r in json.loads(out)["transfer"]["routes"])

"""Faults on real SGLang servers started by `pdtool launch +recipe=sglang-local` (prefill TP1, two
decode servers, pdtool's backend over shm, sglang-router), under a steady load of requests:

1. A decode server hangs (SIGSTOP, 2 s) and is then lost (SIGKILL of its whole process group):
   the router keeps serving on the other decode server, pdtool's supervisor restarts the dead
   one (launcher.restart=on-failure), and it serves again. Writes to it that were in flight
   held every other decode's on shm, until the prefill reset its endpoint (transfer.plane.stall;
   the CI runs where they were in flight at the kill failed here before).
2. SIGKILL of the prefill server while requests are in flight: every request in flight ends
   (an error the client can read, or its tokens) instead of waiting out SGLang's 300 s; the
   supervisor restarts the prefill and the deployment serves token-exact again.
3. After more than 200 requests with both faults, SGLang's own accounting (`/v1/loads` of every
   server) shows no request left and every KV slot back.

`transfer.timeout_s` and `transfer.connect_timeout_s` are 20 s here: pdtool sets SGLang's
waiting and bootstrap timers from them (pdtool.launch.backends).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.hf_checkpoints import greedy
from helpers.sglang_servers import MAX_NEW, PROMPTS, Served, tokenize

from pdtool.checkpoints import ensure

pytestmark = pytest.mark.sglang_servers

TIMEOUT_S = 20
#: a prompt long enough that its prefill (32-token chunks) is still streaming when killed
LONG = [(7 * i) % 300 + 10 for i in range(600)]


class Load:
    """`threads` clients sending greedy requests through the router until stopped; each
    request recorded as (start, end, outcome) with outcome "ok" or the error text."""

    def __init__(self, served: Served, threads: int = 4) -> None:
        self.served = served
        self.done: list[tuple[float, float, str]] = []
        self.pause = threading.Event()
        self.stop = threading.Event()
        self.active = 0  # requests in flight
        self._lock = threading.Lock()
        self.prompts = [*PROMPTS, tokenize(), LONG]
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            if self.pause.is_set():
                time.sleep(0.1)
                continue
            prompt = self.prompts[i % len(self.prompts)]
            i += 1
            with self._lock:
                if self.pause.is_set():
                    continue
                self.active += 1
            start = time.monotonic()
            try:
                self.served.generate(prompt, max_new=16, timeout=150)
                outcome = "ok"
            except (AssertionError, OSError) as exc:
                outcome = str(exc)[:300]
            with self._lock:
                self.done.append((start, time.monotonic(), outcome))
                self.active -= 1

    def ok_since(self, t: float) -> int:
        return sum(1 for s, _, o in self.done if s >= t and o == "ok")

    def wait_ok(self, n: int, since: float, limit_s: float = 300) -> None:
        deadline = time.monotonic() + limit_s
        while self.ok_since(since) < n:
            assert time.monotonic() < deadline, self.served.tail()
            time.sleep(0.2)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=200)


def _pid(served: Served, name: str) -> int:
    return int(re.findall(rf"started {re.escape(name)} \(pid (\d+)", served.output())[-1])


def _wait_line(served: Served, line: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while line not in served.output():
        assert time.monotonic() < deadline, served.tail()
        time.sleep(0.5)


def _loads(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/loads", timeout=30) as r:
        (load,) = json.loads(r.read())["loads"]
    return load


@pytest.mark.slow
def test_decode_and_prefill_killed_under_load(tmp_path: Path) -> None:
    served = Served(tmp_path, "launcher.restart_backoff_s=1", f"transfer.timeout_s={TIMEOUT_S}",
                    f"transfer.connect_timeout_s={TIMEOUT_S}").start()
    try:
        urls = dict(re.findall(r"healthy: (\S+)\.n0 \((http://[^/]+)/health\)",
                               served.output()))
        load = Load(served)
        try:
            _kill_decode(served, load)
            _kill_prefill(served, load)
            deadline = time.monotonic() + 300  # past 200 requests with both faults
            while len(load.done) < 200:
                assert time.monotonic() < deadline, served.tail()
                time.sleep(0.5)
        finally:
            load.finish()
        print(f"{len(load.done)} requests, {load.ok_since(0)} ok")
        assert len(load.done) >= 200
        folder = Path(ensure("builtin:tiny-llama"))
        prompts = [*PROMPTS, tokenize()]
        assert served.generate_all(prompts) == [greedy(folder, p, MAX_NEW) for p in prompts]
        _assert_all_returned(urls)
    finally:
        served.stop()


def _kill_decode(served: Served, load: Load) -> None:
    """A decode server dies: the other keeps serving, the dead one comes back and serves."""
    load.wait_ok(10, 0)
    # it hangs first (a node that stops answering), with writes to it in flight, then dies
    os.killpg(_pid(served, "decode-1.n0"), signal.SIGSTOP)
    time.sleep(2)
    os.killpg(_pid(served, "decode-1.n0"), signal.SIGKILL)
    killed = time.monotonic()
    _wait_line(served, "decode-1 is serving again")
    meanwhile = [(round(s - killed, 1), round(e - killed, 1), o) for s, e, o in load.done
                 if e >= killed]
    assert load.ok_since(killed) > 0, (meanwhile, served.tail())  # served meanwhile (decode-0)
    back = time.monotonic()
    served_by_it = served.logs()["decode-1.n0"].count('"POST /generate HTTP/1.1" 200')
    deadline = back + 300
    while served.logs()["decode-1.n0"].count('"POST /generate HTTP/1.1" 200') == served_by_it:
        assert time.monotonic() < deadline, served.tail()
        time.sleep(0.5)
    load.wait_ok(20, back)


def _kill_prefill(served: Served, load: Load) -> None:
    """The prefill dies with requests in flight: each of them ends, none waits SGLang's
    300 s; the prefill comes back and the deployment serves again."""
    deadline = time.monotonic() + 60
    while load.active < len(load.threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # into their prefill (a long prompt's takes about a second)
    os.killpg(_pid(served, "prefill-0.n0"), signal.SIGKILL)
    killed = time.monotonic()
    load.pause.set()  # no new requests: the ones in flight are measured
    while load.active and time.monotonic() < killed + 300:
        time.sleep(0.2)
    ended = [d for d in load.done if d[0] < killed <= d[1]]
    took = max((e - killed for _, e, _ in ended), default=0.0)
    print(f"\nprefill killed with {len(ended)} requests in flight: the last ended {took:.1f} s "
          f"later (transfer.timeout_s={TIMEOUT_S}; SGLang's default 300 s); outcomes "
          f"{sorted({o[:100] for _, _, o in ended})}")
    assert ended and not load.active
    _wait_line(served, "prefill-0 is serving again")
    load.pause.clear()
    load.wait_ok(10, time.monotonic())


def _assert_all_returned(urls: dict[str, str]) -> None:
    """Idle now: every server's own accounting (/v1/loads) holds no request and no KV."""
    deadline = time.monotonic() + 60
    while True:
        busy = {name: (x["num_used_tokens"], x["num_running_reqs"], x["num_waiting_reqs"])
                for name, x in ((n, _loads(u)) for n, u in urls.items())}
        if all(v == (0, 0, 0) for v in busy.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(v == (0, 0, 0) for v in busy.values()), busy

"""Wait until every endpoint answers its health check, while watching the processes behind them.

Used by pdtool's supervisor (`wait_healthy`), which also probes every process once everything
is healthy (`watchdog`, launcher.watchdog_s): the first endpoint that stops answering is named,
and a hung engine whose process still runs is restarted (launcher.restart) or ends the
deployment too. A worker that exits before it is healthy
fails the wait at once with its name, status and the end of its log, instead of the job sitting
until the timeout; a timeout names every endpoint that never answered. Progress is printed every
few seconds so a user watching a slow model load sees what is still pending.

Readiness can be more than a 2xx: an URL whose fragment names worker counts
(`http://host:8000/workers#prefill=1,decode=2`, SGLang's router with engine=sglang;
`#regular=3` with mode=aggregated) is ready once the router's worker list holds that many
healthy workers of each type. The router answers
`/health` 200 as soon as it listens, while it registers its workers in the background (seen
with sglang-router 0.3.2: "Workers initialized: 0 total, 0 healthy", then /model_info and
/server_info of each worker); a deployment called ready then would refuse its first requests.
srt-slurm waits on the same list (`stats.prefill_count`/`decode_count` of `/workers`).
(Preflight workers start no router: the supervisor waits on /health then.)
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

#: exit codes of the command line
EXIT_DIED, EXIT_TIMEOUT, EXIT_HUNG = 2, 3, 4


def probe(url: str, timeout: float = 2.0) -> bool:
    """True when `url` answers 2xx (and, with a worker-count fragment, lists them)."""
    return not check(url, timeout)


def check(url: str, timeout: float = 2.0) -> str:
    """'' when `url` is ready, else why not (no answer, a status, the workers missing)."""
    url, _, fragment = url.partition("#")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if not 200 <= r.status < 300:
                return f"HTTP {r.status}"
            body = r.read() if fragment else b""
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"no answer ({getattr(e, 'reason', e)})"
    return missing_workers(body, fragment) if fragment else ""


def missing_workers(body: bytes, fragment: str) -> str:
    """'' when a router's /workers list (`body`) holds the healthy workers `fragment` asks
    for ("prefill=1,decode=2"), else which are missing."""
    want = {k: int(v) for k, v in (kv.split("=", 1) for kv in fragment.split(",") if kv)}
    try:
        workers = json.loads(body)["workers"]
        have = {k: sum(1 for w in workers if w.get("worker_type") == k and w.get("is_healthy"))
                for k in want}
    except (ValueError, KeyError, TypeError, AttributeError):
        return "the router's worker list is not JSON with a 'workers' list"
    short = [f"{have[k]} of {n} {k}" for k, n in want.items() if have[k] < n]
    return f"registered healthy: {', '.join(short)}" if short else ""


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by its parent, counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def log_tail(path: str | Path, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"    (no log at {path})"
    return "\n".join("    " + s for s in text[-lines:]) or "    (log is empty)"


class HealthFailure(RuntimeError):
    """Why a wait or the watchdog ended; `name`: the endpoint that hung, or the first that
    never answered (a timeout)."""

    def __init__(self, message: str, code: int, name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.name = name


def wait_healthy(
    endpoints: Mapping[str, str],
    dead: Callable[[], list[tuple[str, str, str]]],
    timeout: float,
    out: TextIO = sys.stdout,
    every: float = 5.0,
    poll: float = 0.5,
) -> float:
    """Block until all endpoints are healthy; returns the seconds it took.

    `dead()` returns (name, status, log path) for watched processes that have exited.
    Raises HealthFailure (with the log tail of the culprits) on a dead process or a timeout.
    """
    start = time.monotonic()
    pending = dict(endpoints)
    last = start
    print(f"waiting for {len(pending)} endpoint(s) to become healthy "
          f"(timeout {timeout:.0f}s): {', '.join(pending)}", file=out, flush=True)
    why: dict[str, str] = {}
    while pending:
        for name, url in list(pending.items()):
            why[name] = check(url)
            if not why[name]:
                del pending[name]
                print(f"  healthy: {name} ({url}) after {time.monotonic() - start:.1f}s",
                      file=out, flush=True)
        if not pending:
            break
        gone = dead()
        if gone:
            parts = [f"{n} exited ({st}) before the deployment was healthy; last lines of {log}:"
                     f"\n{log_tail(log)}" for n, st, log in gone]
            raise HealthFailure("\n".join(parts), EXIT_DIED)
        now = time.monotonic()
        if now - start > timeout:
            raise HealthFailure(
                f"timed out after {timeout:.0f}s: never healthy: "
                + ", ".join(f"{n} ({u}: {why.get(n) or 'no answer'})"
                            for n, u in pending.items()), EXIT_TIMEOUT,
                next(iter(pending)))
        if now - last >= every:
            last = now
            print(f"  still waiting ({now - start:.0f}s/{timeout:.0f}s) for: "
                  + ", ".join(f"{n} ({why[n]})" if why.get(n, "").startswith("registered")
                              else n for n in pending), file=out, flush=True)
        time.sleep(poll)
    return time.monotonic() - start


#: health checks in a row a running process may miss before it counts as hung (the
#: launchers' watchdog; sglang-router's --health-failure-threshold for its workers)
WATCHDOG_MISSES = 3


def watchdog(endpoints: Mapping[str, str], logs: Mapping[str, str], interval: float,
             failures: int, out: TextIO = sys.stdout,
             stop: Callable[[], bool] = lambda: False,
             probe_timeout: float = 5.0) -> HealthFailure | None:
    """Poll every endpoint each `interval` seconds once the deployment is ready; an endpoint
    that fails `failures` probes in a row (a hung engine answers nothing, although its process
    lives; a probe unanswered after `probe_timeout`, launcher.probe_timeout_s, is a miss) is
    returned as a HealthFailure naming it with its log tail. None when `stop()`."""
    missed = dict.fromkeys(endpoints, 0)
    while not stop():
        for name, url in endpoints.items():
            missed[name] = 0 if probe(url, timeout=probe_timeout) else missed[name] + 1
            if missed[name] >= failures:
                log = logs.get(name, "")
                tail = f"; last lines of {log}:\n{log_tail(log)}" if log else ""
                return HealthFailure(
                    f"{name} stopped answering {url} ({failures} health checks in a row, "
                    f"{interval:g}s apart) although it still runs{tail}", EXIT_HUNG, name)
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline and not stop():
            time.sleep(min(0.5, interval))
    return None

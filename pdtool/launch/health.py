"""Wait until every endpoint answers its health check, while watching the processes behind them.

Used by the rendered scripts (`python -m pdtool.launch.health --timeout T --watch NAME:PID:LOG
NAME=URL ...`) and in-process by the local supervisor. With `--watchdog S` (started once
everything is healthy) it probes instead and exits (4) naming the first endpoint that stops
answering: a hung engine whose process still runs is restarted (launcher.restart) or ends the
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
(Preflight workers start no router: the scripts and the supervisor wait on /health then.)
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtool.launch.health", description=__doc__)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--watch", action="append", default=[], metavar="NAME:PID:LOG")
    ap.add_argument("--watchdog", type=float, default=0, metavar="SECONDS",
                    help="instead of the wait (the scripts start it once everything is "
                    "healthy): probe every SECONDS; exit 4 naming the endpoint (and its log "
                    "tail) that fails --failures probes in a row")
    ap.add_argument("--failures", type=int, default=3)
    ap.add_argument("--probe-timeout", type=float, default=5.0, metavar="SECONDS",
                    help="with --watchdog: a probe unanswered this long is a miss")
    ap.add_argument("--hung-file", default="", metavar="PATH",
                    help="with --watchdog: write the name of the endpoint that hung here, so "
                    "the script restarts that instance (launcher.restart=on-failure)")
    ap.add_argument("endpoints", nargs="+", metavar="NAME=URL")
    args = ap.parse_args(argv)
    watched = []
    for w in args.watch:
        name, pid, log = w.split(":", 2)
        watched.append((name, int(pid), log))
    endpoints = dict(e.split("=", 1) for e in args.endpoints)

    def dead() -> list[tuple[str, str, str]]:
        return [(n, f"pid {p}", log) for n, p, log in watched if not pid_alive(p)]

    if args.watchdog <= 0:
        try:
            took = wait_healthy(endpoints, dead, args.timeout, every=args.every)
        except HealthFailure as e:
            print(f"pdtool: ERROR: {e}", file=sys.stderr, flush=True)
            return e.code
        print(f"all {len(endpoints)} endpoint(s) healthy after {took:.1f}s", flush=True)
    if args.watchdog > 0:
        logs = {n: log for n, _, log in watched}
        hung = watchdog(endpoints, logs, args.watchdog, args.failures,
                        probe_timeout=args.probe_timeout)
        if hung is not None:
            print(f"pdtool: ERROR: {hung}", file=sys.stderr, flush=True)
            if args.hung_file:
                Path(args.hung_file).write_text(hung.name + "\n")
            return hung.code
    return 0


if __name__ == "__main__":
    sys.exit(main())

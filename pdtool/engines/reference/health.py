"""A tiny HTTP side door per instance leader: `/health` for the launcher, `/stats` for tests,
`/metrics` for Prometheus (the KV messenger's counters, `metrics.py`).

The launcher waits for `GET http://host:http_port/health` of every instance's rank 0 (see
pdtool.launch.spec); the body also tells the front where the decode leader's request socket
listens, so no second port has to be planned. `/stats` returns the engine's counters (free
pages, tokens its forward passes saw) so tests check leaks on live processes.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def read_health(url: str, keys: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    """A peer's /health body once it answers 200 with every one of `keys` (a starting
    instance answers 503), polled every 0.1 s; TimeoutError after `timeout_s` (0: one try).
    The one reader of the instances' side door: the front, the decode ranks and the front's
    rediscovery all wait on it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                body = json.loads(r.read())
            if all(k in body for k in keys):
                return body
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not answer with {', '.join(keys)} within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.1)


class HealthServer:
    """`problem()` says why a ready instance cannot serve now ('' when it can), e.g. its KV
    messenger thread is stuck inside the fabric provider: /health then answers 503 with the
    reason, so whoever watches it (a load balancer, an operator, Slurm's health check) sees
    the instance is down although its process is alive."""

    def __init__(self, host: str, port: int, info: Callable[[], dict[str, Any]],
                 stats: Callable[[], dict[str, Any]],
                 problem: Callable[[], str] = lambda: "",
                 metrics: Callable[[], tuple[bytes, str]] | None = None) -> None:
        self.ready = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    if not outer.ready:
                        code, body = 503, {"status": "starting"}
                    elif reason := problem():
                        code, body = 503, {"status": "unhealthy", "reason": reason}
                    else:
                        code, body = 200, {"status": "ok", **info()}
                elif self.path == "/stats":
                    code, body = 200, stats()
                elif self.path == "/metrics" and metrics is not None:
                    self._send(200, *metrics())  # the exposition and its content type
                    return
                else:
                    code, body = 404, {"error": f"no route {self.path}"}
                self._send(code, json.dumps(body).encode(), "application/json")

            def _send(self, code: int, data: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=lambda: self.httpd.serve_forever(poll_interval=0.05), daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

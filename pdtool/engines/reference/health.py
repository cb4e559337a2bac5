"""A tiny HTTP side door per instance leader: `/health` for the launcher, `/stats` for tests.

The launcher waits for `GET http://host:http_port/health` of every instance's rank 0 (see
pdtool.launch.spec); the body also tells the front where the decode leader's request socket
listens, so no second port has to be planned. `/stats` returns the engine's counters (free
pages, tokens its forward passes saw) so tests check leaks on live processes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class HealthServer:
    """`problem()` says why a ready instance cannot serve now ('' when it can), e.g. its KV
    messenger thread is stuck inside the fabric provider: /health then answers 503 with the
    reason, so whoever watches it (a load balancer, an operator, Slurm's health check) sees
    the instance is down although its process is alive."""

    def __init__(self, host: str, port: int, info: Callable[[], dict[str, Any]],
                 stats: Callable[[], dict[str, Any]],
                 problem: Callable[[], str] = lambda: "") -> None:
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
                else:
                    code, body = 404, {"error": f"no route {self.path}"}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
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

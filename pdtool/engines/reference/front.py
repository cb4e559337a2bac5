"""The front: the OpenAI HTTP API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`)
spread over the decode instances.

Standard library only (`http.server` with a thread per connection). One dispatcher thread owns
every ZeroMQ socket (sockets are not thread-safe): HTTP threads hand it requests through an
inproc socket and wait on a per-request queue. Each decode instance pairs with its prefill
instance itself (the plan says which), so the front only picks the decode instance with the
fewest requests in flight.

Responses carry the OpenAI fields plus a `pdtool` object: token ids (byte tokens may not be
valid UTF-8 on their own), time to first token and time per output token measured here, the
decode instance, and the MTP draft verified in the first decode step.

Requests are checked before they reach the dispatcher (api.py; the prompt and `max_tokens`
against the context the decode instances publish in their /health), so one the engine cannot
take fails alone with a 400 naming the field. The dispatcher catches what one request's send
can raise and fails only that request; should it die all the same, /health answers 503 with
the reason, every waiting request fails with it, and `serve_front` exits non-zero so the
launcher stops the deployment (a front that accepts requests nobody will answer is worse).

Failure handling: the dispatcher PINGs every decode instance every `PING_S` (a HELLO instead,
until the instance answered one and again once it went silent: pdtool.engines.reference.wire)
and notes when each last answered (any message counts). One silent for `dead_after_s`
(default `DECODE_DEAD_S`) is marked down: its requests in flight fail at once with an error
naming it (HTTP 503, or an SSE error chunk when streaming) instead of waiting for
`request_timeout_s` (router.request_timeout_s), and new requests go to the instances still
up (503 when none is). It is used again as soon as it answers. A restarted instance
(launcher.restart) listens on a new address: given the instances' /health URLs, the front
reads each down instance's /health every `REDISCOVER_S` and, when it publishes a new request
socket, connects there instead (and HELLOs it: a new process is a new session).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import zmq

from . import api
from .api import BadRequest, GenRequest, parse_request
from .health import read_health
from .metrics import FrontMetrics
from .tokenizer import ByteTokenizer, HFTokenizer, StreamText
from .wire import MAX_PROMPT, PROTOCOL, Wire, WireError, dealer

__all__ = ["BadRequest", "Front", "Unavailable", "parse_request"]

log = logging.getLogger("pdtool.reference.front")
#: router.request_timeout_s's default: a backstop only, a dead decode instance is noticed
#: within seconds
REQUEST_TIMEOUT_S = 1800.0
DECODE_DEAD_S = 5.0        # a decode instance silent this long is down
PING_S = 0.25
MAX_BODY = 1 << 20
CLIENT_TIMEOUT_S = 30.0    # socket timeout while reading a request
REDISCOVER_S = 1.0         # a down instance's /health is read this often (a new address?)


class Unavailable(RuntimeError):
    """No decode instance can take the request (HTTP 503); the text says which and why."""


@dataclass
class _Pending:
    q: queue.Queue = field(default_factory=queue.Queue)
    instance: int = 0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many clients connect at once; the default 5 resets them


def engine_address(health_url: str) -> str:
    """The request socket a decode leader publishes in its /health ('' while it answers
    nothing): the front reconnects there after the instance restarted."""
    try:
        return str(read_health(health_url, ("engine",), 0)["engine"])
    except TimeoutError:
        return ""


class Front:
    """Dispatcher + HTTP server. `start()` returns once the HTTP socket listens."""

    def __init__(
        self,
        decoders: list[str],
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str = "reference",
        dead_after_s: float = DECODE_DEAD_S,
        context: int = MAX_PROMPT,
        tokenizer: ByteTokenizer | HFTokenizer | None = None,
        health_urls: list[str] | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        if not decoders:
            raise ValueError("front: needs at least one decode instance address")
        if health_urls is not None and len(health_urls) != len(decoders):
            raise ValueError("front: one /health URL per decode instance")
        self.decoders = list(decoders)
        self.health_urls = health_urls
        self.wire = Wire(secret, role="front")
        self._names = [""] * len(decoders)  # each instance's name, from its HELLO
        self.model_name = model_name
        self.context = context  # tokens a request may span (prompt + max_tokens)
        self.tokenizer = tokenizer or ByteTokenizer()
        self.problem = ""  # why the front cannot serve ('' while it can): /health shows it
        self.dead = threading.Event()  # the dispatcher died: serve_front stops the process
        self.pending: dict[str, _Pending] = {}
        self.inflight = [0] * len(decoders)
        self.up = [False] * len(decoders)
        self.dead_after_s = dead_after_s
        self.request_timeout_s = request_timeout_s
        self._heard = [0.0] * len(decoders)  # monotonic time each instance last answered
        self.metrics = FrontMetrics(lambda: sum(self.inflight), lambda: sum(self.up))
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._inbox = f"inproc://front-{uuid.uuid4().hex}"
        # LINGER 0: an item nobody will take (the dispatcher gone) must never block closing
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._inbox)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self._inbox)
        self._stop = threading.Event()
        self.httpd = _Server((host, port), _handler(self))
        self.port = self.httpd.server_address[1]
        self._threads: list[threading.Thread] = []

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        targets = [self._dispatch, lambda: self.httpd.serve_forever(poll_interval=0.05)]
        if self.health_urls:
            targets.append(self._rediscover)
        for target in targets:
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        with self._lock:
            self._push.send_pyobj(None)
        for t in self._threads:
            t.join(timeout=5)
        if not any(t.is_alive() for t in self._threads):  # else its sockets are still in use
            self._ctx.destroy(linger=0)

    @property
    def ready(self) -> bool:
        return all(self.up)

    def _rediscover(self) -> None:
        """Read each down instance's /health; a new request socket address (the instance was
        restarted) goes to the dispatcher, which reconnects its dealer there."""
        while not self._stop.wait(REDISCOVER_S):
            for i, url in enumerate(self.health_urls or ()):
                if self.up[i]:
                    continue
                address = engine_address(url)
                if address and address != self.decoders[i]:
                    log.info("front: decode instance %d listens on %s now", i, address)
                    with self._lock:
                        self._push.send_pyobj((i, "", address, "RECONNECT"))

    # -- dispatcher thread (owns the dealers) ---------------------------------------------
    def _dispatch(self) -> None:
        try:
            self._dispatch_loop()
        except Exception as exc:  # a bug: say so everywhere instead of hanging every request
            self.problem = f"the front's dispatcher thread died: {type(exc).__name__}: {exc}"
            log.exception("front: %s", self.problem)
            self._fail_all(self.problem)
            self.dead.set()

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            lost = list(self.pending.items())
        for rid, p in lost:
            p.q.put((time.perf_counter(), {"rid": rid, "tokens": [], "done": True,
                                           "info": {"error": reason, "unavailable": True}}))

    def _fail(self, rid: str, reason: str) -> None:
        p = self.pending.get(rid)
        if p is not None:
            p.q.put((time.perf_counter(), {"rid": rid, "tokens": [], "done": True,
                                           "info": {"error": reason}}))

    def _dispatch_loop(self) -> None:
        socks = [dealer(self._ctx, a, self.wire) for a in self.decoders]
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        for s in socks:
            poller.register(s, zmq.POLLIN)
        next_ping = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    for i, s in enumerate(socks):  # HELLO until answered (again)
                        frames = (self.wire.pack("PING", {"rid": "ping", "tokens": []},
                                                 peer=self._names[i])
                                  if self.up[i] else self.wire.pack("HELLO", self.wire.hello()))
                        with contextlib.suppress(zmq.Again):  # a stalled peer: it goes down
                            s.send_multipart(frames, zmq.NOBLOCK)
                    next_ping = now + PING_S
                    self._check_dead(now)
                events = dict(poller.poll(int(PING_S * 1000)))
                if self._pull in events:
                    while True:
                        try:
                            item = self._pull.recv_pyobj(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if item is None:
                            return
                        idx, rid, body, kind = item
                        if kind == "RECONNECT":  # a restarted instance: a new socket
                            poller.unregister(socks[idx])
                            socks[idx].close(0)
                            socks[idx] = dealer(self._ctx, body, self.wire)
                            poller.register(socks[idx], zmq.POLLIN)
                            self.decoders[idx], self._names[idx] = body, ""
                            continue
                        try:
                            frames = self.wire.pack(kind, body, peer=self._names[idx])
                            socks[idx].send_multipart(frames, zmq.NOBLOCK)
                        except WireError as exc:  # no HELLO from it yet: cannot happen for up
                            self._fail(rid, f"decode instance {idx}: {kind} not sent: {exc}")
                        except zmq.Again:
                            self._fail(rid, f"decode instance {idx}: its request queue is full")
                        except zmq.ZMQError as exc:
                            self._fail(rid, f"decode instance {idx}: sending failed ({exc})")
                for i, s in enumerate(socks):
                    if s in events:
                        self._drain(i, s)
        finally:
            for s in socks:
                s.close(0)

    def _check_dead(self, now: float) -> None:
        """Mark instances silent for `dead_after_s` down and fail their requests now."""
        for i, up in enumerate(self.up):
            if not up or now - self._heard[i] <= self.dead_after_s:
                continue
            self.up[i] = False
            reason = (f"decode instance {i} stopped answering (silent for more than "
                      f"{self.dead_after_s:.1f} s)")
            log.warning("front: %s; failing its requests", reason)
            with self._lock:
                lost = [(rid, p) for rid, p in self.pending.items() if p.instance == i]
            for rid, p in lost:
                p.q.put((time.perf_counter(), {"rid": rid, "tokens": [], "done": True,
                                               "info": {"error": reason, "unavailable": True}}))

    def _drain(self, idx: int, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            got = self.wire.unpack(frames, ("HELLO", "OUT", "PONG"))
            if got is None:
                continue
            kind, body = got
            self._heard[idx] = time.monotonic()
            if kind == "HELLO":
                self._names[idx] = self.wire.last_sender
            if kind in ("HELLO", "PONG"):
                if not self.up[idx]:
                    log.info("front: decode instance %d is up", idx)
                self.up[idx] = True
                continue
            p = self.pending.get(body["rid"])
            if p is not None:
                p.q.put((time.perf_counter(), body))

    # -- called from HTTP threads ------------------------------------------------------------
    def submit(self, tokens: list[int], max_tokens: int,
               sampling: dict | None = None) -> tuple[str, _Pending]:
        """Queue one request for the dispatcher (signed here: a body the wire refuses fails
        this request only, as a BadRequest naming the field)."""
        rid = uuid.uuid4().hex
        body: dict[str, Any] = {"rid": rid, "tokens": tokens, "max_tokens": max_tokens}
        if sampling is not None:
            body["sampling"] = sampling
        try:
            PROTOCOL.schemas["GEN"]("GEN", body)  # signed by the dispatcher, bound to the peer
        except WireError as exc:
            raise BadRequest(str(exc)) from None
        with self._lock:
            if self.problem:
                raise Unavailable(self.problem)
            turn = next(self._rr)
            n = len(self.decoders)
            live = [i for i in range(n) if self.up[i]]
            if not live:
                raise Unavailable(f"no decode instance is up ({n} configured; they have not "
                                  f"answered within {self.dead_after_s:.1f} s)")
            idx = min(live, key=lambda i: (self.inflight[i], (i - turn) % n))
            self.inflight[idx] += 1
            p = _Pending(instance=idx)
            self.pending[rid] = p
            self._push.send_pyobj((idx, rid, body, "GEN"))
        return rid, p

    def cancel(self, rid: str) -> None:
        """The client went away: tell its decode instance to drop the request (frees its
        pages and batch slot at once instead of generating for nobody)."""
        with self._lock:
            p = self.pending.get(rid)
            if p is not None:
                self._push.send_pyobj((p.instance, rid, {"rid": rid, "tokens": []}, "CANCEL"))

    def finish(self, rid: str) -> None:
        with self._lock:
            p = self.pending.pop(rid, None)
            if p is not None:
                self.inflight[p.instance] -= 1

    def results(self, rid: str, p: _Pending):
        """(time, OUT body) of a submitted request until done; always `finish`es it."""
        try:
            deadline = time.monotonic() + self.request_timeout_s
            while True:
                try:
                    t, body = p.q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"no answer from decode instance {p.instance} within "
                        f"{self.request_timeout_s:g} s (router.request_timeout_s)") from None
                body["instance"] = p.instance
                yield t, body
                if body["done"]:
                    return
        finally:
            self.finish(rid)


def _handler(front: Front) -> type[BaseHTTPRequestHandler]:
    routes = {"/v1/completions": False, "/v1/chat/completions": True}

    class Handler(BaseHTTPRequestHandler):
        server_version = "pdtool-reference"
        timeout = CLIENT_TIMEOUT_S  # a client that stops sending mid-request is dropped

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _json(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_response(self, code: int, message: str | None = None) -> None:
            if self.command == "POST":  # every answer to a request, errors included
                front.metrics.answered(code)
            super().send_response(code, message)

        def _error(self, code: int, msg: str, kind: str = "invalid_request_error") -> None:
            self._json(code, {"error": {"message": msg, "type": kind, "code": code}})

        def do_GET(self) -> None:
            model = {"id": front.model_name, "object": "model", "created": 0,
                     "owned_by": "pdtool"}
            if self.path == "/health":
                up = sum(front.up)
                if front.problem:
                    code, status = 503, {"status": "unhealthy", "reason": front.problem}
                else:
                    code = 200 if front.ready else 503
                    status = {"status": "ok" if code == 200 else "starting"}
                self._json(code, {**status, "decode_instances": len(front.up), "decode_up": up,
                                  "context": front.context})
            elif self.path == "/metrics":
                data, kind = front.metrics.render()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [model]})
            elif self.path == f"/v1/models/{front.model_name}":
                self._json(200, model)
            else:
                self._error(404, f"no route {self.path}", "not_found_error")

        def do_POST(self) -> None:
            chat = routes.get(self.path)
            if chat is None:
                self._error(404, f"no route {self.path}", "not_found_error")
                return
            try:
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    raise BadRequest("Content-Length: expected a number of bytes") from None
                if n > MAX_BODY:
                    raise BadRequest(f"body: larger than {MAX_BODY} bytes")
                if n < 0:  # read(-1) would wait for the client to close the connection
                    raise BadRequest("Content-Length: must not be negative")
                req = parse_request(self.rfile.read(n), front.tokenizer, chat)
                req.fit(front.context)  # the one model served answers whatever name is sent
            except BadRequest as exc:
                self._error(400, str(exc))
                return
            t0 = time.perf_counter()
            try:
                if req.stream:
                    self._stream(req, t0)
                else:
                    self._whole(req, t0)
            except BadRequest as exc:
                self._error(400, str(exc))
            except TimeoutError as exc:
                self._error(504, str(exc), "timeout")
            except Unavailable as exc:
                self._error(503, str(exc), "unavailable")
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception as exc:  # one request's bug never costs the others
                log.exception("front: request failed")
                with contextlib.suppress(OSError):
                    self._error(500, f"internal error: {type(exc).__name__}: {exc}",
                                "server_error")

        def _whole(self, req: GenRequest, t0: float) -> None:
            rid, pending = front.submit(req.tokens, req.max_tokens, req.sampling)
            out = _Output(front, req)
            for t, body in front.results(rid, pending):
                out.add(t, body)
                if out.stopped and not body["done"]:
                    front.cancel(rid)  # a stop string matched: the decoder can stop too
                    break
            if "error" in out.info:
                code, kind = (503, "unavailable") if out.info.get("unavailable") else \
                    (500, "server_error")
                self._error(code, f"decode instance {out.instance}: {out.info['error']}", kind)
                return
            self._json(200, api.whole(req, api.new_id(req.chat), front.model_name, out.text,
                                      out.finish, len(out.tokens), out.extra(t0)))
            _served(front, req, out, t0)

        def _stream(self, req: GenRequest, t0: float) -> None:
            rid, pending = front.submit(req.tokens, req.max_tokens, req.sampling)
            try:  # 503/400 above come before any header
                self._stream_results(req, t0, rid, front.results(rid, pending))
            except (BrokenPipeError, ConnectionResetError):
                front.cancel(rid)
                raise
            finally:
                front.finish(rid)  # also when the client went away before the first token

        def _send(self, obj: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def _stream_results(self, req: GenRequest, t0: float, rid: str, results) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            out = _Output(front, req)
            cid, model, first = api.new_id(req.chat), front.model_name, True
            for t, body in results:
                text = out.add(t, body)
                if "error" in out.info:  # OpenAI streams errors as data
                    self._send({"error": {"message": f"decode instance {out.instance}: "
                                                     f"{out.info['error']}",
                                          "type": "server_error"}})
                    break
                done = body["done"] or out.stopped
                extra = {"token_ids": body["tokens"]}
                if done:
                    extra = out.extra(t0) | extra
                    _served(front, req, out, t0)
                if text or done or body["tokens"]:
                    self._send(api.chunk(req, cid, model, text, out.finish if done else None,
                                         extra, first))
                    first = False
                if done:
                    if not body["done"]:
                        front.cancel(rid)
                    if req.include_usage:
                        self._send(api.chunk(req, cid, model, None, None) |
                                   {"usage": api.usage(req, len(out.tokens))})
                    break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


class _Output:
    """One response's tokens and text as they arrive: detokenized incrementally, cut at the
    first stop string (text that could start one is held back until it cannot)."""

    def __init__(self, front: Front, req: GenRequest) -> None:
        self.req = req
        self.stream = StreamText(front.tokenizer)
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.text = ""  # released so far
        self._held = ""
        self.stopped = False
        self.info: dict = {}
        self.instance = 0

    def add(self, t: float, body: dict) -> str:
        """Returns the text released by this OUT message."""
        self.instance = body.get("instance", self.instance)
        if body["done"]:
            self.info = body["info"]
        if self.stopped or (not body["tokens"] and not body["done"]):
            return ""
        if body["tokens"]:
            self.times.append(t)
        self.tokens += body["tokens"]
        pending = self._held + self.stream.push(body["tokens"], final=body["done"])
        release, self._held = self._cut(pending, final=body["done"])
        self.text += release
        return release

    def _cut(self, text: str, final: bool) -> tuple[str, str]:
        stops = self.req.stop
        if not stops:
            return text, ""
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            self.stopped = True
            return text[: min(hits)], ""
        if final:
            return text, ""
        keep = 0  # longest tail that is a prefix of some stop string
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        return text[: len(text) - keep], text[len(text) - keep:]

    @property
    def finish(self) -> str:
        if self.stopped:
            return "stop"
        return "length" if len(self.tokens) >= (self.req.max_tokens or 0) else "stop"

    def extra(self, t0: float) -> dict:
        return {"token_ids": self.tokens, "decode_instance": self.instance,
                **_timing(t0, self.times, len(self.tokens)), **self.info}


def _served(front: Front, req: GenRequest, out: _Output, t0: float) -> None:
    """One request answered in full: into the metrics, and one line in the front's log."""
    t = _timing(t0, out.times, len(out.tokens))
    seconds = time.perf_counter() - t0
    front.metrics.served(len(req.tokens), len(out.tokens), seconds, t["ttft_s"], t["tpot_s"])
    log.info("request: %d prompt + %d output tokens, decode %d, TTFT %s, TPOT %s, total %.1f ms",
             len(req.tokens), len(out.tokens), out.instance, _ms(t["ttft_s"]), _ms(t["tpot_s"]),
             seconds * 1e3)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _timing(t0: float, times: list[float], n: int) -> dict:
    if not times:
        return {"ttft_s": None, "tpot_s": None}
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return {"ttft_s": times[0] - t0, "tpot_s": tpot}

"""The front: OpenAI-style HTTP `/v1/completions` spread over the decode instances.

Standard library only (`http.server` with a thread per connection). One dispatcher thread owns
every ZeroMQ socket (sockets are not thread-safe): HTTP threads hand it requests through an
inproc socket and wait on a per-request queue. Each decode instance pairs with its prefill
instance itself (the plan says which), so the front only picks the decode instance with the
fewest requests in flight.

Responses carry the OpenAI fields plus a `pdtool` object: token ids (byte tokens may not be
valid UTF-8 on their own), time to first token and time per output token measured here, the
decode instance, and the MTP draft verified in the first decode step.

Failure handling: the dispatcher PINGs every decode instance every `PING_S` (a HELLO instead,
until the instance answered one and again once it went silent: pdtool.engines.reference.wire)
and notes when each last answered (any message counts). One silent for `dead_after_s`
(default `DECODE_DEAD_S`) is marked down: its requests in flight fail at once with an error
naming it (HTTP 503, or an SSE error chunk when streaming) instead of waiting for
`REQUEST_TIMEOUT_S`, and new requests go to the instances still up (503 when none is). It is
used again as soon as it answers.
"""

from __future__ import annotations

import codecs
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

from .tokens import decode as detok
from .tokens import encode
from .wire import Wire, WireError, dealer

log = logging.getLogger("pdtool.reference.front")
REQUEST_TIMEOUT_S = 300.0  # backstop only: a dead decode instance is noticed within seconds
DECODE_DEAD_S = 5.0        # a decode instance silent this long is down
PING_S = 0.25
MAX_BODY = 1 << 20
CLIENT_TIMEOUT_S = 30.0    # socket timeout while reading a request


class BadRequest(ValueError):
    """A request the front refuses with HTTP 400; the text names the field."""


class Unavailable(RuntimeError):
    """No decode instance can take the request (HTTP 503); the text says which and why."""


@dataclass
class _Pending:
    q: queue.Queue = field(default_factory=queue.Queue)
    instance: int = 0


def parse_request(body: bytes) -> dict[str, Any]:
    """Validate a /v1/completions body; returns prompt tokens, max_tokens, stream."""
    try:
        req = json.loads(body or b"{}")
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body: not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise BadRequest("body: not valid JSON (not UTF-8/16/32 text)") from None
    except RecursionError:
        raise BadRequest("body: JSON nested too deeply") from None
    if not isinstance(req, dict):
        raise BadRequest("body: expected a JSON object")
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 256 for t in prompt
    ):
        tokens = list(prompt)
    else:
        raise BadRequest("prompt: expected a string or a list of byte token ids (0..255)")
    if not tokens:
        raise BadRequest("prompt: must not be empty")
    max_tokens = req.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not (
        1 <= max_tokens <= 4096
    ):
        raise BadRequest("max_tokens: expected an integer in [1, 4096]")
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected true or false")
    return {"tokens": tokens, "max_tokens": max_tokens, "stream": stream,
            "model": str(req.get("model", "reference"))}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many clients connect at once; the default 5 resets them


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
    ) -> None:
        if not decoders:
            raise ValueError("front: needs at least one decode instance address")
        self.decoders = decoders
        self.wire = Wire(secret, role="front")
        self._names = [""] * len(decoders)  # each instance's name, from its HELLO
        self.model_name = model_name
        self.pending: dict[str, _Pending] = {}
        self.inflight = [0] * len(decoders)
        self.up = [False] * len(decoders)
        self.dead_after_s = dead_after_s
        self._heard = [0.0] * len(decoders)  # monotonic time each instance last answered
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._inbox = f"inproc://front-{uuid.uuid4().hex}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inbox)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self._inbox)
        self._stop = threading.Event()
        self.httpd = _Server((host, port), _handler(self))
        self.port = self.httpd.server_address[1]
        self._threads: list[threading.Thread] = []

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for target in (self._dispatch, lambda: self.httpd.serve_forever(poll_interval=0.05)):
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

    @property
    def ready(self) -> bool:
        return all(self.up)

    # -- dispatcher thread (owns the dealers) ---------------------------------------------
    def _dispatch(self) -> None:
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
                        s.send_multipart(
                            self.wire.pack("PING", {"rid": "ping", "tokens": []},
                                           peer=self._names[i])
                            if self.up[i] else self.wire.pack("HELLO", self.wire.hello()))
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
                        idx, body, kind = item
                        try:
                            frames = self.wire.pack(kind, body, peer=self._names[idx])
                        except WireError as exc:  # no HELLO from it yet: cannot happen for up
                            log.warning("front: %s to decode instance %d not sent: %s", kind,
                                        idx, exc)
                            continue
                        socks[idx].send_multipart(frames)
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
    def submit(self, tokens: list[int], max_tokens: int) -> tuple[str, _Pending]:
        rid = uuid.uuid4().hex
        with self._lock:
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
            self._push.send_pyobj((idx, {"rid": rid, "tokens": tokens, "max_tokens": max_tokens},
                                   "GEN"))
        return rid, p

    def cancel(self, rid: str) -> None:
        """The client went away: tell its decode instance to drop the request (frees its
        pages and batch slot at once instead of generating for nobody)."""
        with self._lock:
            p = self.pending.get(rid)
            if p is not None:
                self._push.send_pyobj((p.instance, {"rid": rid, "tokens": []}, "CANCEL"))

    def finish(self, rid: str) -> None:
        with self._lock:
            p = self.pending.pop(rid, None)
            if p is not None:
                self.inflight[p.instance] -= 1

    def generate(self, tokens: list[int], max_tokens: int):
        """Yield (time, OUT body) for one request until done (raises Unavailable when no
        decode instance is up, TimeoutError at the backstop)."""
        rid, p = self.submit(tokens, max_tokens)
        yield from self.results(rid, p)

    def results(self, rid: str, p: _Pending):
        """(time, OUT body) of a submitted request until done; always `finish`es it."""
        try:
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while True:
                try:
                    t, body = p.q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"no answer from decode instance {p.instance}") from None
                body["instance"] = p.instance
                yield t, body
                if body["done"]:
                    return
        finally:
            self.finish(rid)


def _handler(front: Front) -> type[BaseHTTPRequestHandler]:
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

        def _error(self, code: int, msg: str, kind: str = "invalid_request_error") -> None:
            self._json(code, {"error": {"message": msg, "type": kind}})

        def do_GET(self) -> None:
            if self.path == "/health":
                up = sum(front.up)
                code = 200 if front.ready else 503
                self._json(code, {"status": "ok" if code == 200 else "starting",
                                  "decode_instances": len(front.up), "decode_up": up})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [
                    {"id": front.model_name, "object": "model", "owned_by": "pdtool"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._error(404, f"no route {self.path}")
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
                req = parse_request(self.rfile.read(n))
            except (BadRequest, ValueError) as exc:
                self._error(400, str(exc))
                return
            t0 = time.perf_counter()
            try:
                if req["stream"]:
                    self._stream(req, t0)
                else:
                    self._whole(req, t0)
            except TimeoutError as exc:
                self._error(504, str(exc), "timeout")
            except Unavailable as exc:
                self._error(503, str(exc), "unavailable")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _whole(self, req: dict, t0: float) -> None:
            toks, times, info, inst = [], [], {}, 0
            for t, body in front.generate(req["tokens"], req["max_tokens"]):
                if body["tokens"]:
                    times.append(t)
                toks += body["tokens"]
                info, inst = body["info"], body["instance"]
            if "error" in info:
                code, kind = (503, "unavailable") if info.get("unavailable") else \
                    (500, "server_error")
                self._error(code, f"decode instance {inst}: {info['error']}", kind)
                return
            self._json(200, _completion(front, req, toks, _timing(t0, times, len(toks)),
                                        info, inst))

        def _stream(self, req: dict, t0: float) -> None:
            rid, pending = front.submit(req["tokens"], req["max_tokens"])  # 503 before headers
            try:
                self._stream_results(req, t0, front.results(rid, pending))
            except (BrokenPipeError, ConnectionResetError):
                front.cancel(rid)
                raise
            finally:
                front.finish(rid)  # also when the client went away before the first token

        def _stream_results(self, req: dict, t0: float, results) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
            toks: list[int] = []
            times: list[float] = []
            rid = f"cmpl-{uuid.uuid4().hex}"
            for t, body in results:
                if body["done"] and "error" in body["info"]:  # OpenAI streams errors as data
                    err = {"error": {"message": f"decode instance {body['instance']}: "
                                                f"{body['info']['error']}", "type": "server_error"}}
                    self.wfile.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                    break
                if body["tokens"]:
                    times.append(t)
                toks += body["tokens"]
                text = dec.decode(bytes(x for x in body["tokens"] if x < 256), final=body["done"])
                chunk = {"id": rid, "object": "text_completion", "created": int(time.time()),
                         "model": req["model"], "choices": [{"index": 0, "text": text,
                         "finish_reason": None, "logprobs": None}],
                         "pdtool": {"token_ids": body["tokens"]}}
                if body["done"]:
                    info = body["info"]
                    chunk["choices"][0]["finish_reason"] = _finish(req, toks)
                    chunk["pdtool"].update(_timing(t0, times, len(toks)), **info,
                                           decode_instance=body["instance"])
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


def _finish(req: dict, toks: list[int]) -> str:
    return "length" if len(toks) >= req["max_tokens"] else "stop"


def _timing(t0: float, times: list[float], n: int) -> dict:
    if not times:
        return {"ttft_s": None, "tpot_s": None}
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return {"ttft_s": times[0] - t0, "tpot_s": tpot}


def _completion(front: Front, req: dict, toks: list[int], timing: dict, info: dict,
                inst: int) -> dict:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req["model"],
        "choices": [{"index": 0, "text": detok(toks), "finish_reason": _finish(req, toks),
                     "logprobs": None}],
        "usage": {"prompt_tokens": len(req["tokens"]), "completion_tokens": len(toks),
                  "total_tokens": len(req["tokens"]) + len(toks)},
        "pdtool": {"token_ids": toks, "decode_instance": inst, **timing, **info},
    }


def serve_front(front: Front, stop: threading.Event) -> None:
    """Run until `stop` is set (the worker entry's SIGTERM handler sets it)."""
    front.start()
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    front.stop()

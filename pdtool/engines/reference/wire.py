"""Front ↔ decode-leader messages: msgpack over ZeroMQ, HMAC-SHA256 signed.

Same rules as the messenger's control plane (transfer/control.py): the MAC is checked before a
byte of the body is decoded, then every field is checked, and a refused message is dropped and
counted, never raised into the serving loop. Every message also carries a timestamp and a
random nonce under the MAC; a message older than the replay window, or whose nonce was seen
within it, is refused (transfer.control.ReplayGuard), so a captured GEN cannot be replayed to
re-run a request and receive its output. Only these kinds travel here:
  * GEN (front → decoder): {"rid": str, "tokens": [token id], "max_tokens": int}, optional
    "sampling": {"temperature": float >= 0, "top_p": float in (0, 1], "seed": int} (absent or
    temperature 0: greedy)
  * OUT (decoder → front): {"rid": str, "tokens": [token id], "done": bool, "info": {...}}
  * PING (front → decoder) / PONG (decoder → front): {"rid": str, "tokens": []}, so the front
    knows which decode instances are up (its /health) without the decoder knowing the front.
  * CANCEL (front → decoder): {"rid": str, "tokens": []}: the client went away; honoured only
    from the socket that sent the GEN.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from typing import Any

import msgpack
import zmq

from transfer.control import ControlError, ReplayGuard, check_secret

log = logging.getLogger("pdtool.reference.wire")
MAX_BYTES = 4 << 20
MAX_PROMPT = 1 << 16
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are vocabulary rows: any checkpoint's vocabulary fits
REPLAY_WINDOW_S = 30.0


class WireError(ValueError):
    """A message refused by the receiver; the text names the field."""


def _check(kind: str, body: Any) -> dict:
    if not isinstance(body, dict):
        raise WireError(f"{kind}: body must be a map")
    rid = body.get("rid")
    if not isinstance(rid, str) or not 0 < len(rid) <= 128:
        raise WireError(f"{kind}.rid: expected a non-empty string")
    toks = body.get("tokens")
    if not isinstance(toks, list) or len(toks) > MAX_PROMPT or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in toks
    ):
        raise WireError(f"{kind}.tokens: expected a list of at most {MAX_PROMPT} token ids")
    if kind == "GEN":
        mt = body.get("max_tokens")
        if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= 1 << 16:
            raise WireError("GEN.max_tokens: expected an int in [1, 65536]")
        if not toks:
            raise WireError("GEN.tokens: expected 1 or more token ids")
        _check_sampling(body.get("sampling"))
        faults = body.get("faults")
        if faults is not None and not (
            isinstance(faults, dict) and set(faults) <= {"page", "hidden"}
        ):
            raise WireError("GEN.faults: expected a map with 'page' and/or 'hidden'")
    elif kind in ("PING", "PONG", "CANCEL"):
        pass
    elif kind == "OUT":
        if not isinstance(body.get("done"), bool) or not isinstance(body.get("info"), dict):
            raise WireError("OUT.done/info: expected a bool and a map")
    else:
        raise WireError(f"kind: unknown message kind {kind!r}")
    return body


def _check_sampling(sampling: Any) -> None:
    if sampling is None:
        return
    if not isinstance(sampling, dict) or not set(sampling) <= {"temperature", "top_p", "seed"}:
        raise WireError("GEN.sampling: expected a map of temperature, top_p, seed")
    temp, top_p = sampling.get("temperature", 0.0), sampling.get("top_p", 1.0)
    if not isinstance(temp, float | int) or isinstance(temp, bool) or not 0 <= temp <= 100:
        raise WireError("GEN.sampling.temperature: expected a number in [0, 100]")
    if not isinstance(top_p, float | int) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise WireError("GEN.sampling.top_p: expected a number in (0, 1]")
    seed = sampling.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
        raise WireError("GEN.sampling.seed: expected an integer in [0, 2**63)")


class Wire:
    """Encode/verify signed messages for one deployment secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = check_secret(secret)
        self.rejected = 0
        self.replay = ReplayGuard(REPLAY_WINDOW_S)

    def __repr__(self) -> str:  # never show the secret
        return "Wire()"

    def pack(self, kind: str, body: dict) -> list[bytes]:
        payload = msgpack.packb({"k": kind, "b": _check(kind, body), "t": time.time(),
                                 "n": secrets.token_bytes(16)}, use_bin_type=True)
        return [payload, hmac.new(self._secret, payload, hashlib.sha256).digest()]

    def unpack(self, frames: list[bytes], kinds: tuple[str, ...]) -> tuple[str, dict] | None:
        """(kind, checked body), or None (logged and counted) if the message is refused."""
        try:
            if len(frames) != 2 or len(frames[0]) > MAX_BYTES:
                raise WireError("frames: expected [payload, mac] within the size limit")
            mac = hmac.new(self._secret, frames[0], hashlib.sha256).digest()
            if not hmac.compare_digest(mac, frames[1]):
                raise WireError("mac: signature does not match the deployment secret")
            try:
                raw = msgpack.unpackb(frames[0], raw=False)
            except Exception as exc:  # msgpack raises several types on malformed input
                raise WireError(f"payload: not msgpack ({type(exc).__name__})") from None
            if not isinstance(raw, dict) or raw.get("k") not in kinds:
                raise WireError(f"kind: expected one of {kinds}")
            ts, nonce = raw.get("t"), raw.get("n")
            if not isinstance(ts, float) or not isinstance(nonce, bytes) or len(nonce) != 16:
                raise WireError("t/n: expected a timestamp and a 16-byte nonce")
            try:
                self.replay.check(ts, nonce, time.time())
            except ControlError as exc:
                raise WireError(str(exc)) from None
            return raw["k"], _check(raw["k"], raw.get("b"))
        except WireError as exc:
            self.rejected += 1
            log.warning("refused a message: %s", exc)
            return None


def router(ctx: zmq.Context, host: str, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + 1024)
    sock.bind(f"tcp://{host}:{port}")
    return sock


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + 1024)
    sock.connect(address)
    return sock

"""Front ↔ decode-leader messages of the reference engine, in transfer.wire's envelope.

The envelope (transfer/wire/envelope.py) signs every message with the deployment secret,
checks the MAC before a byte of the body is decoded, then the version, the session binding
and sequence number (a captured GEN replayed — to this run or to a restarted decoder — is
refused, with no clock involved, so it cannot re-run a request and receive its output), then
every field. A refused message is dropped, logged and counted, never raised into the serving
loop. Messages (transfer/wire/PROTOCOL.md has the full table):
  * HELLO (front → decoder, answered by the decoder bound to the front's session): the limits
    every GEN is checked against and their compatibility hash, once per connection; the front
    sends HELLO in place of PING until an instance answered, and again once it went silent.
  * GEN (front → decoder): {"rid": str, "tokens": [token id], "max_tokens": int}, optional
    "sampling": {"temperature": float >= 0, "top_p": float in (0, 1], "seed": int} (absent or
    temperature 0: greedy), optional "faults": {"page"?: [layer, index], "hidden"?: bool}
  * OUT (decoder → front): {"rid": str, "tokens": [token id], "done": bool, "info": {...}}
  * PING (front → decoder) / PONG (decoder → front): {"rid": str, "tokens": []}, so the front
    knows which decode instances are up (its /health) without the decoder knowing the front.
  * CANCEL (front → decoder): {"rid": str, "tokens": []}: the client went away; honoured only
    from the socket that sent the GEN.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

import zmq

from transfer.wire import (
    Envelope,
    Protocol,
    WireError,
    bool_field,
    bytes_field,
    compat_hash,
    first_difference,
    float_field,
    int_field,
    list_field,
    map_field,
    optional,
    str_field,
)

log = logging.getLogger("pdtool.reference.wire")
MAX_BYTES = 4 << 20
MAX_PROMPT = 1 << 16
MAX_TOKENS = 1 << 16
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are vocabulary rows: any checkpoint's vocabulary fits
# what every GEN is checked against; a front and decoder that differ here refuse each other
FACTS = {"token_ids": f"0..{MAX_TOKEN_ID}", "max_prompt": MAX_PROMPT, "max_tokens": MAX_TOKENS}


def _any_map(path: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise WireError(f"{path}: expected a map, got {type(v).__name__}")
    return v


_RID = str_field(128, min_len=1)
_NONE = list_field(int_field(0, 0), 0)
_ID = map_field({"rid": _RID, "tokens": _NONE})
_TOKENS = list_field(int_field(0, MAX_TOKEN_ID), MAX_PROMPT)
_SAMPLING = map_field({"temperature": float_field(0.0, 100.0), "top_p": float_field(1e-9, 1.0),
                       "seed": int_field(0, (1 << 63) - 1)},
                      frozenset({"temperature", "top_p", "seed"}))
_FAULTS = map_field({"page": optional(list_field(int_field(0), 2, 2)), "hidden": bool_field()},
                    frozenset({"page", "hidden"}))
PROTOCOL = Protocol("reference", {
    "HELLO": map_field({"role": str_field(8, ("front", "decode")), "compat": bytes_field(16, 1, 16),
                        "max_prompt": int_field(1, 1 << 31), "max_tokens": int_field(1, 1 << 31),
                        "error": str_field(1024)}),
    "GEN": map_field({"rid": _RID, "tokens": list_field(int_field(0, MAX_TOKEN_ID), MAX_PROMPT, 1),
                      "max_tokens": int_field(1, MAX_TOKENS), "sampling": optional(_SAMPLING),
                      "faults": optional(_FAULTS)},
                     frozenset({"sampling", "faults"})),
    "OUT": map_field({"rid": _RID, "tokens": _TOKENS, "done": bool_field(), "info": _any_map}),
    "PING": _ID, "PONG": _ID, "CANCEL": _ID,
})


class Wire:
    """Encode/verify signed messages for one deployment secret and one process (its session).
    `last_sender`/`last_session` name the sender of the latest accepted message, so a HELLO
    can be answered bound to it."""

    def __init__(self, secret: bytes, name: str | None = None, role: str = "front") -> None:
        name = name or f"{role}-{os.getpid()}-{secrets.token_hex(3)}"
        self.envelope = Envelope(secret, name, PROTOCOL, max_bytes=MAX_BYTES)
        self.role = role
        self.rejected = 0
        self.last_sender = ""
        self.last_session = b""

    def __repr__(self) -> str:  # never show the secret
        return f"Wire({self.name!r})"

    @property
    def name(self) -> str:
        return self.envelope.sender

    def hello(self, error: str = "") -> dict:
        return {"role": self.role, "compat": compat_hash(FACTS), "max_prompt": MAX_PROMPT,
                "max_tokens": MAX_TOKENS, "error": error}

    def pack(self, kind: str, body: dict, peer: str | bytes | None = None,
             session: bytes | None = None) -> list[bytes]:
        """Frames for `kind`, bound to `session` or else to the session `peer` (a name or
        routing id) is known under; HELLO alone may go unbound. WireError when the body is
        invalid or a kind that needs a binding has none (no HELLO from that peer yet)."""
        if session is None:
            name = peer.decode(errors="replace") if isinstance(peer, bytes) else peer
            session = self.envelope.session_of(name) if name else b""
        return self.envelope.seal(kind, body, session)

    def unpack(self, frames: list[bytes], kinds: tuple[str, ...],
               peer: bytes | None = None) -> tuple[str, dict] | None:
        """(kind, checked body), or None (logged and counted) if the message is refused.
        `peer`: the routing id a ROUTER saw, which the signed sender must equal. A HELLO
        whose limits differ from ours is refused here, naming the first difference."""
        try:
            if len(frames) != 2 or len(frames[0]) > MAX_BYTES:
                raise WireError("frames: expected [payload, mac] within the size limit")
            msg = self.envelope.open(frames, peer.decode(errors="replace")
                                     if peer is not None else None)
            if msg.type not in kinds:
                raise WireError(f"kind: expected one of {kinds}, got {msg.type!r}")
            if msg.type == "HELLO":
                h = msg.body
                if h["error"]:
                    raise WireError(f"HELLO: the peer refused us: {h['error']}")
                theirs = {**FACTS, "max_prompt": h["max_prompt"], "max_tokens": h["max_tokens"]}
                diff = first_difference(FACTS, theirs)
                if diff or h["compat"] != compat_hash(FACTS):
                    raise WireError(f"HELLO: {diff or 'compat: hash differs'}")
        except WireError as exc:
            self.rejected += 1
            log.warning("refused a message: %s", exc)
            return None
        self.last_sender, self.last_session = msg.sender, msg.session
        return msg.type, msg.body

    def handshake(self, sock: zmq.Socket, timeout_s: float = 10.0) -> str:
        """A blocking client's HELLO on a `dealer` socket: returns the decoder's name, after
        which messages to it are bound (`pack(kind, body, peer=name)`)."""
        sock.send_multipart(self.pack("HELLO", self.hello()))
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if sock.poll(50) and self.unpack(sock.recv_multipart(), ("HELLO",)) is not None:
                return self.last_sender
        raise WireError(f"HELLO: no answer from the decoder within {timeout_s:.0f} s")


def router(ctx: zmq.Context, host: str, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + 1024)
    sock.bind(f"tcp://{host}:{port}")
    return sock


def dealer(ctx: zmq.Context, address: str, wire: Wire) -> zmq.Socket:
    """A socket to one decoder whose routing id is the wire's name (the decoder checks that
    a message's signed sender is the socket that sent it)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES + 1024)
    sock.setsockopt(zmq.ROUTING_ID, wire.name.encode())
    sock.connect(address)
    return sock

"""One signed ZeroMQ socket (ROUTER or DEALER) carrying one protocol's envelopes.

Bad messages are dropped: `recv` returns only valid ones, `rejected` counts the rest and
`last_error` keeps the latest reason (also logged). A ROUTER's messages carry the peer's
routing id, which must equal the signed `from` (so a peer cannot answer for another); a
DEALER has one peer, whose name it learns from the first valid message. `send` binds each
message to the receiver's session (transfer.wire.envelope); a message that needs a binding
the channel does not have yet (no HELLO from that peer) is not sent, and counted in `unsent`.
Listeners bind to a configured interface (default 127.0.0.1), never to every interface
unless explicitly allowed.

Fault injection (tests only): `ControlFaults` drops or delays OUTGOING messages of chosen types,
so the fault suite can lose a REQUEST, an ABORTED or a PONG, or hold one back past a timeout. It
is off unless a channel is given one or the process environment sets `PDTOOL_CONTROL_FAULTS`
(e.g. `drop=REQUEST:0.5,delay=PONG:1.5,seed=3`); a disabled hook costs one `is None` test per
send and nothing on the data path.

Sockets are not thread-safe: each `Channel` belongs to the thread that polls it.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from .envelope import Envelope, Message
from .fields import WireError
from .messenger import MESSENGER

_ANY_HOSTS = ("0.0.0.0", "*", "::", "[::]")
FAULTS_ENV = "PDTOOL_CONTROL_FAULTS"

log = logging.getLogger("transfer.wire")


def check_bind_host(host: str, allow_any: bool = False) -> str:
    if not isinstance(host, str) or not host:
        raise WireError("bind_host: expected an interface address such as 127.0.0.1")
    if host in _ANY_HOSTS and not allow_any:
        raise WireError(f"bind_host: {host!r} listens on every interface; give the address "
                        f"of the interface peers use (or allow it explicitly)")
    return host


@dataclass
class ControlFaults:
    """Test hook: drop (with a probability) or delay (by seconds) outgoing messages by type.

    `log` records every action as `(action, type, rid)` (rid "" for bodies without one), so a
    test knows exactly which requests a lost message affected. Parsed from text such as
    `drop=REQUEST:0.5,drop=ABORTED:1,delay=PONG:1.5,seed=7`.
    """

    drop: dict[str, float] = field(default_factory=dict)
    delay: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for kind, table in (("drop", self.drop), ("delay", self.delay)):
            for t, v in table.items():
                if t not in MESSENGER.schemas:
                    raise WireError(f"{FAULTS_ENV}: {kind}={t}: unknown message type")
                if not isinstance(v, int | float) or v < 0 or (kind == "drop" and v > 1):
                    raise WireError(f"{FAULTS_ENV}: {kind}={t}:{v!r} out of range")
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, text: str) -> ControlFaults:
        drop: dict[str, float] = {}
        delay: dict[str, float] = {}
        seed = 0
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, _, val = item.partition("=")
            try:
                if key == "seed":
                    seed = int(val)
                elif key in ("drop", "delay"):
                    t, _, num = val.partition(":")
                    (drop if key == "drop" else delay)[t] = float(num or 1.0)
                else:
                    raise ValueError
            except ValueError:
                raise WireError(f"{FAULTS_ENV}: cannot read {item!r} (expected drop=TYPE:p, "
                                f"delay=TYPE:seconds or seed=N)") from None
        return cls(drop, delay, seed)

    def action(self, type_: str, body: dict[str, Any]) -> float | None:
        """None: drop the message; else the seconds to hold it back (0: send now)."""
        rid = str(body.get("rid", ""))
        p = self.drop.get(type_, 0.0)
        if p and self._rng.random() < p:
            self.log.append(("drop", type_, rid))
            return None
        d = self.delay.get(type_, 0.0)
        if d:
            self.log.append(("delay", type_, rid))
        return d


_env_faults: ControlFaults | None = None


def env_faults() -> ControlFaults | None:
    """The process-wide hook from `PDTOOL_CONTROL_FAULTS` (one shared log), or None."""
    global _env_faults
    text = os.environ.get(FAULTS_ENV, "")
    if not text:
        return None
    if _env_faults is None:
        _env_faults = ControlFaults.parse(text)
        log.warning("control: fault injection enabled (%s=%s)", FAULTS_ENV, text)
    return _env_faults


class Channel:
    """See the module docstring. `codec` is this endpoint's `Envelope`."""

    def __init__(self, ctx: zmq.Context, codec: Envelope, *, router: bool,
                 faults: ControlFaults | None = None) -> None:
        self.codec = codec
        self.router = router
        self.faults = faults if faults is not None else env_faults()
        self._held: list[tuple[float, list[bytes], str]] = []  # delayed by the fault hook
        self.sock = ctx.socket(zmq.ROUTER if router else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, codec.max_bytes + 1024)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        if router:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        else:
            self.sock.setsockopt(zmq.ROUTING_ID, codec.sender.encode())
        self.rejected = 0
        self.unsent = 0
        self.last_error = ""
        self.address = ""
        self.peer_name = ""  # DEALER: the name of the one peer, from its first valid message

    @classmethod
    def listen(cls, ctx: zmq.Context, codec: Envelope, host: str, port: int = 0, *,
               allow_any_interface: bool = False,
               faults: ControlFaults | None = None) -> Channel:
        ch = cls(ctx, codec, router=True, faults=faults)
        check_bind_host(host, allow_any_interface)
        try:
            if port:
                ch.sock.bind(f"tcp://{host}:{port}")
            else:
                port = ch.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            ch.close()
            raise WireError(f"bind_host/port: cannot listen on {host}:{port} ({exc})") from None
        ch.address = f"tcp://{host}:{port}"
        return ch

    @classmethod
    def connect(cls, ctx: zmq.Context, codec: Envelope, address: str, *,
                faults: ControlFaults | None = None) -> Channel:
        ch = cls(ctx, codec, router=False, faults=faults)
        ch.sock.connect(address)
        ch.address = address
        return ch

    def send(self, type_: str, body: dict[str, Any], peer: bytes | None = None,
             session: bytes | None = None) -> bool:
        """Send one message (to `peer`'s routing id on a ROUTER), bound to `session` (a HELLO's
        `Message.session` when answering one) or else to the session the peer is known under.
        False when it was not sent: no binding known yet for a kind that needs one."""
        if self.router and peer is None:
            raise ValueError("a ROUTER channel needs the peer's routing id")
        if session is None:
            name = peer.decode(errors="replace") if peer is not None else self.peer_name
            session = self.codec.session_of(name) if name else b""
        if not session and type_ not in self.codec.protocol.unbound:
            self.unsent += 1
            log.debug("control %s: %s not sent, no HELLO from the peer yet", self.address,
                      type_)
            return False
        frames = self.codec.seal(type_, body, session)
        if self.router:
            frames = [peer, *frames]
        if self.faults is not None:
            hold = self.faults.action(type_, body)
            if hold is None:
                return True
            if hold > 0:
                self._held.append((time.monotonic() + hold, frames, type_))
                return True
        self._send(frames, type_)
        return True

    def _send(self, frames: list[bytes], type_: str) -> None:
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("control: send queue to %s full, dropped %s", self.address, type_)

    def _release_held(self) -> None:
        now = time.monotonic()
        due = [h for h in self._held if h[0] <= now]
        if due:
            self._held = [h for h in self._held if h[0] > now]
            for _t, frames, type_ in due:
                self._send(frames, type_)

    def recv(self, limit: int = 256) -> list[tuple[bytes, Message]]:
        """Valid messages waiting now (non-blocking) as (peer routing id, message)."""
        if self._held:
            self._release_held()
        out = []
        for _ in range(limit):
            # ask first: an empty receive raises zmq.Again, and a messenger thread asks many
            # times per forward pass while holding the GIL the engine thread wants
            if not self.pending():
                break
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            peer = frames.pop(0) if self.router and frames else b""
            try:
                if self.router and not peer:
                    raise WireError("frames: no routing id")
                msg = self.codec.open(frames, peer.decode(errors="replace")
                                      if self.router else None)
            except WireError as exc:
                self.rejected += 1
                self.last_error = str(exc)
                log.warning("control %s: refused a message: %s", self.address, exc)
                continue
            if not self.router:
                self.peer_name = msg.sender
            out.append((peer, msg))
        return out

    def pending(self) -> bool:
        """Whether a message waits now. A thread about to sleep on the socket's readiness fd
        (`zmq.FD`, edge-triggered) asks first: a send may have taken the edge."""
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    @property
    def holding(self) -> bool:
        """Whether the fault hook holds messages back (a later `recv` sends them)."""
        return bool(self._held)

    def close(self) -> None:
        self.sock.close(linger=0)

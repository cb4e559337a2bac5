"""The one signed envelope every pdtool control message travels in.

A message is two ZeroMQ frames, `[payload, mac]` (a transport may put routing frames or a tag
in front), with `mac = HMAC-SHA256(secret, payload)` under the per-deployment secret and

    payload = msgpack {v: version, p: protocol, k: kind, from: sender name,
                       sid: sender's session id (16 bytes), to: receiver's session id or b"",
                       seq: sender's sequence number, body: the kind's fields}

A receiver checks, in this order and before trusting a byte of the body: the size limit and
frame count; the MAC (constant time) — nothing unsigned is even decoded; the version (a peer
of another version gets "protocol version N, expected M" and nothing else is read: fields
change between versions, so a field error would only mislead); the protocol and kind; the
session binding and the sequence number (replay protection, below); the body against the
kind's schema, field by field.

Replay protection without clocks. Hosts' clocks need not agree (a wall-clock window drops
every frame once two hosts drift apart). Instead each `Envelope` is one endpoint incarnation
with a random 16-byte session id, chosen when it is built, and numbers every frame it seals
1, 2, 3, ... The receiver keeps, per (sender, session), the highest number seen and a
1024-frame window of which lower ones arrived, so a frame accepted once is refused again,
and frames delayed or reordered within the window still pass. Binding makes old captures
useless across restarts: every frame except a HELLO carries `to` = the receiver's session
id, which the sender only learns from the receiver's own HELLO, so a frame captured from an
earlier run of the receiver names a session that no longer exists and is refused (a protocol
may let more kinds go unbound: `Protocol.unbound`; SGLang's one-way META, wire/sglang.py). When a
sender's frames bound to us arrive under a new session id, that sender restarted: every other
session of it seen so far is retired, and their frames are refused from then on (such a frame
was bound to our session, so its sender's HELLO reached us in this run: it is known). A
HELLO may come unbound (the sender does not know us yet); a replayed one only makes us answer
with a HELLO of ours, which the real sender refuses when its session moved on, and it never
changes the session our frames to that sender are bound to once that sender has spoken to us
bound.

The version history (what changed in each version) is `HISTORY`; PROTOCOL.md lists every
message of every protocol.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .fields import Check, WireError, bytes_field, int_field, map_field, str_field
from .secret import check_secret

PROTOCOL_VERSION = 4
HISTORY: dict[int, str] = {
    0: "(no version field) the reference front's {k, b, t, n} frames",
    1: "three codecs with their own version 1: the messenger's {v, type, from, ts, nonce, body} "
       "and SGLang's [TAG, kind, {v, ..., t, n}, mac(kind + payload)], both with a 30 s "
       "wall-clock replay window; REQUEST gained `lanes` and `writes_per_op` without a version "
       "change; no handshake, every REQUEST carried and re-checked the static fields",
    2: "one envelope for every protocol {v, p, k, from, sid, to, seq, body}; replay protection "
       "by session ids and sequence numbers (no clock agreement); a HELLO per peer carries the "
       "static fields and a compatibility hash, checked once; REQUEST keeps only per-request "
       "fields",
    3: "SGLang's HELLO carries `rails`: the decode rank's further endpoints (one per NIC beside "
       "its GPU), each its fabric name and its keys for the same KV and aux memory",
    4: "SGLang's META carries `landing_rails` with a request's landing blocks: the decode "
       "rank's landing area under the keys of each further endpoint (staged writes use every "
       "NIC too); SGLang's HELLO carries `num_draft` and PEER `draft`: a draft model's KV "
       "buffers and how they are sharded; the messenger's HELLO `kick`/`kicks` and PONG "
       "`queued` (optional fields)",
}
DEFAULT_MAX_BYTES = 8 << 20
SESSION_BYTES = 16
REPLAY_WINDOW = 1024        # sequence numbers below the highest seen that may still arrive
_MAX_TRACKED = 1 << 14      # (sender, session) windows kept; the oldest are forgotten

_ENVELOPE = map_field({
    "v": int_field(0, 1 << 16),
    "p": str_field(32),
    "k": str_field(16),
    "from": str_field(256, min_len=1),
    "sid": bytes_field(SESSION_BYTES, min_len=SESSION_BYTES),
    "to": bytes_field(SESSION_BYTES),
    "seq": int_field(1, (1 << 63) - 1),
    "body": lambda path, v: v,  # checked against the kind's schema below
})


@dataclass(frozen=True)
class Protocol:
    """One control plane's messages: `schemas[kind]` checks a body; kinds in `unbound` may be
    sent before the receiver's session is known (HELLO only, in every protocol)."""

    name: str
    schemas: Mapping[str, Check]
    unbound: frozenset[str] = frozenset({"HELLO"})

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.schemas)


@dataclass(frozen=True)
class Message:
    """A verified message. `session`: the sender's session id (answer a HELLO bound to it);
    `new_session`: the first bound frame of a new session of that sender (it restarted)."""

    type: str
    sender: str
    body: dict[str, Any]
    session: bytes
    seq: int
    new_session: bool = False


@dataclass
class _Window:
    top: int = 0
    bits: int = 0  # bit i set: sequence number top - i was accepted

    def fresh(self, seq: int) -> bool:
        if seq > self.top:
            return True
        off = self.top - seq
        return off < REPLAY_WINDOW and not self.bits >> off & 1

    def take(self, seq: int) -> None:
        if seq > self.top:
            shift = seq - self.top
            self.bits = ((self.bits << shift) | 1) & ((1 << REPLAY_WINDOW) - 1) \
                if shift < REPLAY_WINDOW else 1
            self.top = seq
        else:
            self.bits |= 1 << (self.top - seq)


@dataclass
class Sessions:
    """Replay state of one endpoint: its own session id, and per sender the session its frames
    to us are bound under (`current`), the session a not yet bound sender offered in its HELLO
    (`offered`), retired sessions and the sequence windows. Pure (no clock, no sockets)."""

    own: bytes = field(default_factory=lambda: secrets.token_bytes(SESSION_BYTES))
    current: dict[str, bytes] = field(default_factory=dict)
    offered: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    retired: OrderedDict[tuple[str, bytes], None] = field(default_factory=OrderedDict)
    windows: OrderedDict[tuple[str, bytes], _Window] = field(default_factory=OrderedDict)

    def check(self, kind: str, sender: str, sid: bytes, to: bytes, seq: int,
              unbound_ok: bool) -> None:
        """Raise WireError if the frame is a replay or bound to another session."""
        if to:
            if to != self.own:
                raise WireError("to: frame bound to another session of this endpoint (replayed "
                                "from an earlier run, or the sender has not seen this run's "
                                "HELLO)")
        elif not unbound_ok:
            raise WireError(f"to: a {kind} must be bound to this endpoint's session (HELLO "
                            f"first)")
        if (sender, sid) in self.retired:
            raise WireError(f"sid: that session of {sender!r} was replaced by a newer one "
                            f"(replayed message)")
        w = self.windows.get((sender, sid))
        if w is not None and not w.fresh(seq):
            raise WireError("seq: already seen (replayed message)")

    def take(self, sender: str, sid: bytes, to: bytes, seq: int) -> bool:
        """Record an accepted frame; True when it opened a new bound session of `sender`."""
        key = (sender, sid)
        w = self.windows.pop(key, None) or _Window()
        w.take(seq)
        self.windows[key] = w
        while len(self.windows) > _MAX_TRACKED:
            self.windows.popitem(last=False)
        if not to:
            if sender not in self.current:
                self.offered[sender] = sid
                self.offered.move_to_end(sender)
                while len(self.offered) > _MAX_TRACKED:
                    self.offered.popitem(last=False)
            return False
        old = self.current.get(sender)
        if old == sid:
            return False
        self.current[sender] = sid
        self.offered.pop(sender, None)
        # one process, one session: every other session of this sender seen so far (its
        # HELLOs included) is over, so a frame of one of them held back and sent now is refused
        for other in [k for k in self.windows if k[0] == sender and k[1] != sid]:
            del self.windows[other]
            self.retired[other] = None
        while len(self.retired) > _MAX_TRACKED:
            self.retired.popitem(last=False)
        return True

    def session_of(self, sender: str) -> bytes:
        """The session a frame to `sender` must be bound to (b"" before its HELLO)."""
        return self.current.get(sender) or self.offered.get(sender, b"")

    def forget(self, sender: str) -> None:
        """Drop what is known of a sender that left (its session is retired, not reusable)."""
        sid = self.current.pop(sender, None)
        if sid is not None:
            self.retired[(sender, sid)] = None
        self.offered.pop(sender, None)


class Envelope:
    """Seals and opens messages of one protocol for one endpoint incarnation; pure (no
    sockets), so it is fuzzed directly in tests. Construction refuses a missing secret."""

    def __init__(self, secret: bytes, sender: str, protocol: Protocol, *,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._secret = check_secret(secret)
        if not isinstance(sender, str) or not 0 < len(sender) <= 256:
            raise WireError(f"sender: expected a name of 1..256 characters, got {sender!r}")
        self.sender = sender
        self.protocol = protocol
        self.max_bytes = max_bytes
        self.sessions = Sessions()
        self._seq = 0

    def __repr__(self) -> str:  # never show the secret
        return f"Envelope(sender={self.sender!r}, protocol={self.protocol.name!r})"

    @property
    def session(self) -> bytes:
        return self.sessions.own

    def session_of(self, sender: str) -> bytes:
        return self.sessions.session_of(sender)

    def seal(self, kind: str, body: dict[str, Any], to: bytes = b"") -> list[bytes]:
        """[payload, mac]. `to`: the receiver's session (`session_of(name)` or a HELLO's
        `Message.session`); only kinds in `protocol.unbound` may go without one."""
        schema = self.protocol.schemas.get(kind)
        if schema is None:
            raise WireError(f"type: unknown message type {kind!r} in protocol "
                            f"{self.protocol.name!r}")
        if not to and kind not in self.protocol.unbound:
            raise WireError(f"{kind}: the peer's session is not known yet (no HELLO from it)")
        schema(kind, body)  # never send what the peer would refuse
        self._seq += 1
        payload = msgpack.packb({"v": PROTOCOL_VERSION, "p": self.protocol.name, "k": kind,
                                 "from": self.sender, "sid": self.session, "to": to,
                                 "seq": self._seq, "body": body}, use_bin_type=True)
        if len(payload) > self.max_bytes:
            raise WireError(f"{kind}: message of {len(payload)} bytes exceeds the "
                            f"{self.max_bytes}-byte limit")
        return [payload, hmac.new(self._secret, payload, hashlib.sha256).digest()]

    def open(self, frames: list[bytes], expect_sender: str | None = None) -> Message:
        """The verified message, or WireError naming what was refused. `expect_sender`: the
        name the transport saw (a ROUTER's routing id), which the signed `from` must equal."""
        if len(frames) != 2:
            raise WireError(f"frames: expected [payload, mac], got {len(frames)} frames")
        payload, mac = frames
        if len(payload) > self.max_bytes:
            raise WireError(f"payload: {len(payload)} bytes exceeds {self.max_bytes}")
        want = hmac.new(self._secret, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(want, mac):
            raise WireError("mac: signature does not match the deployment secret")
        try:
            raw = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types for malformed input
            raise WireError(f"payload: not valid msgpack ({type(exc).__name__})") from None
        if not isinstance(raw, dict):
            raise WireError(f"envelope: expected a map, got {type(raw).__name__}")
        version = raw.get("v", 0)
        if version != PROTOCOL_VERSION:
            raise WireError(f"envelope.v: protocol version {version!r}, expected "
                            f"{PROTOCOL_VERSION} (upgrade the older side)")
        env = _ENVELOPE("envelope", raw)
        if env["p"] != self.protocol.name:
            raise WireError(f"envelope.p: a {env['p']!r} message, this endpoint speaks "
                            f"{self.protocol.name!r}")
        kind = env["k"]
        schema = self.protocol.schemas.get(kind)
        if schema is None:
            raise WireError(f"envelope.k: expected one of {self.protocol.kinds}, got {kind!r}")
        sender, sid, to, seq = env["from"], env["sid"], env["to"], env["seq"]
        if expect_sender is not None and sender != expect_sender:
            raise WireError(f"from: {sender!r} does not match the sending socket's identity")
        self.sessions.check(kind, sender, sid, to, seq, kind in self.protocol.unbound)
        body = schema(kind, env["body"])
        new = self.sessions.take(sender, sid, to, seq)
        return Message(kind, sender, body, sid, seq, new)

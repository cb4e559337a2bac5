"""Control plane of the KV messenger: ZeroMQ ROUTER/DEALER + msgpack, HMAC-SHA256 signed.

Only small messages travel here (REQUEST, ABORT, ABORTED, PING, PONG); KV bytes never do. Every
message is two frames, `[payload, mac]`, with `mac = HMAC-SHA256(secret, payload)` and the
per-deployment `secret` (generated at render time, file mode 0600, never logged). A receiver
checks, in this order and before trusting a single byte of the body:
  1. size (`max_bytes`, also enforced by ZeroMQ's MAXMSGSIZE) and frame count;
  2. the MAC (constant-time compare) — an unauthenticated peer cannot register, request pages
     or learn memory keys, because nothing it sends is even decoded;
  3. the msgpack envelope `{v, type, from, ts, nonce, body}` and the protocol version;
  4. freshness: `ts` within `max_skew_s` of now and `nonce` not seen within that window
     (a replayed message is refused);
  5. the body, field by field against the schema of its type (`SCHEMAS`), with errors that name
     the field (`REQUEST.layout.page_size: expected int >= 1, got 'x'`).
A refused message is dropped, counted in `rejected` and logged with its reason; the socket keeps
serving. Listeners bind to a configured interface (default 127.0.0.1), never to every interface
unless explicitly allowed.

Fault injection (tests only): `ControlFaults` drops or delays OUTGOING messages of chosen types,
so the fault suite can lose a REQUEST, an ABORTED or a PONG, or hold one back past a timeout. It
is off unless a channel is given one or the process environment sets `PDTOOL_CONTROL_FAULTS`
(e.g. `drop=REQUEST:0.5,delay=PONG:1.5,seed=3`); a disabled hook costs one `is None` test per
send and nothing on the data path.

Sockets are not thread-safe: each `Channel` belongs to the messenger thread that polls it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

PROTOCOL_VERSION = 1
MIN_SECRET_BYTES = 16
DEFAULT_MAX_BYTES = 8 << 20
_ANY_HOSTS = ("0.0.0.0", "*", "::", "[::]")

log = logging.getLogger("transfer.control")


class ControlError(ValueError):
    """A control message or setting that is refused; the text names the offending field."""


# ----------------------------------------------------------------------------- secrets
def generate_secret() -> bytes:
    return secrets.token_bytes(32)


def write_secret(path: str | os.PathLike[str], secret: bytes | None = None) -> bytes:
    """Create a secret file readable by its owner only (mode 0600); returns the secret."""
    secret = secret if secret is not None else generate_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret.hex().encode() + b"\n")
    os.chmod(path, 0o600)
    return secret


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """Load a secret written by `write_secret`; refuses files others can read."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text().strip()
    except OSError as exc:
        raise ControlError(f"secret file {p}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ControlError(f"secret file {p}: mode {oct(mode & 0o777)} lets others read it; "
                           f"run `chmod 600 {p}`")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ControlError(f"secret file {p}: expected hex text") from None
    check_secret(secret)
    return secret


def check_secret(secret: Any) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ControlError(f"secret: need at least {MIN_SECRET_BYTES} random bytes")
    return secret


def check_bind_host(host: str, allow_any: bool = False) -> str:
    if not isinstance(host, str) or not host:
        raise ControlError("bind_host: expected an interface address such as 127.0.0.1")
    if host in _ANY_HOSTS and not allow_any:
        raise ControlError(f"bind_host: {host!r} listens on every interface; give the address "
                           f"of the interface peers use (or allow it explicitly)")
    return host


# ----------------------------------------------------------------------------- schema
Check = Callable[[str, Any], Any]


def _type_name(v: Any) -> str:
    return type(v).__name__


def int_field(lo: int = 0, hi: int = (1 << 64) - 1) -> Check:
    def check(path: str, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ControlError(f"{path}: expected int, got {_type_name(v)}")
        if not lo <= v <= hi:
            raise ControlError(f"{path}: expected int in [{lo}, {hi}], got {v}")
        return v
    return check


def float_field(lo: float = 0.0, hi: float = 1e9) -> Check:
    def check(path: str, v: Any) -> float:
        if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
            raise ControlError(f"{path}: expected a number in [{lo}, {hi}], got {v!r}")
        return float(v)
    return check


def bool_field() -> Check:
    def check(path: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise ControlError(f"{path}: expected bool, got {_type_name(v)}")
        return v
    return check


def str_field(max_len: int = 256, choices: tuple[str, ...] | None = None,
              min_len: int = 0) -> Check:
    def check(path: str, v: Any) -> str:
        if not isinstance(v, str):
            raise ControlError(f"{path}: expected str, got {_type_name(v)}")
        if not min_len <= len(v) <= max_len:
            raise ControlError(f"{path}: expected {min_len}..{max_len} characters, got {len(v)}")
        if choices is not None and v not in choices:
            raise ControlError(f"{path}: expected one of {choices}, got {v!r}")
        return v
    return check


def bytes_field(max_len: int, multiple_of: int = 1, min_len: int = 0) -> Check:
    """Raw bytes (e.g. a little-endian uint32 array, decoded by the receiver with numpy)."""
    def check(path: str, v: Any) -> bytes:
        if not isinstance(v, bytes):
            raise ControlError(f"{path}: expected bytes, got {_type_name(v)}")
        if not min_len <= len(v) <= max_len or len(v) % multiple_of:
            raise ControlError(f"{path}: expected {min_len}..{max_len} bytes in multiples of "
                               f"{multiple_of}, got {len(v)}")
        return v
    return check


def list_field(item: Check, max_items: int) -> Check:
    def check(path: str, v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise ControlError(f"{path}: expected a list, got {_type_name(v)}")
        if len(v) > max_items:
            raise ControlError(f"{path}: at most {max_items} items, got {len(v)}")
        return [item(f"{path}[{i}]", x) for i, x in enumerate(v)]
    return check


def map_field(schema: dict[str, Check]) -> Check:
    """A map with exactly these keys (missing and unknown keys are both refused)."""
    def check(path: str, v: Any) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise ControlError(f"{path}: expected a map, got {_type_name(v)}")
        for k in v:
            if k not in schema:
                raise ControlError(f"{path}.{k}: unknown field")
        out = {}
        for k, c in schema.items():
            if k not in v:
                raise ControlError(f"{path}.{k}: missing field")
            out[k] = c(f"{path}.{k}", v[k])
        return out
    return check


_U16 = int_field(0, 0xFFFF)
_POS = int_field(1, 1 << 31)
_NAT = int_field(0, 1 << 31)
_RID = str_field(256, min_len=1)
_REASON = str_field(1024)
_REGION = map_field({"base": int_field(), "key": int_field(), "length": int_field()})
_AUX_REGION = map_field({"base": int_field(), "key": int_field(), "length": int_field(),
                         "row_bytes": _POS})
_SPEC = map_field({"num_kv_heads": int_field(1, 1 << 16), "tp": int_field(1, 1 << 16),
                   "dp": int_field(1, 1 << 16)})
_LAYOUT = map_field({"kind": str_field(8, ("HND", "NHD")), "num_pages": _POS,
                     "heads_local": _POS, "kv_parts": int_field(1, 2), "page_size": _POS,
                     "head_dim": _POS, "itemsize": int_field(1, 16)})
_SLICE = map_field({"src_rank": _NAT, "head_lo": _NAT, "num_heads": _POS, "src_head_off": _NAT,
                    "dst_head_off": _NAT})

SCHEMAS: dict[str, Check] = {
    # decode rank -> prefill lead: this decode rank's part of a request (messenger.decode)
    "REQUEST": map_field({
        "rid": _RID,
        "token_ids": bytes_field(4 << 20, 4),      # uint32 LE; only decode rank 0's part has them
        "num_tokens": _NAT,
        "dst_pages": bytes_field(4 << 20, 4),      # uint32 LE, page ids in the decoder's buffers
        "slot": _U16, "gen": _U16,
        "dst_rank": _NAT, "num_parts": _POS,
        "dst_spec": _SPEC, "src_spec": _SPEC,
        "layout": _LAYOUT, "num_layers": _POS, "buffers_per_layer": int_field(1, 8),
        "fabric_name": bytes_field(1024, min_len=1),
        "regions": list_field(_REGION, 8192),
        "aux_regions": list_field(_AUX_REGION, 64),
        # extra receive lanes of this decode rank (the same KV buffers registered on each;
        # KV writes may go to any of them, aux copies go to `fabric_name`)
        "lanes": list_field(map_field({"fabric_name": bytes_field(1024, min_len=1),
                                       "regions": list_field(_REGION, 8192)}), 7),
        "aux_row": _NAT,
        "slices": list_field(_SLICE, 4096),        # what each prefill rank sends this rank
        "aux_rank": _NAT,                          # the prefill rank that sends the aux rows
        "expected": list_field(_NAT, 1 << 16),     # operations each prefill rank issues to it
        "writes_per_op": int_field(1, 64),          # page writes grouped into one operation
        "timeout_s": float_field(0.001, 86400.0),
    }),
    # decode -> prefill: stop writing for this transfer and confirm with ABORTED
    "ABORT": map_field({"rid": _RID, "slot": _U16, "gen": _U16, "reason": _REASON}),
    # prefill -> decode: no further writes will be issued; `issued` writes were submitted to
    # this decode rank for this transfer and all completed locally (`errored` with an error)
    "ABORTED": map_field({"rid": _RID, "slot": _U16, "gen": _U16, "reason": _REASON,
                          "issued": _NAT, "errored": _NAT}),
    # liveness lease: decode pings each prefill peer, prefill answers (see messenger docs)
    "PING": map_field({}),
    "PONG": map_field({}),
}

_ENVELOPE = map_field({
    "v": int_field(0, 1 << 16),
    "type": str_field(16, tuple(SCHEMAS)),
    "from": str_field(256, min_len=1),
    "ts": float_field(0.0, 1e12),
    "nonce": bytes_field(16, min_len=16),
    "body": lambda path, v: v,  # validated by type below
})


@dataclass(frozen=True)
class Message:
    type: str
    sender: str
    body: dict[str, Any]
    ts: float


@dataclass
class ReplayGuard:
    """Refuses stale timestamps and nonces seen within `window_s` seconds."""

    window_s: float = 30.0
    _seen: dict[bytes, float] = field(default_factory=dict)
    _last_prune: float = 0.0

    def check(self, ts: float, nonce: bytes, now: float) -> None:
        if abs(now - ts) > self.window_s:
            raise ControlError(f"ts: message is {now - ts:+.1f} s old, outside the "
                               f"{self.window_s:.0f} s window (replay or clock skew)")
        if nonce in self._seen:
            raise ControlError("nonce: already seen (replayed message)")
        self._seen[nonce] = ts
        if now - self._last_prune > self.window_s / 4 or len(self._seen) > 1 << 20:
            cutoff = now - self.window_s
            self._seen = {n: t for n, t in self._seen.items() if t >= cutoff}
            self._last_prune = now


class Codec:
    """Signs and verifies messages; pure (no sockets), so it is fuzzed directly in tests."""

    def __init__(self, secret: bytes, sender: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_skew_s: float = 30.0) -> None:
        self._secret = check_secret(secret)
        self.sender = sender
        self.max_bytes = max_bytes
        self.replay = ReplayGuard(max_skew_s)

    def __repr__(self) -> str:  # never show the secret
        return f"Codec(sender={self.sender!r})"

    def encode(self, type_: str, body: dict[str, Any]) -> list[bytes]:
        if type_ not in SCHEMAS:
            raise ControlError(f"type: unknown message type {type_!r}")
        SCHEMAS[type_](type_, body)  # never send what the peer would refuse
        payload = msgpack.packb({"v": PROTOCOL_VERSION, "type": type_, "from": self.sender,
                                 "ts": time.time(), "nonce": secrets.token_bytes(16),
                                 "body": body}, use_bin_type=True)
        if len(payload) > self.max_bytes:
            raise ControlError(f"{type_}: message of {len(payload)} bytes exceeds the "
                               f"{self.max_bytes}-byte limit")
        return [payload, hmac.new(self._secret, payload, hashlib.sha256).digest()]

    def decode(self, frames: list[bytes], now: float | None = None) -> Message:
        if len(frames) != 2:
            raise ControlError(f"frames: expected [payload, mac], got {len(frames)} frames")
        payload, mac = frames
        if len(payload) > self.max_bytes:
            raise ControlError(f"payload: {len(payload)} bytes exceeds {self.max_bytes}")
        want = hmac.new(self._secret, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(want, mac):
            raise ControlError("mac: signature does not match the deployment secret")
        try:
            raw = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types for malformed input
            raise ControlError(f"payload: not valid msgpack ({type(exc).__name__})") from None
        env = _ENVELOPE("envelope", raw)
        if env["v"] != PROTOCOL_VERSION:
            raise ControlError(f"envelope.v: protocol version {env['v']} is not supported "
                               f"(this side speaks {PROTOCOL_VERSION})")
        self.replay.check(env["ts"], env["nonce"], time.time() if now is None else now)
        body = SCHEMAS[env["type"]](env["type"], env["body"])
        return Message(env["type"], env["from"], body, env["ts"])


FAULTS_ENV = "PDTOOL_CONTROL_FAULTS"


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
        import random

        for kind, table in (("drop", self.drop), ("delay", self.delay)):
            for t, v in table.items():
                if t not in SCHEMAS:
                    raise ControlError(f"{FAULTS_ENV}: {kind}={t}: unknown message type")
                if not isinstance(v, int | float) or v < 0 or (kind == "drop" and v > 1):
                    raise ControlError(f"{FAULTS_ENV}: {kind}={t}:{v!r} out of range")
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
                raise ControlError(f"{FAULTS_ENV}: cannot read {item!r} (expected drop=TYPE:p, "
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
    """One signed ZeroMQ socket: a ROUTER (`bind`) or a DEALER (`connect`).

    A ROUTER's messages carry the peer's routing id, which must equal the signed `from` field
    (so a peer cannot answer for another). Bad messages are dropped: `recv` returns only valid
    ones, `rejected` counts the rest and `last_error` keeps the latest reason.
    """

    def __init__(self, ctx: zmq.Context, codec: Codec, *, router: bool,
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
        self.last_error = ""
        self.address = ""

    @classmethod
    def listen(cls, ctx: zmq.Context, codec: Codec, host: str, port: int = 0, *,
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
            raise ControlError(f"bind_host/port: cannot listen on {host}:{port} ({exc})") from None
        ch.address = f"tcp://{host}:{port}"
        return ch

    @classmethod
    def connect(cls, ctx: zmq.Context, codec: Codec, address: str, *,
                faults: ControlFaults | None = None) -> Channel:
        ch = cls(ctx, codec, router=False, faults=faults)
        ch.sock.connect(address)
        ch.address = address
        return ch

    def send(self, type_: str, body: dict[str, Any], peer: bytes | None = None) -> None:
        frames = self.codec.encode(type_, body)
        if self.router:
            if peer is None:
                raise ValueError("a ROUTER channel needs the peer's routing id")
            frames = [peer, *frames]
        if self.faults is not None:
            hold = self.faults.action(type_, body)
            if hold is None:
                return
            if hold > 0:
                self._held.append((time.monotonic() + hold, frames, type_))
                return
        self._send(frames, type_)

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
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            peer = frames.pop(0) if self.router and frames else b""
            try:
                msg = self.codec.decode(frames)
                if self.router and peer != msg.sender.encode():
                    raise ControlError(f"from: {msg.sender!r} does not match the sending "
                                       f"socket's identity")
            except ControlError as exc:
                self.rejected += 1
                self.last_error = str(exc)
                log.warning("control %s: refused a message: %s", self.address, exc)
                continue
            out.append((peer, msg))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)

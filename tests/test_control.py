"""Control plane: signed messages, field-by-field validation, refusals over real sockets."""

from __future__ import annotations

import contextlib
import os
import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.control import (
    PROTOCOL_VERSION,
    Channel,
    Codec,
    ControlError,
    check_bind_host,
    read_secret,
    write_secret,
)

SECRET = b"s" * 32


def _request_body(**over):
    body = {
        "rid": "r1", "token_ids": b"\x01\x00\x00\x00" * 3, "num_tokens": 3,
        "dst_pages": b"\x00\x00\x00\x00", "slot": 1, "gen": 2, "dst_rank": 0, "num_parts": 1,
        "dst_spec": {"num_kv_heads": 8, "tp": 2, "dp": 1},
        "src_spec": {"num_kv_heads": 8, "tp": 4, "dp": 1},
        "layout": {"kind": "HND", "num_pages": 8, "heads_local": 4, "kv_parts": 2,
                   "page_size": 16, "head_dim": 64, "itemsize": 2},
        "num_layers": 2, "buffers_per_layer": 1, "fabric_name": b"name",
        "regions": [{"base": 1, "key": 2, "length": 3}] * 2, "aux_regions": [], "lanes": [],
        "aux_row": 1, "slices": [{"src_rank": 0, "head_lo": 0, "num_heads": 2, "src_head_off": 0,
                                  "dst_head_off": 0}],
        "aux_rank": 0, "expected": [2, 0], "writes_per_op": 4, "timeout_s": 5.0,
    }
    body.update(over)
    return body


def _raw(payload: dict) -> list[bytes]:
    """Frames signed with the right secret around an arbitrary (possibly bad) envelope."""
    import hashlib
    import hmac
    data = msgpack.packb(payload, use_bin_type=True)
    return [data, hmac.new(SECRET, data, hashlib.sha256).digest()]


def _env(**over):
    env = {"v": PROTOCOL_VERSION, "type": "REQUEST", "from": "d0", "ts": time.time(),
           "nonce": os.urandom(16), "body": _request_body()}
    env.update(over)
    return env


def test_roundtrip():
    a, b = Codec(SECRET, "d0"), Codec(SECRET, "p0")
    msg = b.decode(a.encode("REQUEST", _request_body()))
    assert msg.type == "REQUEST" and msg.sender == "d0" and msg.body["slot"] == 1
    assert "s" * 8 not in repr(a)


@pytest.mark.parametrize(
    ("frames_fn", "error"),
    [
        (lambda: Codec(b"x" * 32, "d0").encode("PING", {}), r"mac: signature"),
        (lambda: [b"abc"], r"frames: expected \[payload, mac\]"),
        (lambda: _raw(_env(v=2)), r"envelope.v: protocol version 2"),
        (lambda: _raw(_env(type="HELLO")), r"envelope.type: expected one of"),
        (lambda: _raw(_env(ts=time.time() - 3600)), r"ts: message is"),
        (lambda: _raw(_env(body=_request_body(slot="1"))), r"REQUEST.slot: expected int, got str"),
        (lambda: _raw(_env(body=_request_body(slot=70000))), r"REQUEST.slot: expected int in"),
        (lambda: _raw(_env(body=_request_body(layout={"kind": "HND"}))),
         r"REQUEST.layout.num_pages: missing field"),
        (lambda: _raw(_env(body={**_request_body(), "evil": 1})), r"REQUEST.evil: unknown field"),
        (lambda: _raw(_env(body=_request_body(token_ids=b"123"))),
         r"REQUEST.token_ids: expected 0..\d+ bytes in multiples of 4, got 3"),
        (lambda: _raw(_env(body=_request_body(regions=[{"base": -1, "key": 0, "length": 1}]))),
         r"REQUEST.regions\[0\].base: expected int in"),
        (lambda: _raw(_env(body=_request_body(layout={**_request_body()["layout"],
                                                       "kind": "XYZ"}))),
         r"REQUEST.layout.kind: expected one of"),
        (lambda: [b"\xc1\xc1", __import__("hmac").new(SECRET, b"\xc1\xc1", "sha256").digest()],
         r"payload: not valid msgpack"),
    ],
)
def test_refusals_name_the_field(frames_fn, error):
    with pytest.raises(ControlError, match=error):
        Codec(SECRET, "p0").decode(frames_fn())


def test_replay_is_refused():
    frames = Codec(SECRET, "d0").encode("PING", {})
    rx = Codec(SECRET, "p0")
    rx.decode(frames)
    with pytest.raises(ControlError, match="nonce: already seen"):
        rx.decode(frames)


def test_oversized_is_refused():
    rx = Codec(SECRET, "p0", max_bytes=1000)
    with pytest.raises(ControlError, match="payload: 1001 bytes exceeds"):
        rx.decode([b"x" * 1001, b"m" * 32])
    with pytest.raises(ControlError, match="exceeds the 1000-byte limit"):
        Codec(SECRET, "d0", max_bytes=1000).encode("REQUEST",
                                                   _request_body(token_ids=b"\0" * 4000))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=3))
def test_fuzz_random_frames_only_raise_control_error(frames):
    with pytest.raises(ControlError):
        Codec(SECRET, "p0").decode(frames)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
                    | st.text(max_size=8) | st.binary(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                        max_size=4),
                    max_leaves=20))
def test_fuzz_signed_garbage_bodies_only_raise_control_error(body):
    """Even a holder of the secret cannot crash the decoder with a malformed body."""
    with contextlib.suppress(ControlError):
        Codec(SECRET, "p0").decode(_raw(_env(body=body)))


def test_bind_host_policy():
    with pytest.raises(ControlError, match=r"bind_host: '0\.0\.0\.0' listens on every interface"):
        check_bind_host("0.0.0.0")
    assert check_bind_host("0.0.0.0", allow_any=True) == "0.0.0.0"


def test_secret_file_mode(tmp_path):
    p = tmp_path / "secret"
    s = write_secret(p)
    assert (p.stat().st_mode & 0o777) == 0o600 and read_secret(p) == s
    os.chmod(p, 0o644)
    with pytest.raises(ControlError, match="lets others read it"):
        read_secret(p)


def _drain(ch: Channel, timeout: float = 2.0, want: int = 1):
    got, end = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        if ch.sock.poll(50):
            got += ch.recv()
    return got


def test_sockets_refuse_unauthenticated_peers_and_keep_serving():
    ctx = zmq.Context()
    try:
        server = Channel.listen(ctx, Codec(SECRET, "p0"), "127.0.0.1")
        assert server.address.startswith("tcp://127.0.0.1:")
        intruder = Channel.connect(ctx, Codec(b"i" * 32, "evil"), server.address)
        good = Channel.connect(ctx, Codec(SECRET, "d0"), server.address)
        liar = Channel.connect(ctx, Codec(SECRET, "d9"), server.address)
        intruder.send("REQUEST", _request_body())
        liar.sock.send_multipart(Codec(SECRET, "d0").encode("PING", {}))  # claims to be d0
        liar.sock.send_multipart([b"junk"])
        good.send("PING", {})
        got = _drain(server)
        assert [(p, m.type, m.sender) for p, m in got] == [(b"d0", "PING", "d0")]
        end = time.monotonic() + 2
        while server.rejected < 3 and time.monotonic() < end:
            server.sock.poll(50)
            server.recv()
        assert server.rejected == 3
        server.send("PONG", {}, peer=b"d0")
        reply = _drain(good)
        assert [m.type for _, m in reply] == ["PONG"]
        for ch in (server, intruder, good, liar):
            ch.close()
    finally:
        ctx.term()

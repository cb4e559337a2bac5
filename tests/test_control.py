"""The messenger's control protocol in the wire envelope: field-by-field validation, HELLO,
refusals over real sockets."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import time

import msgpack
import pytest
import zmq
from helpers.wire_bodies import hello_body, request_body
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.wire import PROTOCOL_VERSION, Envelope, WireError, read_secret, write_secret
from transfer.wire.channel import Channel, check_bind_host
from transfer.wire.messenger import MESSENGER

SECRET = b"s" * 32


RX = Envelope(SECRET, "p0", MESSENGER)


def _raw(payload: dict) -> list[bytes]:
    """Frames signed with the right secret around an arbitrary (possibly bad) envelope."""
    data = msgpack.packb(payload, use_bin_type=True)
    return [data, hmac.new(SECRET, data, hashlib.sha256).digest()]


_seq = iter(range(1, 1 << 30))


def _env(**over):
    """An envelope bound to RX's session, under a fresh sequence number."""
    env = {"v": PROTOCOL_VERSION, "p": "messenger", "k": "REQUEST", "from": "d0",
           "sid": b"d" * 16, "to": RX.session, "seq": next(_seq), "body": request_body()}
    env.update(over)
    return env


def test_roundtrip_after_hello():
    a, b = Envelope(SECRET, "d0", MESSENGER), Envelope(SECRET, "p0", MESSENGER)
    hello = b.open(a.seal("HELLO", hello_body()))
    assert hello.type == "HELLO" and hello.session == a.session
    a.open(b.seal("HELLO", hello_body(role="prefill"), hello.session))
    msg = b.open(a.seal("REQUEST", request_body(), a.session_of("p0")))
    assert msg.type == "REQUEST" and msg.sender == "d0" and msg.body["slot"] == 1
    assert "s" * 8 not in repr(a)


@pytest.mark.parametrize(
    ("frames_fn", "error"),
    [
        (lambda: Envelope(b"x" * 32, "d0", MESSENGER).seal("HELLO", hello_body()),
         r"mac: signature"),
        (lambda: [b"abc"], r"frames: expected \[payload, mac\]"),
        (lambda: _raw(_env(v=99)),
         rf"envelope.v: protocol version 99, expected {PROTOCOL_VERSION}"),
        (lambda: _raw(_env(k="NOPE")), r"envelope.k: expected one of"),
        (lambda: _raw(_env(to=b"")), r"to: a REQUEST must be bound"),
        (lambda: _raw(_env(body=request_body(slot="1"))), r"REQUEST.slot: expected int, got str"),
        (lambda: _raw(_env(body=request_body(slot=70000))), r"REQUEST.slot: expected int in"),
        (lambda: _raw(_env(k="HELLO", body=hello_body(layout={"kind": "HND"}))),
         r"HELLO.layout.num_pages: missing field"),
        (lambda: _raw(_env(body={**request_body(), "evil": 1})), r"REQUEST.evil: unknown field"),
        # the static fields went once, in HELLO: a REQUEST carrying them is refused
        (lambda: _raw(_env(body={**request_body(), "layout": hello_body()["layout"]})),
         r"REQUEST.layout: unknown field"),
        (lambda: _raw(_env(body=request_body(token_ids=b"123"))),
         r"REQUEST.token_ids: expected 0..\d+ bytes in multiples of 4, got 3"),
        (lambda: _raw(_env(k="HELLO",
                           body=hello_body(regions=[{"base": -1, "key": 0, "length": 1}]))),
         r"HELLO.regions\[0\].base: expected int in"),
        (lambda: _raw(_env(k="HELLO", body=hello_body(layout={**hello_body()["layout"],
                                                                "kind": "XYZ"}))),
         r"HELLO.layout.kind: expected one of"),
        (lambda: [b"\xc1\xc1", hmac.new(SECRET, b"\xc1\xc1", "sha256").digest()],
         r"payload: not valid msgpack"),
    ],
)
def test_refusals_name_the_field(frames_fn, error):
    with pytest.raises(WireError, match=error):
        RX.open(frames_fn())


def test_replay_is_refused():
    frames = _raw(_env(k="PING", body={}))
    RX.open(frames)
    with pytest.raises(WireError, match=r"seq: already seen \(replayed message\)"):
        RX.open(frames)


def test_oversized_is_refused():
    rx = Envelope(SECRET, "p0", MESSENGER, max_bytes=1000)
    with pytest.raises(WireError, match="payload: 1001 bytes exceeds"):
        rx.open([b"x" * 1001, b"m" * 32])
    with pytest.raises(WireError, match="exceeds the 1000-byte limit"):
        Envelope(SECRET, "d0", MESSENGER, max_bytes=1000).seal(
            "REQUEST", request_body(token_ids=b"\0" * 4000), b"t" * 16)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=3))
def test_fuzz_random_frames_only_raise_wire_error(frames):
    with pytest.raises(WireError):
        Envelope(SECRET, "p0", MESSENGER).open(frames)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(MESSENGER.kinds)),
       st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
                    | st.text(max_size=8) | st.binary(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                        max_size=4),
                    max_leaves=20))
def test_fuzz_signed_garbage_bodies_only_raise_wire_error(kind, body):
    """Even a holder of the secret cannot crash the decoder with a malformed body."""
    with contextlib.suppress(WireError):
        RX.open(_raw(_env(k=kind, body=body)))


def test_bind_host_policy():
    with pytest.raises(WireError, match=r"bind_host: '0\.0\.0\.0' listens on every interface"):
        check_bind_host("0.0.0.0")
    assert check_bind_host("0.0.0.0", allow_any=True) == "0.0.0.0"


def test_secret_file_mode(tmp_path):
    p = tmp_path / "secret"
    s = write_secret(p)
    assert (p.stat().st_mode & 0o777) == 0o600 and read_secret(p) == s
    import os
    os.chmod(p, 0o644)
    with pytest.raises(WireError, match="lets others read it"):
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
        server = Channel.listen(ctx, Envelope(SECRET, "p0", MESSENGER), "127.0.0.1")
        assert server.address.startswith("tcp://127.0.0.1:")
        intruder = Channel.connect(ctx, Envelope(b"i" * 32, "evil", MESSENGER), server.address)
        good = Channel.connect(ctx, Envelope(SECRET, "d0", MESSENGER), server.address)
        liar = Channel.connect(ctx, Envelope(SECRET, "d9", MESSENGER), server.address)
        intruder.send("HELLO", hello_body())
        liar.sock.send_multipart(Envelope(SECRET, "d0", MESSENGER).seal("HELLO", hello_body()))
        liar.sock.send_multipart([b"junk"])
        assert not good.send("PING", {})  # no HELLO answered yet: nothing to bind a PING to
        good.send("HELLO", hello_body())
        got = _drain(server)
        assert [(p, m.type, m.sender) for p, m in got] == [(b"d0", "HELLO", "d0")]
        end = time.monotonic() + 2
        while server.rejected < 3 and time.monotonic() < end:
            server.sock.poll(50)
            server.recv()
        assert server.rejected == 3
        server.send("HELLO", hello_body(role="prefill"), peer=b"d0", session=got[0][1].session)
        assert [m.type for _, m in _drain(good)] == ["HELLO"] and good.peer_name == "p0"
        assert good.send("PING", {})
        assert [m.type for _, m in _drain(server)] == ["PING"]
        server.send("PONG", {}, peer=b"d0")
        reply = _drain(good)
        assert [m.type for _, m in reply] == ["PONG"]
        for ch in (server, intruder, good, liar):
            ch.close()
    finally:
        ctx.term()

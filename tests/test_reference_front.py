"""The front's request validation and the signed front↔decode wire, without processes.

The HTTP surface itself (streaming, errors, models, health) is exercised on a running
deployment in test_reference_serve.py.
"""

from __future__ import annotations

import contextlib

import pytest

from pdtool.engines.reference.front import BadRequest, parse_request
from pdtool.engines.reference.wire import Wire


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{", "body"),
        (b"[]", "body"),
        (b'{"prompt": 3}', "prompt"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": [1, 300]}', "prompt"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
    ],
)
def test_bad_requests_name_the_field(body, field):
    with pytest.raises(BadRequest, match=f"^{field}:"):
        parse_request(body)


def _handshaken() -> tuple[Wire, Wire]:
    """A front and a decoder wire after the front's HELLO and the decoder's answer."""
    front, w = Wire(b"k" * 32, role="front"), Wire(b"k" * 32, role="decode")
    assert w.unpack(front.pack("HELLO", front.hello()), ("HELLO",))[0] == "HELLO"
    assert front.unpack(w.pack("HELLO", w.hello(), session=w.last_session), ("HELLO",))
    return front, w


def test_wire_refuses_forged_and_malformed_messages():
    front, w = _handshaken()
    frames = front.pack("GEN", {"rid": "a", "tokens": [1, 2], "max_tokens": 3}, peer=w.name)
    assert w.unpack(frames, ("GEN",)) == ("GEN", {"rid": "a", "tokens": [1, 2], "max_tokens": 3})
    assert Wire(b"x" * 32).unpack(frames, ("GEN",)) is None  # other secret
    assert w.unpack([frames[0] + b"!", frames[1]], ("GEN",)) is None
    assert w.unpack(frames, ("OUT",)) is None
    assert w.rejected == 2


def test_wire_needs_a_hello_and_names_the_version_of_an_old_front():
    """GEN before HELLO cannot be bound; a HELLO with other limits is refused naming the
    difference; an unversioned (pre-envelope) front frame is told the version."""
    import hashlib
    import hmac

    import msgpack

    from transfer.wire import PROTOCOL_VERSION, WireError

    front, w = Wire(b"k" * 32), Wire(b"k" * 32, role="decode")
    with pytest.raises(WireError, match="no HELLO from it"):
        front.pack("GEN", {"rid": "a", "tokens": [1], "max_tokens": 1}, peer=w.name)
    assert w.unpack(front.pack("HELLO", {**front.hello(), "max_prompt": 7}), ("HELLO",)) is None
    old = msgpack.packb({"k": "GEN", "b": {"rid": "a", "tokens": [1], "max_tokens": 1},
                         "t": 1.0, "n": b"n" * 16}, use_bin_type=True)
    assert w.unpack([old, hmac.new(b"k" * 32, old, hashlib.sha256).digest()], ("GEN",)) is None
    assert w.rejected == 2
    with pytest.raises(WireError, match=f"protocol version 0, expected {PROTOCOL_VERSION}"):
        w.envelope.open([old, hmac.new(b"k" * 32, old, hashlib.sha256).digest()])


@contextlib.contextmanager
def _front_over_a_decoder_that_never_generates(secret: bytes, **front_args):
    """A started Front over one decode endpoint that answers HELLO and PINGs the way
    serve._take_requests does (so it stays up) and never answers a GEN."""
    import threading
    import time

    import zmq

    from pdtool.engines.reference.front import Front
    from pdtool.engines.reference.wire import router

    sock = router(zmq.Context.instance(), "127.0.0.1", 0)
    stop = threading.Event()

    def decoder() -> None:
        wire = Wire(secret, role="decode")
        while not stop.is_set():
            if sock.poll(50):
                frames = sock.recv_multipart()
                got = wire.unpack(frames[1:], ("HELLO", "GEN", "PING", "CANCEL"), peer=frames[0])
                if got and got[0] == "HELLO":
                    sock.send_multipart([frames[0], *wire.pack("HELLO", wire.hello(),
                                                               session=wire.last_session)])
                elif got and got[0] == "PING":
                    sock.send_multipart([frames[0], *wire.pack("PONG", {"rid": "ping",
                                                                         "tokens": []},
                                                               peer=frames[0])])

    thread = threading.Thread(target=decoder, daemon=True)
    thread.start()
    front = Front([sock.getsockopt_string(zmq.LAST_ENDPOINT)], secret, port=0, **front_args)
    front.start()
    try:
        deadline = time.monotonic() + 30
        while not front.ready:
            assert time.monotonic() < deadline, "the decoder's PONG never arrived"
            time.sleep(0.05)
        yield front
    finally:
        t0 = time.monotonic()
        front.stop()
        stop.set()
        thread.join(5)
        sock.close(0)
        assert time.monotonic() - t0 < 30


def test_a_dead_dispatcher_shows_in_health_and_fails_requests():
    """Should the dispatcher thread ever die, the front says so instead of hanging: /health
    answers 503 with the reason, waiting and new requests fail with it, and `dead` is set
    (serve_front then exits non-zero, and the launcher stops the deployment)."""
    import json
    import urllib.error
    import urllib.request

    from pdtool.engines.reference.front import Unavailable

    with _front_over_a_decoder_that_never_generates(b"k" * 32) as front:
        rid, pending = front.submit([1, 2, 3], 4)
        with front._lock:  # an item the dispatcher cannot unpack: it raises
            front._push.send_pyobj("not a request")
        assert front.dead.wait(10)
        _, body = pending.q.get(timeout=10)
        assert body["done"] and "dispatcher thread died" in body["info"]["error"]
        with pytest.raises(Unavailable, match="dispatcher thread died"):
            front.submit([1, 2], 1)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{front.port}/health", timeout=10)
        health = json.loads(err.value.read())
        assert err.value.code == 503 and health["status"] == "unhealthy"
        assert "dispatcher thread died" in health["reason"]
        front.finish(rid)


def test_a_request_unanswered_for_router_request_timeout_s_fails_naming_the_key():
    """router.request_timeout_s is the front's limit on one request (the plan carries it to
    the front's RankSpec): a live decode instance that never answers a request gets it cut
    with 504, naming the key, instead of the client waiting on its own timer."""
    import json
    import urllib.error
    import urllib.request

    with _front_over_a_decoder_that_never_generates(b"k" * 32,
                                                    request_timeout_s=1.0) as front:
        req = urllib.request.Request(
            f"http://127.0.0.1:{front.port}/v1/completions",
            data=json.dumps({"prompt": "hello", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 504
        assert "router.request_timeout_s" in json.loads(err.value.read())["error"]["message"]


def test_streamed_text_equals_the_whole_text_for_any_split(tmp_path):
    """The incremental detokenizer gives decode(all ids) however the ids arrive (multi-byte
    characters split across messages, BPE merges), for bytes and a checkpoint's tokenizer."""
    import random

    from helpers.hf_checkpoints import TEXT, tokenizer_files

    from pdtool.engines.reference.tokenizer import ByteTokenizer, HFTokenizer, StreamText

    tokenizer_files(tmp_path)
    rng = random.Random(0)
    for tok in (ByteTokenizer(), HFTokenizer(tmp_path)):
        ids = tok.encode(TEXT + " ✓✓ ünï")
        for _ in range(20):
            stream, out, i = StreamText(tok), "", 0
            while i < len(ids):
                k = rng.randint(1, 4)
                out += stream.push(ids[i : i + k], final=i + k >= len(ids))
                i += k
            assert out == tok.decode(ids)

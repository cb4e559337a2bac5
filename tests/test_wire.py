"""The one envelope (transfer.wire): signing, version, replay protection without clocks, size
limit, refusal of a missing secret, and the SGLang frame pair built on it."""

from __future__ import annotations

import hashlib
import hmac
import time

import msgpack
import pytest

from transfer.wire import HISTORY, PROTOCOL_VERSION, Envelope, WireError, check_secret
from transfer.wire.envelope import REPLAY_WINDOW
from transfer.wire.messenger import MESSENGER
from transfer.wire.sglang import TAG, Frames

SECRET = b"s" * 32


def _pair() -> tuple[Envelope, Envelope]:
    """A decode-side and a prefill-side envelope that exchanged HELLOs."""
    d, p = Envelope(SECRET, "d0", MESSENGER), Envelope(SECRET, "p0", MESSENGER)
    hello = p.open(_hello(d))
    d.open(p.seal("PONG", {}, hello.session))
    return d, p


def _hello(env: Envelope) -> list[bytes]:
    from helpers.wire_bodies import hello_body
    return env.seal("HELLO", hello_body(), b"")


def test_version_history_names_every_version_up_to_this_one():
    assert sorted(HISTORY) == list(range(PROTOCOL_VERSION + 1))


def test_no_secret_refuses_to_start():
    for missing in (b"", None, ""):
        with pytest.raises(WireError, match="no deployment secret given; refusing to start"):
            Envelope(missing, "d0", MESSENGER)
    with pytest.raises(WireError, match="no deployment secret"):
        Frames(b"", "decode-0")
    with pytest.raises(WireError, match="at least 16 random bytes"):
        check_secret(b"short")


def test_an_old_peer_gets_the_version_not_a_missing_field():
    """Version-1 messenger envelopes, and the unversioned reference front frames, are told the
    version before any field is read."""
    rx = Envelope(SECRET, "p0", MESSENGER)
    v1 = {"v": 1, "type": "REQUEST", "from": "d0", "ts": time.time(), "nonce": b"n" * 16,
          "body": {"rid": "r"}}
    unversioned = {"k": "GEN", "b": {"rid": "r", "tokens": [1]}, "t": 1.0, "n": b"n" * 16}
    newer = PROTOCOL_VERSION + 1
    for env, version in ((v1, 1), (unversioned, 0), ({"v": newer}, newer)):
        data = msgpack.packb(env, use_bin_type=True)
        with pytest.raises(WireError, match=f"^envelope.v: protocol version {version}, "
                                            f"expected {PROTOCOL_VERSION} "):
            rx.open([data, hmac.new(SECRET, data, hashlib.sha256).digest()])


def test_skewed_clocks_are_accepted_and_replays_refused(monkeypatch):
    """Nothing reads a clock: a sender an hour ahead (or a day behind) is served; the same
    frame twice is refused."""
    d, p = _pair()
    real = time.time
    for skew in (3600.0, -86400.0):
        monkeypatch.setattr(time, "time", lambda s=skew: real() + s)
        frames = d.seal("PING", {}, d.session_of("p0"))
        monkeypatch.setattr(time, "time", real)
        assert p.open(frames).type == "PING"
        with pytest.raises(WireError, match=r"seq: already seen \(replayed message\)"):
            p.open(frames)


def test_reordered_frames_pass_within_the_window_and_never_twice():
    d, p = _pair()
    to = d.session_of("p0")
    frames = [d.seal("PING", {}, to) for _ in range(REPLAY_WINDOW + 2)]
    p.open(frames[-1])
    for f in (frames[3], frames[2]):  # late, but inside the window
        assert p.open(f).type == "PING"
    for f in (frames[3], frames[0]):  # seen, or older than the window
        with pytest.raises(WireError, match="seq: already seen"):
            p.open(f)


def test_a_capture_from_an_earlier_run_of_the_receiver_is_refused():
    d, p = _pair()
    captured = d.seal("PING", {}, d.session_of("p0"))
    restarted = Envelope(SECRET, "p0", MESSENGER)  # same name, new run: a new session
    with pytest.raises(WireError, match="to: frame bound to another session"):
        restarted.open(captured)
    with pytest.raises(WireError, match="to: a PING must be bound"):
        p.open(_unbound_ping())


def _unbound_ping() -> list[bytes]:
    data = msgpack.packb({"v": PROTOCOL_VERSION, "p": "messenger", "k": "PING", "from": "d1",
                          "sid": b"x" * 16, "to": b"", "seq": 1, "body": {}}, use_bin_type=True)
    return [data, hmac.new(SECRET, data, hashlib.sha256).digest()]


def test_a_restarted_sender_retires_its_old_session():
    d, p = _pair()
    old = d.seal("PING", {}, d.session_of("p0"))
    d2 = Envelope(SECRET, "d0", MESSENGER)  # the decoder restarted under the same name
    p.open(_hello(d2))
    first = p.open(d2.seal("PING", {}, p.session))
    assert first.new_session
    with pytest.raises(WireError, match="sid: that session of 'd0' was replaced"):
        p.open(old)
    # a replayed HELLO of the old run never moves what our frames to d0 are bound to
    assert p.session_of("d0") == d2.session


def test_tampered_and_oversized_frames_are_refused():
    d, p = _pair()
    payload, mac = d.seal("PING", {}, d.session_of("p0"))
    with pytest.raises(WireError, match="mac: signature does not match"):
        p.open([payload[:-1] + b"\x01", mac])
    with pytest.raises(WireError, match="mac: signature does not match"):
        p.open([payload, bytes(32)])
    small = Envelope(SECRET, "p0", MESSENGER, max_bytes=1000)
    with pytest.raises(WireError, match="payload: 1001 bytes exceeds 1000"):
        small.open([b"x" * 1001, mac])
    big = Envelope(SECRET, "d0", MESSENGER, max_bytes=1000)
    with pytest.raises(WireError, match="exceeds the 1000-byte limit"):
        big.seal("ABORT", {"rid": "r", "slot": 0, "gen": 0, "reason": "x" * 1000}, b"t" * 16)


def test_a_frame_of_another_protocol_is_refused():
    from pdtool.engines.reference.wire import PROTOCOL
    ref = Envelope(SECRET, "front", PROTOCOL)
    frames = ref.seal("HELLO", {"role": "front", "compat": b"c" * 16, "max_prompt": 1,
                                "max_tokens": 1, "error": ""})
    with pytest.raises(WireError, match=r"envelope.p: a 'reference' message, this endpoint "
                                        r"speaks 'messenger'"):
        Envelope(SECRET, "p0", MESSENGER).open(frames)


def _reg(**over) -> dict:
    body = {"compat": b"c" * 16, "peer": "10.0.0.2:7000", "ip": "10.0.0.2", "port": 7000,
            "fabric_name": b"fi", "provider": "shm", "tp_size": 1, "tp_rank": 0,
            "gpu": 0, "iov_limit": 4, "is_mla": False, "page_size": 16,
            "kv": [{"base": 1, "key": 2, "length": 3}], "kv_data_lens": [3], "kv_item_lens": [1],
            "aux": [], "aux_item_lens": [], "rails": []}
    return {**body, **over}


def test_sglang_frames_are_the_same_envelope_behind_a_tag():
    decode, prefill = Frames(SECRET, "decode-0"), Frames(SECRET, "prefill-0")
    msg = decode.encode("HELLO", _reg())
    assert msg[0] == TAG and len(msg) == 3
    got = prefill.decode(msg)
    assert got.type == "HELLO" and got.body["page_size"] == 16 and got.sender == "decode-0"
    meta = {"peer": "10.0.0.2:7000", "room": 7, "kv_indices": b"\x01\x00\x00\x00",
            "aux_index": None, "slot": 1, "gen": 2, "required_dst_info_num": 1,
            "is_dummy": False, "decode_prefix_len": 0}
    for to in (b"", prefill.session):  # unbound, or bound once the session is known
        frame = decode.encode("META", meta, to)
        assert prefill.decode(frame).body == meta
        with pytest.raises(WireError, match="seq: already seen"):
            prefill.decode(frame)
    restarted = Frames(SECRET, "prefill-0")
    with pytest.raises(WireError, match="to: frame bound to another session"):
        restarted.decode(decode.encode("META", meta, prefill.session))
    with pytest.raises(WireError,
                       match=rf"envelope\.v: protocol version 1, expected {PROTOCOL_VERSION}"):
        prefill.decode([TAG, *_v1_meta(meta)])
    with pytest.raises(WireError, match="not a pdtool control frame"):
        prefill.decode([b"KV_STATUS", b"1", b"4", b"0"])
    with pytest.raises(WireError, match=r"HELLO\.port: expected int"):
        decode.encode("HELLO", _reg(port="7000"))


def _v1_meta(meta: dict) -> list[bytes]:
    """A META as conn.encode_frame wrote it in version 1 (body fields beside `v`), signed the
    version-2 way: its sender learns the version, not a missing field."""
    data = msgpack.packb({"v": 1, **meta, "t": 1.0, "n": b"n" * 16}, use_bin_type=True)
    return [data, hmac.new(SECRET, data, hashlib.sha256).digest()]

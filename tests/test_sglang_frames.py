"""Pure parts of the SGLang backend: its signed control frames are transfer.wire's envelope
(`transfer.wire.sglang.Frames`), and its secret comes from the deployment's 0600 file (its
buffer geometry and write counts are transfer.geometry's: tests/test_geometry.py)."""

from __future__ import annotations

import hashlib
import hmac

import msgpack
import numpy as np
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)

from transfer.fabric.values import RemoteRegion
from transfer.geometry import KVGroup
from transfer.sglang import conn
from transfer.wire import PROTOCOL_VERSION, WireError, write_secret
from transfer.wire.sglang import TAG, Frames, Hello, LandingArea, Meta, PeerAnswer, RailKeys

SECRET = b"s3cret-of-the-deployment"
META = {"peer": "10.0.0.2:7000", "room": 7, "kv_indices": b"\x01\x00\x00\x00",
        "aux_index": 3, "slot": 1, "gen": 2, "required_dst_info_num": 1, "is_dummy": False,
        "decode_prefix_len": 0}


def test_frames_round_trip_and_reject_tampering() -> None:
    decode, prefill = Frames(SECRET, "decode-a"), Frames(SECRET, "prefill-b")
    frame = decode.encode("META", META)
    assert frame[0] == TAG
    msg = prefill.decode(frame)
    assert (msg.type, msg.body, msg.sender) == ("META", META, "decode-a")
    evil = list(frame)
    evil[1] = evil[1].replace(b"\x07", b"\x08", 1)  # the room, under the MAC
    with pytest.raises(WireError, match="mac"):
        prefill.decode(evil)
    with pytest.raises(WireError, match="mac"):
        Frames(b"another-secret-16b", "prefill-c").decode(decode.encode("META", META))
    with pytest.raises(WireError, match="not a pdtool control frame"):
        prefill.decode([b"KV_STATUS", b"1", b"4", b"0"])
    with pytest.raises(WireError, match=r"META\.room"):  # never sent what the peer would refuse
        decode.encode("META", {**META, "room": -1})


def test_frames_refuse_another_wire_version() -> None:
    """An old peer (version 1, its own codec) is told the version before any field is read."""
    payload = msgpack.packb({"v": 1, "p": "sglang", "k": "META", "from": "old", "sid": b"s" * 16,
                             "to": b"", "seq": 1, "body": META}, use_bin_type=True)
    old = [TAG, payload, hmac.new(SECRET, payload, hashlib.sha256).digest()]
    with pytest.raises(WireError, match=f"protocol version 1, expected {PROTOCOL_VERSION}"):
        Frames(SECRET, "prefill").decode(old)


def test_frames_cannot_be_replayed_and_need_no_clock() -> None:
    decode, prefill = Frames(SECRET, "decode-a"), Frames(SECRET, "prefill-b")
    frame = decode.encode("META", META)
    assert prefill.decode(frame).body["room"] == 7
    with pytest.raises(WireError, match="seq: already seen"):
        prefill.decode(frame)


def test_no_secret_refuses_to_start(monkeypatch) -> None:
    monkeypatch.delenv("PDTOOL_SECRET_FILE", raising=False)
    monkeypatch.delenv("PDTOOL_SECRET", raising=False)
    conn._load_secret.cache_clear()
    with pytest.raises(conn.PdtoolBackendError, match="refusing to start unsigned"):
        conn._secret()
    with pytest.raises(WireError, match="refusing to start unsigned"):
        Frames(b"", "decode")


def test_secret_comes_from_the_0600_file(monkeypatch, tmp_path) -> None:
    path = tmp_path / "secret.key"
    write_secret(path)
    monkeypatch.setenv("PDTOOL_SECRET_FILE", str(path))
    monkeypatch.setenv("PDTOOL_SECRET", "ignored-when-a-file-is-given")
    conn._load_secret.cache_clear()
    mine = conn._secret()
    assert mine == conn._load_secret(str(path), "") != b"ignored-when-a-file-is-given"
    frame = Frames(mine, "decode").encode("META", META)
    other = tmp_path / "other.key"
    write_secret(other)
    monkeypatch.setenv("PDTOOL_SECRET_FILE", str(other))
    with pytest.raises(WireError, match="mac"):
        Frames(conn._secret(), "prefill").decode(frame)
    loose = tmp_path / "loose.key"
    write_secret(loose)
    loose.chmod(0o644)
    monkeypatch.setenv("PDTOOL_SECRET_FILE", str(loose))
    with pytest.raises(conn.PdtoolBackendError, match="lets others read it"):
        conn._secret()


def _region(base: int) -> RemoteRegion:
    return RemoteRegion(base, base + 1, 1 << 20)


def test_records_cross_the_wire_as_they_were_built() -> None:
    """Each frame is decoded once into its record: what the receiver reads is what the
    sender built, field by field (regions, page ids, landing area, draft shards)."""
    decode, prefill = Frames(SECRET, "decode-a"), Frames(SECRET, "prefill-b")
    hello = Hello(compat=b"c" * 16, peer="10.0.0.2:7000", ip="10.0.0.2", port=7000,
                  fabric_name=b"fi-name", provider="tcp;ofi_rxm", tp_size=2, tp_rank=1, gpu=3,
                  iov_limit=4, is_mla=False, page_size=16, num_draft=0,
                  kv=(_region(0x1000), _region(0x2000)), kv_data_lens=(4096, 4096),
                  kv_item_lens=(512, 512), aux=(_region(0x3000),), aux_item_lens=(64,),
                  rails=(RailKeys(b"fi-name-2", (_region(0x5000), _region(0x6000)),
                                  (_region(0x7000),)),))
    got, session = prefill.receive(decode.send(hello))
    assert got == hello and session == decode.session
    answer = PeerAnswer("10.0.0.1:6000", 8, 4, None, KVGroup("draft", 2, 8, True))
    assert decode.receive(prefill.send(answer, to=session))[0] == answer
    refused = PeerAnswer("10.0.0.1:6000", 8, 1, "page sizes differ")
    assert decode.receive(prefill.send(refused, to=session))[0] == refused
    blocks = np.array([5, 9], np.int32)
    meta = Meta("10.0.0.2:7000", 1 << 63, np.array([1, 2, 3], np.int32), None, 7, 9, 2, False,
                16, LandingArea(_region(0x8000), 1 << 16, 4096, blocks, (_region(0x9000),)))
    got = prefill.receive(decode.send(meta))[0]
    assert isinstance(got, Meta) and got.kv_indices.tolist() == [1, 2, 3]
    assert got.landing is not None and got.landing.blocks.tolist() == [5, 9]
    assert (got.room, got.slot, got.gen, got.decode_prefix_len, got.landing.rails) == \
        (1 << 63, 7, 9, 16, (_region(0x9000),))
    dummy = Meta("10.0.0.2:7000", 8, np.array([4], np.int32), 3, 1, 1, 2, True, 0)
    assert prefill.receive(decode.send(dummy))[0].kv_indices.size == 0  # a dummy sends no pages

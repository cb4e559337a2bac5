"""Pure parts of the SGLang backend: signed control frames (its buffer geometry and write
counts are transfer.geometry's: tests/test_geometry.py)."""

from __future__ import annotations

import msgpack
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)

from transfer.sglang import conn


def test_frames_round_trip_and_reject_tampering(monkeypatch) -> None:
    monkeypatch.setenv("PDTOOL_SECRET", "s3cret")
    frame = conn.encode_frame(conn.KIND_META, {"room": 7, "kv_indices": b"\x01\x00\x00\x00"})
    assert conn.decode_frame(frame) == (conn.KIND_META, {"v": conn.WIRE_VERSION, "room": 7,
                                                         "kv_indices": b"\x01\x00\x00\x00"})
    evil = list(frame)
    evil[2] = msgpack.packb({"v": conn.WIRE_VERSION, "room": 8})
    with pytest.raises(ValueError, match="bad HMAC"):
        conn.decode_frame(evil)
    evil = [frame[0], conn.KIND_REGISTER, *frame[2:]]  # the kind is signed too
    with pytest.raises(ValueError, match="bad HMAC"):
        conn.decode_frame(evil)
    monkeypatch.setenv("PDTOOL_SECRET", "other")
    with pytest.raises(ValueError, match=r"secret .*differs"):
        conn.decode_frame(frame)
    with pytest.raises(ValueError, match="not a pdtool control frame"):
        conn.decode_frame([b"KV_STATUS", b"1", b"4", b"0"])


def test_frames_refuse_another_wire_version(monkeypatch) -> None:
    monkeypatch.setattr(conn, "WIRE_VERSION", 99)
    frame = conn.encode_frame(conn.KIND_META, {"room": 1})
    monkeypatch.setattr(conn, "WIRE_VERSION", 1)
    with pytest.raises(ValueError, match="wire version 99"):
        conn.decode_frame(frame)


def test_frames_cannot_be_replayed(monkeypatch) -> None:
    monkeypatch.setenv("PDTOOL_SECRET", "s3cret")
    frame = conn.encode_frame(conn.KIND_META, {"room": 9})
    assert conn.decode_frame(frame)[1]["room"] == 9
    with pytest.raises(ValueError, match="nonce: already seen"):
        conn.decode_frame(frame)


def test_secret_comes_from_the_0600_file(monkeypatch, tmp_path) -> None:
    from transfer.control import write_secret

    path = tmp_path / "secret.key"
    write_secret(path)
    monkeypatch.delenv("PDTOOL_SECRET", raising=False)
    monkeypatch.setenv("PDTOOL_SECRET_FILE", str(path))
    frame = conn.encode_frame(conn.KIND_META, {"room": 1})
    assert conn.decode_frame(frame)[1]["room"] == 1
    monkeypatch.setenv("PDTOOL_SECRET", "ignored-when-a-file-is-given")
    assert conn._secret() == conn._load_secret(str(path), "")
    other = tmp_path / "other.key"
    write_secret(other)
    monkeypatch.setenv("PDTOOL_SECRET_FILE", str(other))
    with pytest.raises(ValueError, match=r"secret .*differs"):
        conn.decode_frame(frame)
    loose = tmp_path / "loose.key"
    write_secret(loose)
    loose.chmod(0o644)
    monkeypatch.setenv("PDTOOL_SECRET_FILE", str(loose))
    with pytest.raises(conn.PdtoolBackendError, match="lets others read it"):
        conn.encode_frame(conn.KIND_META, {"room": 1})

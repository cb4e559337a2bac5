"""Pure parts of the SGLang backend: signed control frames, SGLang buffer geometry, counts."""

from __future__ import annotations

import msgpack
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)

from transfer.layout import LayoutError
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


def test_buffer_layouts_read_sglang_item_lengths() -> None:
    # MHA K buffer: 64 slots x 2 heads x 8 dims x bf16, page size 4 -> item 128 B
    (lay,) = conn.buffer_layouts([64 * 2 * 8 * 2], [128], heads_local=2, page_size=4)
    assert (lay.kind, lay.num_pages, lay.heads_local, lay.page_size, lay.head_dim) == \
        ("NHD", 16, 2, 4, 16)
    with pytest.raises(LayoutError, match="KV buffer 1: item length 100 B"):
        conn.buffer_layouts([2048, 2000], [128, 100], heads_local=2, page_size=4)


@pytest.mark.parametrize(("mla", "heads", "p_tp", "d_tp", "per_page"), [
    (False, 8, 8, 8, 1),        # equal TP: one write per (page, buffer)
    (False, 8, 8, 4, 2 * 64),   # each decode rank rebuilds from 2 prefill ranks, per token
    (False, 8, 4, 8, 64),       # each decode rank takes half of one prefill rank's heads
    (True, 1, 8, 2, 1),         # MLA: latent replicated, one source
])
def test_expected_writes_follow_the_routes(mla, heads, p_tp, d_tp, per_page) -> None:
    n = conn.expected_writes(is_mla=mla, total_heads=heads, prefill_tp=p_tp, decode_tp=d_tp,
                             decode_rank=d_tp - 1, page_size=64, num_pages=10,
                             num_buffers=2 * 61, num_aux=10)
    assert n == 10 * 2 * 61 * per_page + 10


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

"""Staging in the `pdtool` SGLang backend, through SGLang 0.5.23's own classes on the CPU.

Two paths, one mechanism (`transfer/sglang/staging_plane.py`): a TP mismatch on SGLang's NHD
pools packs each page's head slice into a registered bounce buffer and writes it as one
operation per (page, layer buffer, source shard), landing in the decoder's staging area and
scattered into its pool before `KVPoll.Success` (or straight into place where the slice is all
of the decoder's heads); `transfer.gpu_memory=staged` (PDTOOL_GPU_MEMORY, as the worker passes
it) moves every page through host bounce and landing buffers. On the CPU the "device copy" is
a host copy through the same code. The harness is tests/test_sglang_backend.py's: one process
per rank, SGLang's `MHATokenToKVPool` / `MLATokenToKVPool` / `MetadataBuffers`, real libfabric.
"""

from __future__ import annotations

import contextlib
from typing import Any

import helpers.sglang_pair as B
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.sglang_pair import STAGED_ENV, plan_ops

from transfer import geometry as G
from transfer import workerenv
from transfer.routes import ShardSpec, routes_for
from transfer.sglang import staging_plane

ROOM = {11: B.ROOMS[11]}  # 7 scattered pages, chunked prefill sends 3 at a time


# --------------------------------------------------------------------------- rank wrappers
def _tune(cfg: dict[str, Any]) -> None:
    """Small staging memory in this rank process (so the tests exercise the bounds)."""
    for name, value in cfg.get("staging", {}).items():
        setattr(staging_plane, name, value)


class _Tap:
    """The decode rank's pipe: its final report gains its manager's stats."""

    def __init__(self, conn: Any, made: list[Any]) -> None:
        self.conn, self.made = conn, made

    def send(self, msg: Any) -> None:
        if isinstance(msg, tuple) and msg and msg[0] == "done":
            msg = (*msg, self.made[0].stats())
        self.conn.send(msg)

    def recv(self) -> Any:
        return self.conn.recv()

    def poll(self, *a: Any) -> Any:
        return self.conn.poll(*a)


def _wait_for_port(port: int, seconds: float = 900) -> None:
    """Until rank 0's bootstrap server listens (on a loaded machine the ranks start far apart)."""
    import socket
    import time

    deadline = time.time() + seconds
    while time.time() < deadline:
        with socket.socket() as s, contextlib.suppress(OSError):
            s.connect(("127.0.0.1", port))
            return
        time.sleep(0.2)


def staged_prefill(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    """A prefill rank that, like SGLang's scheduler, sends each room's chunks as soon as that
    room's destination is known (a room whose decode waits for landing space comes later)."""
    _tune(cfg)
    import os
    import time

    import numpy as np

    os.environ.update(cfg["env"])
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolKVBootstrapServer, PdtoolKVManager, PdtoolKVSender

    server = PdtoolKVBootstrapServer("127.0.0.1", cfg["bootstrap_port"]) if rank == 0 else None
    _wait_for_port(cfg["bootstrap_port"])  # SGLang's registration gives up after 5 tries
    sa, args, _keep, _aux = B.setup_rank("prefill", cfg, rank)
    mgr = PdtoolKVManager(args, DisaggregationMode.PREFILL, sa, cfg["mla"])
    conn.send("ready")
    senders = {room: PdtoolKVSender(mgr, f"127.0.0.1:{cfg['bootstrap_port']}", room)
               for room in cfg["rooms"]}
    waiting, results = set(senders), {}
    deadline = time.time() + cfg.get("wait", 120)
    while time.time() < deadline and len(results) < len(senders):
        for room, sender in senders.items():
            st = int(sender.poll())
            if room in waiting and st == KVPoll.WaitingForInput:
                req = cfg["rooms"][room]
                src = np.asarray(req["src_pages"], dtype=np.int32)
                sender.init(len(src), req["aux_index"])
                for lo in range(0, len(src), req["chunk"]):
                    sender.send(src[lo: lo + req["chunk"]])
                waiting.discard(room)
            elif st in (KVPoll.Success, KVPoll.Failed) and room not in waiting:
                results[room] = st if st == KVPoll.Success else B.reason_of(sender)
        time.sleep(0.005)
    conn.send(("done", results, mgr.ep.remote_writes, mgr.stats()))
    conn.recv()
    mgr.teardown()
    del server
    os._exit(0)


def staged_decode(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    _tune(cfg)
    from transfer.sglang import conn as backend

    made: list[Any] = []
    init = backend.PdtoolKVManager.__init__

    def keep(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        made.append(self)

    backend.PdtoolKVManager.__init__ = keep
    B.decode_rank(cfg, rank, _Tap(conn, made))


def run(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """Run the pair; (results with the decode reports as check_bytes reads them, the decode
    ranks' stats, the prefill ranks' stats), after checking every page and aux row."""
    cfg.setdefault("start_s", 900)  # ranks import SGLang at once on a shared machine
    res = B.run_pair(cfg, targets=(staged_prefill, staged_decode))
    dec_stats = [d[7] for d in res["decode"]]
    res["decode"] = [d[:7] for d in res["decode"]]
    B.check_bytes(cfg, res)
    return res, dec_stats, [p[3] for p in res["prefill"]]




def per_token_writes(cfg: dict[str, Any], rank: int, pages: int) -> int:
    """What the backend wrote before it packed head slices: one write per token of a partial
    slice of an NHD page (the same pool without `packed_slices`)."""
    pool = G.PagePool("sglang MHA unpacked", "NHD", ("tokens", "heads", "dim"), ("K", "V"), 1,
                      whole_prompt=True)
    src, dst = ShardSpec(cfg["heads"], cfg["prefill_tp"]), ShardSpec(cfg["heads"],
                                                                    cfg["decode_tp"])
    return G.expected_writes(routes_for(src, dst, rank), src, dst, layout=pool,
                             page_size=B.PAGE, num_pages=pages, num_layers=B.LAYERS,
                             buffers_per_layer=2, aux_writes=B.N_AUX)


def check_counts(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    pages = len(ROOM[11]["dst_pages"])
    for rank, (_, out, _, _, remote_writes, stale, _) in enumerate(res["decode"]):
        want = plan_ops(cfg, rank, pages)
        assert out[11]["count"] == remote_writes == want, (rank, out[11])
        assert stale == 0
        # PAGE x fewer writes than one per token (counted before grouping per operation)
        assert per_token_writes(cfg, rank, pages) - B.N_AUX == \
            B.PAGE * (plan_ops(cfg, rank, pages, per_op=1) - B.N_AUX)


# --------------------------------------------------------------------------- TP mismatch
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gqa_tp8_to_tp4_lands_packed_slices_from_two_sources() -> None:
    """8 KV heads, prefill TP8 (1 head/rank) -> decode TP4 (2 heads/rank): each prefill page
    is its rank's whole slice, so it is written straight from SGLang's pool into the decoder's
    landing area (one write per page, buffer and source), scattered before Success."""
    cfg = {"mla": False, "heads": 8, "prefill_tp": 8, "decode_tp": 4, "rooms": ROOM,
           "start_s": 900}  # 12 processes import SGLang at once
    res, dec, pre = run(cfg)
    check_counts(cfg, res)
    assert all(d["landing_delivered"] == 1 and d["landing_rooms"] == 0 for d in dec)
    assert all(p["gathers"] == 0 for p in pre)  # a whole source page needs no packing


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gqa_tp4_to_tp8_packs_on_the_prefill_and_lands_in_place() -> None:
    """Prefill TP4 (2 heads/rank) -> decode TP8 (1 head/rank) over tcp;ofi_rxm: the prefill
    packs each page's head for a decode rank into a bounce buffer (index_select), and the
    packed run is the decoder's whole page: it is written in place, no landing."""
    cfg = {"mla": False, "heads": 8, "prefill_tp": 4, "decode_tp": 8, "rooms": ROOM,
           "provider": "tcp;ofi_rxm", "start_s": 900}
    res, dec, pre = run(cfg)
    check_counts(cfg, res)
    assert all(d["landing_delivered"] == 0 and d["landing_bytes"] == 0 for d in dec)
    assert all(p["gathers"] > 0 and p["bounce_leaked"] == 0 for p in pre)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_gqa_tp2_to_tp1_reassembles_the_page_in_landing(provider: str) -> None:
    cfg = {"mla": False, "heads": 4, "prefill_tp": 2, "decode_tp": 1, "rooms": ROOM,
           "provider": provider}
    res, dec, _pre = run(cfg)
    check_counts(cfg, res)
    assert dec[0]["landing_delivered"] == 1


# --------------------------------------------------------------------------- staged path
# bounce buffers of one operation each (4 pages x 128 B): many pieces through 8 buffers (a
# peer may hold 4);
# a landing area of 42 units of 128 B: room 11 (7 pages x 6 buffers) fills it, so room 12
# waits for its blocks instead of allocating more
TINY = {"BOUNCE_BUFFERS": 8, "BOUNCE_BUFFER_BYTES": 1, "LANDING_BLOCK_BYTES": 1,
        "LANDING_BYTES": 42 * 128, "TRACE": True}


@pytest.mark.timeout(900)
def test_staged_path_bounces_lands_and_bounds_its_memory() -> None:
    """transfer.gpu_memory=staged on equal TP: SGLang's pools are not registered; every page
    goes pool -> bounce buffer -> decode landing -> pool, byte-exact and counted as the direct
    path counts (the copy into the pool happens after the count, before Success)."""
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "rooms": B.ROOMS,
           "extra_env": STAGED_ENV, "staging": TINY}
    res, (dec,), (pre,) = run(cfg)
    (_, out, _, _, remote_writes, stale, _), = res["decode"]
    want = {r: B.ops(len(q["dst_pages"])) * 2 * B.LAYERS + B.N_AUX for r, q in B.ROOMS.items()}
    assert {r: o["count"] for r, o in out.items()} == want
    assert remote_writes == sum(want.values()) and stale == 0
    assert dec["kv_path"] == pre["kv_path"] == "staged"
    # bounded: the landing area never grew, room 12 waited for room 11's blocks
    assert dec["landing_bytes"] == 42 * 128 and dec["landing_waited"] >= 1
    assert dec["landing_delivered"] == 2 and dec["landing_free_blocks"] == 42
    # bounded: 8 bounce buffers of 512 B (4 per peer), reused for every piece
    assert pre["bounce_buffers"] == 8 and pre["bounce_bytes"] == 8 * 512
    assert pre["bounce_in_use_peak"] <= 4 < pre["gathers"] and pre["bounce_leaked"] == 0
    # pipelined: a piece's writes are posted only after its copy, and the copy of the next
    # piece was issued before the previous piece's writes went out
    trace = pre["trace"]
    copy = {n: i for i, (what, n) in enumerate(trace) if what == "copy"}
    post = {n: i for i, (what, n) in enumerate(trace) if what == "post"}
    assert set(copy) == set(post) and len(copy) == pre["gathers"]
    assert all(copy[n] < post[n] for n in post)
    assert sum(copy[n + 1] < post[n] for n in post if n + 1 in copy) >= len(post) // 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_staged_mla_over_tcp_rxm() -> None:
    """The staged path for MLA's latent (one buffer per layer), prefill TP2 -> decode TP1."""
    cfg = {"mla": True, "heads": 1, "prefill_tp": 2, "decode_tp": 1, "rooms": ROOM,
           "provider": "tcp;ofi_rxm", "extra_env": STAGED_ENV}
    res, (dec,), _pre = run(cfg)
    (_, out, _, _, remote_writes, _, _), = res["decode"]
    assert out[11]["count"] == remote_writes == B.ops(7) * B.LAYERS + B.N_AUX
    assert dec["kv_path"] == "staged" and dec["landing_delivered"] == 1


def test_the_worker_passes_the_path_and_nothing_else_is_accepted(monkeypatch) -> None:
    kv_path = staging_plane.kv_path
    monkeypatch.setenv(workerenv.GPU_MEMORY.name, "staged")
    assert kv_path("cpu", "shm").path == "staged"
    monkeypatch.setenv(workerenv.GPU_MEMORY.name, "fast")
    with pytest.raises(workerenv.WorkerEnvError, match="PDTOOL_GPU_MEMORY='fast'"):
        kv_path("cpu", "shm")
    monkeypatch.setenv(workerenv.GPU_MEMORY.name, "direct")
    assert kv_path("cuda", "efa") == staging_plane.KvPath("direct", may_fall_back=False)
    for given in ("auto", None):  # unset (no worker) is auto
        if given is None:
            monkeypatch.delenv(workerenv.GPU_MEMORY.name)
        else:
            monkeypatch.setenv(workerenv.GPU_MEMORY.name, given)
        assert kv_path("cpu", "shm") == staging_plane.KvPath("direct")  # host memory
        assert kv_path("cuda", "tcp;ofi_rxm").path == "staged"
        assert kv_path("cuda", "efa") == staging_plane.KvPath("direct", may_fall_back=True)


def test_gpu_memory_refused_at_start_goes_staged_under_auto_and_fails_under_direct(
        caplog) -> None:
    """What this libfabric answers when a rank asks for GPU memory (an FI_HMEM endpoint on
    tcp;ofi_rxm, a CUDA registration on shm): `auto` goes staged with one warning naming the
    key, `direct` fails naming it and the fix; anything not about GPU memory is raised as is."""
    import numpy as np

    from transfer import fabric
    from transfer.sglang.errors import PdtoolBackendError
    from transfer.sglang.rails import Rails, rail_specs

    auto = staging_plane.KvPath("direct", may_fall_back=True)
    direct = staging_plane.KvPath("direct")

    def open_hmem_rails() -> Rails:  # as the backend opens them (conn._open_rails)
        return Rails.open("tcp;ofi_rxm", rail_specs("tcp;ofi_rxm", (), "127.0.0.1"), 8,
                          receive=False, hmem=True)

    buf = np.zeros(1 << 16, dtype=np.uint8)
    with fabric.Endpoint("shm", max_slots=8, hmem=True) as ep:
        def register_pool() -> Any:
            return ep.register(buf.ctypes.data, buf.nbytes, iface="cuda", device=0)

        for attempt, provider in ((open_hmem_rails, "tcp;ofi_rxm"), (register_pool, "shm")):
            caplog.clear()
            assert staging_plane.direct_or_staged(auto, provider, attempt) is None
            warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert len(warned) == 1 and "transfer.gpu_memory=auto chose staged" in warned[0]
            with pytest.raises(PdtoolBackendError, match=rf"transfer\.gpu_memory=direct: "
                               rf"{provider} cannot use this rank's GPU memory: .*set "
                               rf"transfer\.gpu_memory=staged"):
                staging_plane.direct_or_staged(direct, provider, attempt)

        def bad_pointer() -> Any:  # a caller's error, not the node's answer: no fallback
            return ep.register(0, 0, iface="cuda", device=0)

        with pytest.raises(ValueError, match="need addr > 0"):
            staging_plane.direct_or_staged(auto, "shm", bad_pointer)



"""The SGLang backend's endpoints per NIC and its per-request MLA source, through SGLang 0.5.23.

Same harness as tests/test_sglang_backend.py (SGLang's own managers, senders, receivers and
bootstrap server in one process per rank; SGLang's CPU pools; real libfabric), with each role's
NICs in its environment the way the worker passes them (`PDTOOL_NICS`, the plan's GPU->NIC map).
On one machine the NICs are `tcp;ofi_rxm` endpoints bound to different loopback addresses
(127.0.0.2, 127.0.0.3, ...: a tcp entry that is an address binds it, transfer/sglang/rails.py).
The staged routes (transfer/sglang/staging_plane.py: a GQA TP mismatch landing in the decode's
staging area, the staged GPU-memory path's bounce buffers and landing area) stripe over every
NIC as the direct path does.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import helpers.sglang_pair as tsb
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.sglang_pair import (
    LAYERS,
    N_AUX,
    STAGED_ENV,
    check_bytes,
    collected_metrics,
    ops,
    plan_ops,
    run_pair,
)

from transfer.sglang.conn import MAX_SLOTS
from transfer.sglang.staging_plane import BOUNCE_BUFFERS

TAGS = MAX_SLOTS - BOUNCE_BUFFERS  # a prefill rank's fabric tags for its sends


class _Tap:
    """The child's pipe to the test, adding what the manager saw per endpoint to its "done"
    report (the harness's report format stays as it is)."""

    def __init__(self, conn: Any, made: list[Any]) -> None:
        self.conn, self.made = conn, made

    def recv(self) -> Any:
        return self.conn.recv()

    def send(self, msg: Any) -> None:
        if isinstance(msg, tuple) and msg and msg[0] == "done" and self.made:
            mgr = self.made[0]
            extra = {**mgr.stats(), "addrs": [_address(ep) for ep in mgr.rails.eps]}
            if isinstance(msg[1], dict) and len(msg) == 7:  # decode: (done, out, bufs, ...)
                msg[1]["_nics"] = extra
            else:  # prefill: (done, results, remote_writes, stats)
                msg[3].update(extra)
        self.conn.send(msg)


def _address(ep: Any) -> str:
    name = ep.name
    if ep.provider.startswith("tcp") and len(name) == 16:  # sockaddr_in
        return socket.inet_ntoa(name[4:8])
    return name.decode(errors="replace")


def _rank(role: str, cfg: dict[str, Any], rank: int, conn: Any) -> None:
    """A harness rank (child process) with its role's NICs in the environment and the
    module settings `cfg["tune"]` names ((module, name, value): small staging memory)."""
    os.environ.update(cfg.get("role_env", {}).get(role, {}))
    for module, name, value in cfg.get("tune", ()):
        setattr(importlib.import_module(module), name, value)
    from transfer.sglang import conn as sconn

    made: list[Any] = []
    init = sconn.PdtoolKVManager.__init__

    def tracked(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        made.append(self)

    sconn.PdtoolKVManager.__init__ = tracked  # type: ignore[method-assign]
    target = tsb.prefill_rank if role == "prefill" else tsb.decode_rank
    target(cfg, rank, _Tap(conn, made))


def _run(cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(tsb, "prefill_rank", functools.partial(_rank, "prefill"))
    monkeypatch.setattr(tsb, "decode_rank", functools.partial(_rank, "decode"))
    return run_pair(cfg)


def _nics(*addrs: str) -> dict[str, str]:
    return {"PDTOOL_NICS": json.dumps({"0": ",".join(addrs)})}


def test_a_rank_opens_every_nic_of_its_gpu() -> None:
    """The NICs a rank opens (the worker's PDTOOL_NICS, the plan's GPU->NIC map) and where
    each endpoint binds; the plan no longer narrows tcp/verbs to one NIC when there are more."""
    from pdtool.plan.placement import nic_env
    from transfer.sglang.rails import RailSpec, rail_specs
    from transfer.workerenv import nics_for

    env = {"PDTOOL_NICS": json.dumps({"0": "rdmap79s0,rdmap80s0", "1": "rdmap81s0"})}
    assert nics_for(0, env) == ("rdmap79s0", "rdmap80s0")
    assert nics_for(1, {**env, "PDTOOL_FI_DOMAIN": "rdmap81s0"}) == ("rdmap81s0",)
    assert nics_for(0, {**env, "PDTOOL_FI_DOMAIN": "rdmap80s0"}) == ("rdmap80s0", "rdmap79s0")
    assert nics_for(0, {**env, "PDTOOL_FI_DOMAIN": "eth9"}) == ("eth9",)  # a hand override
    assert nics_for(0, {}) == ()
    assert rail_specs("efa", ("rdmap79s0", "rdmap80s0"), "10.0.0.1") == [
        RailSpec("rdmap79s0", "rdmap79s0", None), RailSpec("rdmap80s0", "rdmap80s0", None)]
    assert rail_specs("tcp;ofi_rxm", ("127.0.0.2", "127.0.0.3"), "127.0.0.1") == [
        RailSpec("127.0.0.2", None, "127.0.0.2"), RailSpec("127.0.0.3", None, "127.0.0.3")]
    # one tcp NIC keeps SGLang's host address as node hint; several take their own
    assert rail_specs("tcp;ofi_rxm", ("eth0",), "10.0.0.1") == [RailSpec("eth0", "eth0",
                                                                           "10.0.0.1")]
    assert [r.node for r in rail_specs("tcp;ofi_rxm", ("eth0", "eth1"), "10.0.0.1")] == \
        [None, None]
    assert rail_specs("shm", ("shm",), None) == [RailSpec("shm", None, None)]
    assert rail_specs("tcp;ofi_rxm", (), "10.0.0.1") == [RailSpec("default", None, "10.0.0.1")]
    assert "FI_TCP_IFACE" not in nic_env("tcp;ofi_rxm", ("eth0", "eth1"), "tcp")
    assert nic_env("tcp;ofi_rxm", ("eth0",), "tcp")["FI_TCP_IFACE"] == "eth0"
    assert "FI_VERBS_DEVICE_NAME" not in nic_env("verbs;ofi_rxm", ("mlx5_0", "mlx5_1"), "x")
    assert nic_env("efa", ("a", "b"), "efa")["FI_EFA_IFACE"] == "a,b"


def _scattered_rooms(n: int, first: int, pages: int = 3,
                     chunk: int = 2) -> dict[int, dict[str, Any]]:
    """`n` rooms of 3 (or `pages`) scattered, non-monotonic pages, chunked 2 (`chunk`) at a
    time, all into the same decode pool: destination page d always receives source page
    (7d + 3) mod 16, so rooms may share destination pages and every page still has one right
    content."""
    out = {}
    for i in range(n):
        dst = [(5 * i + 2) % 16, (5 * i + 9) % 16, (5 * i + 13) % 16] if pages == 3 else \
            [(5 * i + 2 + 7 * k) % 16 for k in range(pages)]
        out[first + i] = {"src_pages": [(7 * d + 3) % 16 for d in dst], "dst_pages": dst,
                          "aux_index": i % tsb.AUX_ROWS, "dst_aux": (i + 3) % tsb.AUX_ROWS,
                          "chunk": chunk}
    return out


@pytest.mark.timeout(600)
def test_every_nic_carries_writes_and_each_operation_is_counted_once(monkeypatch,
                                                                    tmp_path: Path) -> None:
    """Prefill with two endpoints (127.0.0.2, .3), decode with three (.4, .5, .6): every
    endpoint on both sides carries operations, the decoder's per-slot count (its endpoints
    counting into one slot table) is exactly the one-endpoint count, pages byte-exact. The
    transfer metrics (prometheus-client's multiprocess files, as SGLang's --enable-metrics
    collects them) give each NIC's operations and every room's success."""
    rooms = _scattered_rooms(8, 20)
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms,
           "provider": "tcp;ofi_rxm", "metrics_dir": str(tmp_path),
           "role_env": {"prefill": _nics("127.0.0.2", "127.0.0.3"),
                        "decode": _nics("127.0.0.4", "127.0.0.5", "127.0.0.6")}}
    res = _run(cfg, monkeypatch)
    (_, out, *_), = res["decode"]
    nics = out.pop("_nics")
    check_bytes(cfg, res)
    # the count does not change with the NICs: grouped PER_OP per (page run, layer buffer)
    want = {r: ops(len(q["dst_pages"])) * 2 * LAYERS + N_AUX for r, q in rooms.items()}
    assert {r: o["count"] for r, o in out.items()} == want
    assert nics["addrs"] == ["127.0.0.4", "127.0.0.5", "127.0.0.6"]
    spread = nics["rail_writes"]  # operations each decode endpoint received
    assert sum(spread) == sum(want.values()), spread
    assert all(n > 0 for n in spread), spread
    (_, results, _, stats), = res["prefill"]
    assert results == dict.fromkeys(rooms, 4)  # KVPoll.Success on the prefill side too
    assert stats["addrs"] == ["127.0.0.2", "127.0.0.3"]
    assert sum(stats["rail_ops"]) == sum(want.values()) and all(stats["rail_ops"]), stats
    assert stats["tags_free"] == TAGS and stats["rooms"] == 0, stats
    print(f"per-endpoint operations: prefill {stats['rail_ops']}, decode {spread}")
    metrics = collected_metrics(str(tmp_path))
    by_nic: dict[str, float] = {}
    for labels, value in metrics["pdtool_kv_write_operations_total"]:
        by_nic[labels["nic"]] = by_nic.get(labels["nic"], 0) + value
    assert by_nic == {"127.0.0.2": stats["rail_ops"][0], "127.0.0.3": stats["rail_ops"][1]}
    ((labels, ok),) = metrics["pdtool_kv_transfers_succeeded_total"]  # one prefill rank
    assert ok == len(rooms) and labels["rank"] == "0" and ":" in labels["peer"], labels
    assert [v for _, v in metrics["pdtool_kv_transfer_seconds_count"]] == [len(rooms)]


@pytest.mark.timeout(600)
def test_mla_source_replica_is_drawn_per_request(monkeypatch) -> None:
    """MLA, prefill TP2 -> decode TP1: SGLang marks prefill rank 0 real for every request
    (is_dummy in its cached bootstrap infos). The decode draws the sending replica per request,
    so both prefill ranks send (each request once, from one rank), pages byte-exact."""
    rooms = {100 + i: {"src_pages": [i % 16, (i + 5) % 16], "dst_pages": [i % 16, (i + 5) % 16],
                       "aux_index": i % tsb.AUX_ROWS, "dst_aux": i % tsb.AUX_ROWS, "chunk": 1}
             for i in range(32)}
    cfg = {"mla": True, "heads": 1, "prefill_tp": 2, "decode_tp": 1, "rooms": rooms}
    res = _run(cfg, monkeypatch)
    (_, out, *_), = res["decode"]
    out.pop("_nics")
    check_bytes(cfg, res)
    want = {r: ops(2) * LAYERS + N_AUX for r in rooms}
    assert {r: o["count"] for r, o in out.items()} == want
    sent = [p[3]["sends_written"] for p in res["prefill"]]  # rooms each prefill rank wrote
    assert sum(sent) == len(rooms), sent  # each request from exactly one replica
    # both replicas serve (all 32 from one rank: probability 2**-31)
    assert all(n > 0 for n in sent), sent
    assert [p[1] for p in res["prefill"]] == [dict.fromkeys(rooms, 4)] * 2
    print(f"requests per prefill rank: {sent}")


def _check_spread(cfg: dict[str, Any], res: dict[str, Any], decode_addrs: list[str]
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Byte-exact pages, each room's count what the geometry owner (so `pdtool plan`) counts,
    every operation counted once, every NIC of every rank carrying some; (decode stats,
    prefill stats)."""
    (_, out, *_), = res["decode"]
    nics = out.pop("_nics")
    check_bytes(cfg, res)
    want = {r: plan_ops(cfg, 0, len(q["dst_pages"])) for r, q in cfg["rooms"].items()}
    assert {r: o["count"] for r, o in out.items()} == want
    assert nics["addrs"] == decode_addrs
    spread = nics["rail_writes"]  # operations each decode endpoint received
    assert sum(spread) == sum(want.values()) and all(n > 0 for n in spread), spread
    pre = [p[3] for p in res["prefill"]]
    assert [p[1] for p in res["prefill"]] == [dict.fromkeys(cfg["rooms"], 4)] * len(pre)
    assert sum(sum(p["rail_ops"]) for p in pre) == sum(want.values())
    for p in pre:
        assert len(p["rail_ops"]) == 2 and all(p["rail_ops"]), p["rail_ops"]
        assert p["tags_free"] == TAGS and p["rooms"] == 0, p
    print(f"per-endpoint operations: prefill {[p['rail_ops'] for p in pre]}, decode {spread}")
    return nics, pre


_STAGING = "transfer.sglang.staging_plane"
# a 4 MiB landing area in 4 KiB blocks (not 1 GiB: its allocation would dominate the test)
LANDING_TUNE = [(_STAGING, "LANDING_BYTES", 4 << 20), (_STAGING, "LANDING_BLOCK_BYTES", 4096)]


@pytest.mark.timeout(600)
def test_gqa_tp2_to_tp1_lands_through_every_nic(monkeypatch) -> None:
    """GQA (4 KV heads), prefill TP2 -> decode TP1: each prefill rank writes its heads of a
    page from its pool into the decoder's landing area (made for the first request, after
    the decode's lanes started, and registered on each of its three endpoints). Both prefill
    ranks' two endpoints and the decode's three carry writes; counts are the geometry's."""
    rooms = _scattered_rooms(6, 60)
    cfg = {"mla": False, "heads": 4, "prefill_tp": 2, "decode_tp": 1, "rooms": rooms,
           "provider": "tcp;ofi_rxm", "tune": LANDING_TUNE,
           "role_env": {"prefill": _nics("127.0.0.2", "127.0.0.3"),
                        "decode": _nics("127.0.0.4", "127.0.0.5", "127.0.0.6")}}
    nics, pre = _check_spread(cfg, _run(cfg, monkeypatch),
                              ["127.0.0.4", "127.0.0.5", "127.0.0.6"])
    assert nics["landing_delivered"] == len(rooms) and nics["landing_rooms"] == 0
    assert nics["landing_bytes"] == 4 << 20 and nics["kv_path"] == "direct"
    assert all(p["gathers"] == 0 for p in pre)  # whole source pages: no bounce buffer


# bounce buffers of two operations (8 writes of 128 B) and stripes of one (prefill_plane's
# 512 B): a piece's two operations may leave on different NICs
STAGED_TUNE = [*LANDING_TUNE, (_STAGING, "BOUNCE_BUFFER_BYTES", 1024),
               ("transfer.sglang.prefill_plane", "STRIPE_BYTES", 512)]


@pytest.mark.timeout(600)
def test_staged_path_bounces_and_lands_through_every_nic(monkeypatch) -> None:
    """transfer.gpu_memory=staged (CPU tensors): every page goes pool -> bounce buffer ->
    decode landing -> pool. The bounce buffers are registered on both prefill endpoints, the
    landing area on both decode ones; pieces are striped over the NICs (some straddle two),
    and a bounce buffer is reused only once its writes completed on every NIC: byte-exact,
    the geometry's count, every endpoint carrying writes, no buffer leaked."""
    rooms = _scattered_rooms(6, 40, pages=11, chunk=8)  # 8 writes: a piece of 2 operations
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms,
           "provider": "tcp;ofi_rxm", "extra_env": STAGED_ENV, "tune": STAGED_TUNE,
           "role_env": {"prefill": _nics("127.0.0.2", "127.0.0.3"),
                        "decode": _nics("127.0.0.4", "127.0.0.5")}}
    nics, (pre,) = _check_spread(cfg, _run(cfg, monkeypatch), ["127.0.0.4", "127.0.0.5"])
    assert nics["kv_path"] == pre["kv_path"] == "staged"
    assert nics["landing_delivered"] == len(rooms) and nics["landing_bytes"] == 4 << 20
    assert pre["bounce_bytes"] == 8 * 1024 and pre["bounce_leaked"] == 0
    assert pre["bounce_in_use_peak"] <= 4 < pre["gathers"]  # buffers reused
    assert pre["pieces_over_nics"] > 0, pre  # a buffer's writes on both NICs

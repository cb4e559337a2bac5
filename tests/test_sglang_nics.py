"""The SGLang backend's endpoints per NIC and its per-request MLA source, through SGLang 0.5.23.

Same harness as tests/test_sglang_backend.py (SGLang's own managers, senders, receivers and
bootstrap server in one process per rank; SGLang's CPU pools; real libfabric), with each role's
NICs in its environment the way the worker passes them (`PDTOOL_NICS`, the plan's GPU->NIC map).
On one machine the NICs are `tcp;ofi_rxm` endpoints bound to different loopback addresses
(127.0.0.2, 127.0.0.3, ...: a tcp entry that is an address binds it, transfer/sglang/rails.py).
"""

from __future__ import annotations

import functools
import json
import os
import socket
from typing import Any

import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
import test_sglang_backend as tsb
from test_sglang_backend import LAYERS, N_AUX, check_bytes, ops, run_pair

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
    """A harness rank (child process) with its role's NICs in the environment."""
    os.environ.update(cfg.get("role_env", {}).get(role, {}))
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


def _scattered_rooms(n: int, first: int) -> dict[int, dict[str, Any]]:
    """`n` rooms of 3 scattered, non-monotonic pages, chunked 2 at a time, all into the same
    decode pool: destination page d always receives source page (7d + 3) mod 16, so rooms may
    share destination pages and every page still has one right content."""
    out = {}
    for i in range(n):
        dst = [(5 * i + 2) % 16, (5 * i + 9) % 16, (5 * i + 13) % 16]
        out[first + i] = {"src_pages": [(7 * d + 3) % 16 for d in dst], "dst_pages": dst,
                          "aux_index": i % tsb.AUX_ROWS, "dst_aux": (i + 3) % tsb.AUX_ROWS,
                          "chunk": 2}
    return out


@pytest.mark.timeout(600)
def test_every_nic_carries_writes_and_each_operation_is_counted_once(monkeypatch) -> None:
    """Prefill with two endpoints (127.0.0.2, .3), decode with three (.4, .5, .6): every
    endpoint on both sides carries operations, the decoder's per-slot count (its endpoints
    counting into one slot table) is exactly the one-endpoint count, pages byte-exact."""
    rooms = _scattered_rooms(8, 20)
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms,
           "provider": "tcp;ofi_rxm",
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

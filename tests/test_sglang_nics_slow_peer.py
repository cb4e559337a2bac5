"""One stalled decode instance does not hold up another's transfers (issue: "one slow decode
stalls every transfer").

Before, one writer per prefill rank blocked up to 30 s in `write_batch` on the first decode
peer whose queue was full (on `tcp;ofi_rxm` a peer that does not make progress: its
connection is never accepted, every write to it is refused with EAGAIN), so every other
peer's requests waited behind it and then behind its failure. Now each peer has its own queue
and budget and a submission waits at most `SUBMIT_SLICE_S` for one peer (prefill_plane.py).

The test asserts an order, not a time: decode instance A is frozen (SIGSTOP) with many
requests queued to it; decode instance B's requests, sent after A's, all complete — byte-exact
on B, Success on both sides — while A's are still in flight (neither done nor failed); then A
is resumed and its requests complete too. SGLang's real classes and pools, one process per
instance, as in tests/test_sglang_backend.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.sglang_pair import (
    AUX_ROWS,
    LAYERS,
    N_AUX,
    PAGE,
    SLOTS,
    aux_row,
    expected_decode,
    free_port,
    ops,
    poll_until,
    rank_context,
    reason_of,
    setup_rank,
    words,
)

from transfer.sglang.conn import MAX_SLOTS
from transfer.sglang.staging_plane import BOUNCE_BUFFERS

SUCCESS, FAILED = 4, 0  # KVPoll
TAGS = MAX_SLOTS - BOUNCE_BUFFERS  # a prefill rank's fabric tags for its sends


def _prefill(cfg: dict[str, Any], conn: Any) -> None:
    """The prefill instance (TP1): bootstrap server, manager; sends a group's rooms on the
    test's command and reports every room's sender state."""
    os.environ.update(cfg["env"])
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolKVBootstrapServer, PdtoolKVManager, PdtoolKVSender

    server = PdtoolKVBootstrapServer("127.0.0.1", cfg["bootstrap_port"])
    sa, args, _keep, _aux = setup_rank("prefill", cfg, 0)
    mgr = PdtoolKVManager(args, DisaggregationMode.PREFILL, sa, cfg["mla"])
    conn.send("ready")
    senders: dict[int, Any] = {}
    terminal = (KVPoll.Success, KVPoll.Failed)

    def states() -> dict[int, Any]:
        out: dict[int, Any] = {}
        for room, s in senders.items():
            st = int(s.poll())
            out[room] = reason_of(s) if st == FAILED else st
        return out

    while True:
        cmd = conn.recv()
        if cmd[0] == "meta":  # wait until every room of the group has its decode metadata
            rooms = cfg["groups"][cmd[1]]
            group = {r: PdtoolKVSender(mgr, f"127.0.0.1:{cfg['bootstrap_port']}", r)
                     for r in rooms}
            poll_until(group, lambda st: st != KVPoll.Bootstrapping, 120)
            senders.update(group)
            conn.send(states())
        elif cmd[0] == "send":  # chunked prefill of every room of the group
            for room in cfg["groups"][cmd[1]]:
                req, s = cfg["rooms"][room], senders[room]
                src = np.asarray(req["src_pages"], dtype=np.int32)
                s.init(len(src), req["aux_index"])
                for lo in range(0, len(src), req["chunk"]):
                    s.send(src[lo: lo + req["chunk"]])
            conn.send(states())
        elif cmd[0] == "finish":  # wait for the group's rooms, report every room's state
            group = {r: senders[r] for r in cfg["groups"][cmd[1]]}
            poll_until(group, lambda st: st in terminal, 240)
            conn.send((states(), mgr.stats()))
        else:
            break
    mgr.teardown()
    del server
    os._exit(0)


def _decode(cfg: dict[str, Any], conn: Any) -> None:
    """One decode instance (TP1, its own GPU id): registers, sends its rooms' metadata, then
    polls like the scheduler until they finish; reports states, counts and its pool bytes."""
    os.environ.update(cfg["env"])
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolKVManager, PdtoolKVReceiver

    sa, args, (_pool, _meta, bufs), aux = setup_rank("decode", cfg, 0)
    args.gpu_id = cfg["gpu"]  # another GPU: another decode instance, not a restart of one
    mgr = PdtoolKVManager(args, DisaggregationMode.DECODE, sa, cfg["mla"])
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    deadline = time.time() + 240
    while not mgr.try_ensure_parallel_info(addr):
        assert time.time() < deadline, "prefill never registered with the bootstrap server"
        time.sleep(0.2)
    recvs = {}
    for room, req in cfg["rooms"].items():
        recv = PdtoolKVReceiver(mgr, addr, room)
        recv.init(0)
        recv.send_metadata(np.asarray(req["dst_pages"], dtype=np.int32), req["dst_aux"])
        recvs[room] = recv
    conn.send("armed")
    poll_until(recvs, lambda st: st in (KVPoll.Success, KVPoll.Failed), 300)
    out = {}
    for room, r in recvs.items():  # the count first: failure_exception() clears the receiver
        count = int(mgr.ep.recv_counts[r.slot]) if r.slot is not None else 0
        state = int(r.poll())
        out[room] = {"state": state, "count": count,
                     "error": reason_of(r) if state == FAILED else None}
    conn.send(("done", out, [words(b).copy() for b in bufs],
               [(ctypes.string_at(p, n), ilen) for p, n, ilen in aux]))
    conn.recv()
    mgr.teardown()
    os._exit(0)


def _check_pages(cfg: dict[str, Any], report: Any) -> None:
    _, out, bufs, aux = report
    for room, req in cfg["rooms"].items():
        assert out[room]["state"] == SUCCESS, (room, out[room])
        for buf, want in zip(bufs, expected_decode(cfg, 0, room), strict=True):
            got = buf.reshape(SLOTS // PAGE, PAGE, *buf.shape[1:])[req["dst_pages"]]
            assert np.array_equal(got, want), f"room {room}: pages differ"
        for j, (data, ilen) in enumerate(aux):
            row = req["dst_aux"]
            assert data[row * ilen: (row + 1) * ilen] == aux_row(j, ilen), f"aux {j}"


def _rooms(first: int, n: int) -> dict[int, dict[str, Any]]:
    """Rooms sharing one pool: destination page d always gets source page (7d + 3) mod 16."""
    out = {}
    for i in range(n):
        dst = [(3 * i) % 16, (3 * i + 8) % 16]
        out[first + i] = {"src_pages": [(7 * d + 3) % 16 for d in dst], "dst_pages": dst,
                          "aux_index": i % AUX_ROWS, "dst_aux": i % AUX_ROWS, "chunk": 1}
    return out


@pytest.mark.timeout(900)
def test_a_frozen_decode_does_not_hold_up_another_decodes_transfers() -> None:
    rooms_a, rooms_b = _rooms(100, 48), _rooms(11, 4)
    base = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1,
            "bootstrap_port": free_port(), "http_port": free_port(),
            "env": {"PDTOOL_FI_PROVIDER": "tcp;ofi_rxm", "PDTOOL_SECRET": "t0p-secret-of-16+bytes",
                    # long enough that nothing fails on its timeout while A is frozen
                    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600",
                    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
                    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "30"}}
    cfg_p = {**base, "rooms": {**rooms_a, **rooms_b},
             "groups": {"A": list(rooms_a), "B": list(rooms_b)}}
    cfg_a = {**base, "rooms": rooms_a, "gpu": 1}
    cfg_b = {**base, "rooms": rooms_b, "gpu": 2}
    ctx = rank_context()
    procs = []

    def start(target: Any, cfg: dict[str, Any]) -> tuple[Any, Any]:
        a, b = ctx.Pipe()
        p = ctx.Process(target=target, args=(cfg, b), daemon=True)
        p.start()
        procs.append(p)
        return p, a

    try:
        _, pre = start(_prefill, cfg_p)
        proc_a, dec_a = start(_decode, cfg_a)
        _, dec_b = start(_decode, cfg_b)
        assert pre.poll(300) and pre.recv() == "ready", "prefill did not start"
        assert dec_a.poll(300) and dec_a.recv() == "armed"
        pre.send(("meta", "A"))  # A's metadata reached the prefill: A may stop now
        assert pre.poll(300) and all(st != FAILED for st in pre.recv().values())
        os.kill(proc_a.pid, signal.SIGSTOP)  # A's receive side makes no progress any more
        pre.send(("send", "A"))
        assert pre.poll(120)
        pre.recv()
        assert dec_b.poll(300) and dec_b.recv() == "armed"
        pre.send(("meta", "B"))
        assert pre.poll(300)
        pre.recv()
        pre.send(("send", "B"))
        assert pre.poll(120)
        pre.recv()
        pre.send(("finish", "B"))
        assert pre.poll(300)
        states, stats = pre.recv()
        # B done on the prefill side while every room of A is still in flight
        assert all(states[r] == SUCCESS for r in rooms_b), states
        in_flight = {r: states[r] for r in rooms_a}
        assert all(st not in (SUCCESS, FAILED) and not isinstance(st, str)
                   for st in in_flight.values()), in_flight
        assert stats["rooms"] == len(rooms_a), stats  # A's, still held by the prefill
        assert dec_b.poll(300)
        report_b = dec_b.recv()
        _check_pages(cfg_b, report_b)
        # counted as with one peer: pages grouped PER_OP per layer buffer, one per aux buffer
        want = {r: ops(len(q["dst_pages"])) * 2 * LAYERS + N_AUX for r, q in rooms_b.items()}
        assert {r: o["count"] for r, o in report_b[1].items()} == want
        os.kill(proc_a.pid, signal.SIGCONT)  # A makes progress again: its rooms complete
        pre.send(("finish", "A"))
        assert pre.poll(300)
        states, stats = pre.recv()
        assert all(states[r] == SUCCESS for r in rooms_a), states
        assert stats["rooms"] == 0 and stats["tags_free"] == TAGS, stats
        assert dec_a.poll(300)
        _check_pages(cfg_a, dec_a.recv())
        for conn in (dec_a, dec_b, pre):
            with contextlib.suppress(OSError):
                conn.send(("bye",))
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)

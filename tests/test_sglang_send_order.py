"""The prefill send path of the `pdtool` SGLang backend, in the order SGLang's scheduler drives it.

Regression tests for two defects the backend once had (each fails with its fix reverted):

* **`wait_event` / `indices_event`**: with the early send of a radix-cached prefix under
  overlap scheduling the scheduler sets `sender._early_send_wait_event` (an event of the
  forward that may still write those pages) before `sender.send(pages)`, and with
  `supports_host_tensor_indices` it hands the page ids as a host tensor still being copied from
  the device, completed at `indices_event` (`prefill.py` `send_kv_chunk`). The writer must wait
  on both before it reads a page or a page id.
* **abort/write race**: the status check ("is the room still live?") and the in-flight mark
  must be one step. An ABORT handled between them was ACKed at once (nothing in flight yet),
  SGLang reused the decode pages, and the writes then landed in them.

On the CPU there are no CUDA events; the stand-ins below are what such an event guards: its
`synchronize()` completes the forward's page writes (or the page-id copy) before returning, so
a reader that does not wait sees the stale bytes, deterministically. The ABORT is made to arrive
between the status read and what follows by holding the writer's first status read of the room
until the abort was handled (or, where the fix makes the abort wait for the writer, a while).
Everything else is real: SGLang's sender/receiver/manager classes, its bootstrap server,
libfabric `shm`, one process per rank.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.sglang_pair import (
    LAYERS,
    PAGE,
    SLOTS,
    decode_rank,
    expected_decode,
    free_port,
    ops,
    poll_until,
    rank_context,
    reason_of,
    setup_rank,
    words,
)

pytestmark = [pytest.mark.fabric, pytest.mark.sglang]

N_AUX = 10
WRITER = "pdtool-prefill-writer"


class ForwardEvent:
    """Stands in for the CUDA event of a forward still writing pages: `synchronize()` returns
    once the writes are done (here: it performs them)."""

    def __init__(self, finish: Any) -> None:
        self._finish = finish
        self._lock = threading.Lock()
        self.waited = False

    def synchronize(self) -> None:
        with self._lock:
            if not self.waited:
                self._finish()
                self.waited = True

    def query(self) -> bool:
        return self.waited


def _pages(buf: Any) -> np.ndarray:
    """[pages, page, heads, dim] writable view of one prefill layer buffer."""
    w = words(buf)
    return w.reshape(SLOTS // PAGE, PAGE, *w.shape[1:])


def _base_cfg(rooms: dict[int, Any], **extra: Any) -> dict[str, Any]:
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms,
           "bootstrap_port": free_port(), "http_port": free_port(), **extra}
    cfg["env"] = {"PDTOOL_FI_PROVIDER": cfg.get("provider", "shm"),
                  "PDTOOL_SECRET": "t0p-secret-of-16+bytes",
                  "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
                  "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
                  "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", **cfg.get("extra_env", {})}
    return cfg


def _prefill_start(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Prefill rank 0: bootstrap server, pools, manager (as run_pair's prefill does)."""
    os.environ.update(cfg["env"])
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolKVBootstrapServer, PdtoolKVManager

    server = PdtoolKVBootstrapServer("127.0.0.1", cfg["bootstrap_port"])
    sa, args, (_pool, _meta, bufs), _aux = setup_rank("prefill", cfg, 0)
    mgr = PdtoolKVManager(args, DisaggregationMode.PREFILL, sa, False)
    return server, mgr, bufs


def _senders(cfg: dict[str, Any], mgr: Any) -> dict[int, Any]:
    from sglang.srt.disaggregation.base import KVPoll

    from transfer.sglang.conn import PdtoolKVSender

    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    senders = {room: PdtoolKVSender(mgr, addr, room) for room in cfg["rooms"]}
    poll_until(senders, lambda st: st != KVPoll.Bootstrapping, 60)
    return senders


# --------------------------------------------------------------------------- events
def events_prefill(cfg: dict[str, Any], conn: Any) -> None:
    """Room 21: its first two pages are a cached prefix sent early, while (overlap scheduling)
    the previous forward still writes them: stale bytes until the chunk's wait_event.
    Room 22: its page ids arrive as a host tensor whose device->host copy completes at the
    chunk's indices_event; until then it holds other (valid) page ids."""
    import torch
    from sglang.srt.disaggregation.base import KVPoll

    server, mgr, bufs = _prefill_start(cfg)
    conn.send("ready")
    senders = _senders(cfg, mgr)
    early, copied = cfg["rooms"][21], cfg["rooms"][22]

    prefix = np.asarray(early["src_pages"][:2])
    final = [_pages(b)[prefix].copy() for b in bufs]
    for b in bufs:
        _pages(b)[prefix] = 0x5A5A  # what the pages hold before the forward's writes land

    def finish_forward() -> None:
        for b, f in zip(bufs, final, strict=True):
            _pages(b)[prefix] = f

    s = senders[21]
    src = np.asarray(early["src_pages"], dtype=np.int32)
    s.init(len(src), early["aux_index"])
    forward = ForwardEvent(finish_forward)
    s._early_send_wait_event = forward  # what the scheduler sets before an early send
    s.send(src[:2])
    s.send(src[2:])

    s = senders[22]
    right = np.asarray(copied["src_pages"], dtype=np.int64)
    ids = torch.from_numpy(np.roll(right, 1).copy())  # not yet copied: other valid page ids
    copy_done = ForwardEvent(lambda: ids.copy_(torch.from_numpy(right)))
    s.init(len(right), copied["aux_index"])
    s.send(ids, None, num_kv_tokens=len(right) * PAGE, indices_event=copy_done)

    poll_until(senders, lambda st: st in (KVPoll.Success, KVPoll.Failed), 60)
    results = {room: int(x.poll()) for room, x in senders.items()}
    conn.send(("done", results, {"forward_waited": forward.waited,
                                 "copy_waited": copy_done.waited}))
    conn.recv()
    mgr.teardown()
    del server
    os._exit(0)


def _run(cfg: dict[str, Any], prefill: Any, decode: Any) -> tuple[Any, Any, Any, Any]:
    ctx = rank_context()
    pa, pb = ctx.Pipe()
    da, db = ctx.Pipe()
    procs = [ctx.Process(target=prefill, args=(cfg, pb), daemon=True),
             ctx.Process(target=decode, args=(cfg, 0, db), daemon=True)]
    for p in procs:
        p.start()
    return procs, pa, da, ctx


def _reap(procs: list[Any], *pipes: Any) -> None:
    for a in pipes:
        with contextlib.suppress(OSError):
            a.send("bye")
    for p in procs:
        p.join(20)
        if p.is_alive():
            p.kill()
            p.join(5)
    from transfer.fabric import shm_leftovers

    for f in shm_leftovers([p.pid for p in procs]):
        with contextlib.suppress(OSError):
            os.unlink(f)


@pytest.mark.timeout(900)
def test_pages_are_read_only_after_wait_event_and_indices_event() -> None:
    rooms = {21: {"src_pages": [3, 9, 4, 12, 5], "dst_pages": [14, 2, 8, 6, 1],
                  "aux_index": 2, "dst_aux": 5, "chunk": 5},
             22: {"src_pages": [0, 15, 7], "dst_pages": [3, 4, 9],
                  "aux_index": 6, "dst_aux": 0, "chunk": 3}}
    cfg = _base_cfg(rooms)
    procs, pa, da, _ = _run(cfg, events_prefill, decode_rank)
    try:
        assert pa.poll(600) and pa.recv() == "ready"
        assert da.poll(600), "decode rank did not finish"
        tag, out, bufs, _aux, remote_writes, stale, _ = da.recv()
        assert pa.poll(120)
        _, results, waited = pa.recv()
    finally:
        _reap(procs, pa, da)
    assert tag == "done" and results == {21: 4, 22: 4}, (results, out)
    for room, req in rooms.items():
        assert out[room]["states"][-1] == 4, out[room]
        for buf, want in zip(bufs, expected_decode(cfg, 0, room), strict=True):
            got = buf.reshape(SLOTS // PAGE, PAGE, *buf.shape[1:])[req["dst_pages"]]
            assert np.array_equal(got, want), f"room {room}: pages read before their event"
    assert waited == {"forward_waited": True, "copy_waited": True}
    # room 21 in two chunks, counted as its 5 pages in one (grouping does not follow chunks)
    want = {21: ops(5) * 2 * LAYERS + N_AUX, 22: ops(3) * 2 * LAYERS + N_AUX}
    assert {r: o["count"] for r, o in out.items()} == want
    assert remote_writes == sum(want.values()) and stale == 0


# --------------------------------------------------------------------------- abort race
class FirstReadGate(dict):
    """`request_status` whose first read of `room` by the writer thread is held until
    `released` is set (or `hold_s` passed): the read value stays what it was when read, as
    when the thread is preempted right after its status check. Once the abort `arrived` at
    the control thread, the hold ends `grace_s` later even if the abort was not handled: an
    unguarded handler finishes within milliseconds of its arrival (the race), one that waits
    for the writer (the fix) would otherwise wait out the whole `hold_s`."""

    def __init__(self, data: dict, room: int, reached: threading.Event,
                 released: threading.Event, hold_s: float,
                 arrived: threading.Event | None = None, grace_s: float = 0.0) -> None:
        super().__init__(data)
        self.room, self.reached, self.released, self.hold_s = room, reached, released, hold_s
        self.arrived, self.grace_s = arrived, grace_s
        self.armed = True

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        if self.armed and key == self.room and threading.current_thread().name == WRITER:
            self.armed = False
            self.reached.set()
            deadline = time.monotonic() + self.hold_s
            arrived_at = None
            while not self.released.wait(0.01) and time.monotonic() < deadline:
                if arrived_at is None and self.arrived is not None and self.arrived.is_set():
                    arrived_at = time.monotonic()
                if arrived_at is not None and time.monotonic() - arrived_at >= self.grace_s:
                    break
        return value


def abort_prefill(cfg: dict[str, Any], conn: Any) -> None:
    """Room 31 is sent in one chunk; the decode aborts it while the writer sits between its
    status check and whatever follows. Reports whether the abort had been handled by then."""
    from sglang.srt.disaggregation.base import KVPoll

    server, mgr, _bufs = _prefill_start(cfg)
    conn.send("ready")
    senders = _senders(cfg, mgr)
    reached, arrived, handled = threading.Event(), threading.Event(), threading.Event()
    on_abort = mgr._on_abort

    def on_abort_then_tell(msg: list[bytes]) -> None:
        arrived.set()
        on_abort(msg)
        handled.set()

    mgr._on_abort = on_abort_then_tell  # the control thread looks it up per message
    ops_at_ack: list[int] = []  # operations this rank had posted when it sent the ACK
    send_ack = mgr._send_abort_ack

    def count_then_ack(room: int, target: Any) -> None:
        ops_at_ack.append(sum(mgr.plane.rail_ops))
        send_ack(room, target)

    mgr._send_abort_ack = count_then_ack
    mgr.request_status = FirstReadGate(mgr.request_status, 31, reached, handled, hold_s=30,
                                       arrived=arrived, grace_s=5)
    req = cfg["rooms"][31]
    src = np.asarray(req["src_pages"], dtype=np.int32)
    s = senders[31]
    s.init(len(src), req["aux_index"])
    s.send(src)
    assert reached.wait(60), "the writer never read the room's status"
    conn.send(("status-read",))  # the test has the decode abort now
    poll_until(senders, lambda st: st == KVPoll.Failed, 60)
    deadline = time.time() + 60
    while mgr.plane.busy() and time.time() < deadline:
        time.sleep(0.01)  # the room's writes drained (or were dropped) and it was settled
    conn.send(("settled", reason_of(s), ops_at_ack, sum(mgr.plane.rail_ops), mgr.stats()))
    conn.recv()
    mgr.teardown()
    del server
    os._exit(0)


def abort_decode(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    """Decode: META for room 31, then abort it on the test's word; count the writes that land
    after SGLang may reuse the pages (the prefill's deferred ACK arrived)."""
    os.environ.update(cfg["env"])
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolKVManager, PdtoolKVReceiver

    sa, args, (_pool, _meta, bufs), _aux = setup_rank("decode", cfg, rank)
    mgr = PdtoolKVManager(args, DisaggregationMode.DECODE, sa, False)
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    deadline = time.time() + 180
    while not mgr.try_ensure_parallel_info(addr):
        assert time.time() < deadline, "prefill never registered with the bootstrap server"
        time.sleep(0.2)
    req = cfg["rooms"][31]
    recv = PdtoolKVReceiver(mgr, addr, 31)
    recv.init(0)
    recv.send_metadata(np.asarray(req["dst_pages"], dtype=np.int32), req["dst_aux"])
    conn.send(("meta-sent",))
    assert conn.recv() == "abort"
    recv.abort()  # the user cancelled: SGLang's scheduler calls abort()
    # longer than the gate's hold: with the room lock the abort waits for the writer to mark
    # the room in flight, and the gate lets the writer go only after its grace (or its hold)
    deadline = time.time() + 90
    while not mgr.is_abort_release_safe(31, 1) and time.time() < deadline:
        time.sleep(0.001)  # deferred KV release: pages held until the prefill ACKs
    released = mgr.is_abort_release_safe(31, 1)
    at_release = int(mgr.ep.remote_writes)
    conn.send(("released", released))
    assert conn.recv() == "settled"
    deadline = time.time() + 5  # writes the prefill completed are counted here soon after
    while int(mgr.ep.remote_writes) == at_release and time.time() < deadline:
        time.sleep(0.01)
    conn.send(("after", at_release, int(mgr.ep.remote_writes),
               any(words(b).any() for b in bufs)))
    conn.recv()
    recv.clear()
    mgr.teardown()
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_abort_between_status_check_and_writes_is_acked_only_after_they_drained() -> None:
    rooms = {31: {"src_pages": [3, 9, 4, 12, 5, 1, 7], "dst_pages": [14, 2, 8, 6, 1, 11, 10],
                  "aux_index": 2, "dst_aux": 5, "chunk": 7}}
    cfg = _base_cfg(rooms, extra_env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"})
    procs, pa, da, _ = _run(cfg, abort_prefill, abort_decode)
    try:
        assert pa.poll(600) and pa.recv() == "ready"
        assert da.poll(600) and da.recv() == ("meta-sent",)
        assert pa.poll(120) and pa.recv() == ("status-read",)
        da.send("abort")
        assert da.poll(150)
        _, released = da.recv()
        assert pa.poll(120)
        _, reason, ops_at_ack, ops_end, stats = pa.recv()
        da.send("settled")
        assert da.poll(60)
        _, at_release, final, touched = da.recv()
    finally:
        _reap(procs, pa, da)
    assert released, "the prefill never ACKed the abort"
    assert "Aborted by decode-side abort notification" in reason, reason
    assert stats["rooms"] == 0 and stats["problem"] == "", stats
    # the ACK went out once, and no write was posted after it: nothing can land in pages
    # SGLang may already have given to another request (a write posted before it completed
    # first; the decode may count its completion a moment after the ACK arrives)
    assert len(ops_at_ack) == 1, ops_at_ack
    assert ops_end == ops_at_ack[0], (f"{ops_end - ops_at_ack[0]} operations posted after "
                                      f"the abort was ACKed (decode counted {at_release} "
                                      f"writes at release, {final} later; touched: {touched})")

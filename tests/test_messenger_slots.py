"""Slot table, generation fencing and the messengers' refusals.

The slot-table tests run it over numpy arrays of the endpoint's counter dtypes (what the decode
messenger hands it). The others run a real prefill and decode messenger (threads, real
libfabric endpoints and ZeroMQ sockets) in one process: misfitting parts and unauthenticated
peers are refused with the field named, signed nonsense does not stop the prefill, and a writer
holding an old (slot, generation) cannot advance the slot's new owner.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from transfer.fabric import encode_imm
from transfer.messenger import (
    DecodeConfig,
    DecodeMessenger,
    MessengerError,
    PrefillConfig,
    PrefillMessenger,
    TransferStatus,
)
from transfer.plane.slots import SlotTable
from transfer.routes import ShardSpec

SECRET = b"k" * 32


def _table(n: int = 4) -> SlotTable:
    return SlotTable(n, np.zeros(16, np.uint32), np.zeros(16, np.uint16), grace_s=1.0)


def test_generations_move_on_and_completion_is_vectorised():
    t = _table()
    a, b = t.allocate(3), t.allocate(2)
    assert a is not None and b is not None and a[0] != b[0]
    t.counts[a[0]] = 3
    assert t.completed().tolist() == [a[0]]
    t.finish(a[0])
    t.release(a[0])
    assert t.gens[a[0]] != a[1]  # a straggler carrying the old generation is now stale
    again = t.allocate(1)
    assert again is not None and again[0] == a[0] and again[1] != a[1]
    assert encode_imm(*again) != encode_imm(*a)
    assert t.allocate(1) is not None and t.allocate(1) is not None and t.allocate(1) is None


def test_quarantine_waits_for_confirmations_and_their_writes():
    t = _table()
    slot, _gen = t.allocate(10)
    t.counts[slot] = 4
    t.quarantine(slot, "r", {"p0", "p1"})
    t.confirm(slot, "p0", issued=6, now=0.0)
    assert t.ready_to_release(0.1) == []          # p1 has not confirmed
    t.confirm(slot, "p1", issued=2, now=0.2)
    assert t.ready_to_release(0.3) == []          # 8 writes confirmed, 4 landed so far
    t.counts[slot] = 8
    assert t.ready_to_release(0.4) == [slot]


def test_quarantine_of_a_dead_peer_waits_for_its_lease():
    t = _table()
    slot, _gen = t.allocate(5)
    t.quarantine(slot, "r", {"p0"})
    t.peer_dead("p0", lease_end=10.0)
    assert t.ready_to_release(9.9) == []
    assert t.ready_to_release(10.0) == [slot]


def test_confirmed_writes_that_never_land_are_released_after_the_grace():
    t = _table()
    slot, _gen = t.allocate(5)
    t.quarantine(slot, "r", {"p0"})
    t.confirm(slot, "p0", issued=5, now=0.0)
    assert t.ready_to_release(0.5) == []
    assert t.ready_to_release(1.5) == [slot]


# --------------------------------------------------------------------- messengers in-process
def _pair(prefill_kw=None, decode_kw=None, page_size=4):
    spec = ShardSpec(2, 1)
    p_kv = [torch.zeros(8, 2, 2, 4, 8, dtype=torch.bfloat16) for _ in range(2)]
    d_kv = [torch.zeros(8, 2, 2, page_size, 8, dtype=torch.bfloat16) for _ in range(2)]
    pre = PrefillMessenger(PrefillConfig(**{"secret": SECRET, "spec": spec, "peer_spec": spec,
                                            "provider": "tcp;ofi_rxm", "heartbeat_s": 0.1,
                                            "peer_timeout_s": 2.0, **(prefill_kw or {})}), p_kv)
    try:
        dec = DecodeMessenger(DecodeConfig(**{
            "secret": SECRET, "spec": spec, "peer_spec": spec, "provider": "tcp;ofi_rxm",
            "prefill_endpoints": ((pre.address,),), "timeout_s": 3.0, "heartbeat_s": 0.1,
            "peer_timeout_s": 2.0, "quarantine_grace_s": 0.5, **(decode_kw or {})}), d_kv)
    except Exception:
        pre.close()
        raise
    return pre, dec, (p_kv, d_kv)


def _settle(dec, rid, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = dec.status(rid)
        if st.status in (TransferStatus.SUCCESS, TransferStatus.FAILED):
            return st
        time.sleep(0.01)
    raise AssertionError(f"{rid} did not settle: {dec.status(rid)}")


def test_a_part_that_does_not_fit_is_refused_with_the_field_named():
    pre, dec, _keep = _pair(page_size=8)
    try:
        dec.submit("r1", list(range(20)), [0, 1, 2])
        st = _settle(dec, "r1")
        assert st.status is TransferStatus.FAILED
        assert "layout.page_size: this side has 4, the peer 8" in st.reason
        assert pre.poll_requests() == []
    finally:
        dec.close()
        pre.close()


@pytest.mark.slow
def test_a_peer_without_the_secret_gets_nothing():
    pre, dec, _keep = _pair(decode_kw={"secret": b"x" * 32})
    try:
        dec.submit("r1", list(range(9)), [0, 1])
        st = _settle(dec, "r1")
        assert st.status is TransferStatus.FAILED
        assert pre.poll_requests() == []         # never registered, never learned a key
        assert pre._chan.rejected >= 2           # its HELLOs were all refused
        assert "signature" in pre._chan.last_error
    finally:
        dec.close()
        pre.close()


def test_an_old_peer_is_told_the_version_and_no_secret_refuses_to_start():
    """A version-1 REQUEST (the codec before transfer.wire) reaches a live prefill: refused with
    the version, not a field; a messenger without a secret does not start."""
    import hashlib
    import hmac

    import msgpack
    import zmq

    from transfer.wire import PROTOCOL_VERSION

    pre, dec, _keep = _pair()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"old-decoder")
    sock.connect(pre.address)
    try:
        v1 = msgpack.packb({"v": 1, "type": "REQUEST", "from": "old-decoder", "ts": time.time(),
                            "nonce": b"n" * 16, "body": {"rid": "r1"}}, use_bin_type=True)
        sock.send_multipart([v1, hmac.new(SECRET, v1, hashlib.sha256).digest()])
        end = time.monotonic() + 10
        while time.monotonic() < end and "protocol version 1" not in pre._chan.last_error:
            time.sleep(0.02)
        assert pre._chan.last_error.startswith(
            f"envelope.v: protocol version 1, expected {PROTOCOL_VERSION}")
    finally:
        sock.close(0)
        ctx.term()
        dec.close()
        pre.close()
    spec = ShardSpec(2, 1)
    with pytest.raises(ValueError, match="no deployment secret given; refusing to start"):
        PrefillConfig(secret=b"", spec=spec, peer_spec=spec)
    with pytest.raises(ValueError, match="no deployment secret given; refusing to start"):
        DecodeConfig(secret=None, spec=spec, peer_spec=spec, prefill_endpoints=(("tcp://x:1",),))


def test_engine_mistakes_raise_value_errors_naming_the_argument():
    pre, dec, _keep = _pair()
    try:
        with pytest.raises(ValueError, match=r"dst_pages of r1: 1 pages for 9 tokens"):
            dec.submit("r1", list(range(9)), [0])
        with pytest.raises(ValueError, match=r"dst_pages of r1: page ids must lie in \[0, 8\)"):
            dec.submit("r1", list(range(9)), [0, 9])
        with pytest.raises(ValueError, match="token_ids of r1: expected a list of uint32"):
            dec.submit("r1", [1, -2, 3], [0])
        with pytest.raises(ValueError, match="token_ids of r1: expected a list of uint32"):
            dec.submit("r1", [[1, 2], [3, 4]], [0])
        with pytest.raises(ValueError, match="peer: prefill instance 3 does not exist"):
            dec.submit("r1", list(range(9)), [0, 1], peer=3)
        with pytest.raises(ValueError, match="chunk of 'zz': request is not bound"):
            pre.begin_pass([("zz", 0, 4)])
        with pytest.raises(ValueError, match=r"bind_host: '0\.0\.0\.0' listens"):
            PrefillConfig(secret=SECRET, spec=ShardSpec(2, 1), peer_spec=ShardSpec(2, 1),
                          bind_host="0.0.0.0")
    finally:
        dec.close()
        pre.close()


def test_signed_but_broken_requests_do_not_stop_the_prefill():
    """A holder of the secret sending nonsense (a bad fabric name in its HELLO, an impossible
    route in a REQUEST) gets an ABORTED naming the problem; the prefill keeps serving real
    requests."""
    import zmq

    from transfer.wire import Envelope, compat_hash
    from transfer.wire.channel import Channel
    from transfer.wire.messenger import MESSENGER, facts

    pre, dec, _keep = _pair()
    ctx = zmq.Context()
    spec = {"num_kv_heads": 2, "tp": 1, "dp": 1}
    layout = {"kind": "HND", "num_pages": 8, "heads_local": 2, "kv_parts": 2, "page_size": 4,
              "head_dim": 8, "itemsize": 2}
    compat = compat_hash(facts(prefill=spec, decode=spec, layout=layout, num_layers=2,
                               buffers_per_layer=1, provider="tcp;ofi_rxm", aux_row_bytes=[]))
    hello = {
        "role": "decode", "compat": compat, "provider": "tcp;ofi_rxm", "rank": 0,
        "num_parts": 1, "spec": spec, "peer_spec": spec, "layout": layout, "num_layers": 2,
        "buffers_per_layer": 1, "aux_row_bytes": [], "fabric_name": b"\xff" * 7,
        "regions": [{"base": 4096, "key": 1, "length": 1 << 20}] * 2, "aux_regions": [],
        "lanes": [], "writes_per_op": 1, "error": "",
    }
    base = {
        "rid": "bad", "token_ids": np.arange(9, dtype="<u4").tobytes(), "num_tokens": 9,
        "dst_pages": np.array([0, 1], dtype="<u4").tobytes(), "slot": 0, "gen": 1,
        "aux_row": 0, "slices": [{"src_rank": 0, "head_lo": 0, "num_heads": 2,
                                  "src_head_off": 0, "dst_head_off": 0}],
        "aux_rank": 0, "expected": [4], "timeout_s": 5.0,
    }
    evil = [Channel.connect(ctx, Envelope(SECRET, f"insider{i}", MESSENGER), pre.address)
            for i in range(2)]

    def replies(ch, n):
        got, end = [], time.monotonic() + 10
        while time.monotonic() < end and len(got) < n:
            if ch.sock.poll(20):
                got += [m for _, m in ch.recv()]
        return got

    try:
        evil[0].send("HELLO", hello)
        evil[1].send("HELLO", {**hello, "fabric_name": b"\x02\x00" + bytes(14)})
        (h0,), (h1,) = replies(evil[0], 1), replies(evil[1], 1)
        assert h0.body["error"].startswith("fabric_name: ") and h1.body["error"] == ""
        evil[0].send("REQUEST", base)
        evil[1].send("REQUEST", {**base, "rid": "route",
                                 "slices": [{**base["slices"][0], "num_heads": 1}]})
        reasons = sorted(m.body["reason"] for ch in evil for m in replies(ch, 1))
        assert reasons[0].startswith("refused: fabric_name: ")
        assert reasons[1] == "refused: slices: not the routes for the chosen source ranks"
        assert pre.poll_requests() == []
        # the real decoder is still served
        assert _serve(pre, dec, "good", [2, 3]).status is TransferStatus.SUCCESS
    finally:
        for ch in evil:
            ch.close()
        ctx.term()
        dec.close()
        pre.close()


def _prefill(pre, req, src_pages=(4, 5)):
    """The prefill engine's part for one 9-token (2-page) request: bind, one pass over both
    layers, finish."""
    pre.bind(req, list(src_pages))
    pre.begin_pass([(req.rid, 0, 8)])
    for layer in range(2):
        pre.layer_done(layer)
    pre.finish(req.rid)


def _serve(pre, dec, rid, dst_pages):
    """One 9-token request end to end: submit, the prefill engine's part, the settled state."""
    dec.submit(rid, list(range(9)), dst_pages)
    (req,) = _pull(pre)
    _prefill(pre, req)
    return _settle(dec, rid)


def _pull(pre, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pre.poll_requests()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError("no request reached the prefill lead")


def test_late_writes_of_an_old_generation_are_never_counted():
    """A writer holding an earlier transfer's (slot, gen) writes into the decoder while the
    slot's new owner is in flight: its writes land in `stale_writes`, the new transfer still
    needs every one of its own writes, and its pages end up byte-exact."""
    from transfer.fabric import Endpoint, RemoteRegion, encode_imm

    pre, dec, (p_kv, d_kv) = _pair(decode_kw={"timeout_s": 1.0})
    for t in p_kv:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(3)))
    rogue = Endpoint("tcp;ofi_rxm")
    junk = np.full(1 << 16, 0x5A, dtype=np.uint8)
    try:
        dec.submit("old", list(range(9)), [2, 3])
        (old,) = _pull(pre)
        pre.refuse(old, "refused: no room")  # never bound: the decoder fails and aborts it
        assert _settle(dec, "old").status is TransferStatus.FAILED
        dec.release("old")
        part = old.parts[0]
        dec.submit("new", list(range(9)), [2, 3])
        (new,) = _pull(pre)
        assert new.parts[0]["slot"] == part["slot"] and new.parts[0]["gen"] != part["gen"]
        peer = rogue.insert_peer(part["fabric_name"])
        mr = rogue.register_buffer(junk)
        region = RemoteRegion.from_dict(part["regions"][0])
        n = 3
        page = 2 * 2 * 4 * 8 * 2  # heads × kv × tokens × dim × bf16: into the reused pages
        rogue.write_batch(peer, mr, region, np.zeros(n, np.uint64),
                          np.array([2 * page, 2 * page + 128, 3 * page], np.uint64),
                          np.full(n, 128, np.uint64),
                          encode_imm(part["slot"], part["gen"]), tag=0)
        assert rogue.wait_send(0, n, timeout=10)
        end = time.monotonic() + 10
        while dec.stale_writes < n and time.monotonic() < end:
            rogue.poll()
            time.sleep(0.01)
        assert dec.stale_writes == n
        assert dec.status("new").received == 0
        _prefill(pre, new)
        st = _settle(dec, "new")
        ops = 2 * -(-2 // dec.writes_per_op)  # 2 layers x 2 pages, grouped into operations
        assert st.status is TransferStatus.SUCCESS and st.received == st.expected == ops
        for p, d in zip(p_kv, d_kv, strict=True):
            assert torch.equal(d[[2, 3]].view(torch.int16), p[[4, 5]].view(torch.int16))
    finally:
        rogue.close()
        dec.close()
        pre.close()


def test_a_stuck_messenger_thread_is_reported_not_waited_on():
    """When the messenger thread does not come back from a call (seen with libfabric 1.17's shm:
    a peer killed while holding this endpoint's queue lock), `stats()` shows for how long and
    the engine's next `submit` is refused with the reason instead of queued forever. The stall
    is made here by holding the decoder's loop in its step; once it goes round again, requests
    are accepted and served."""
    import threading

    pre, dec, _keep = _pair(decode_kw={"peer_timeout_s": 0.3, "heartbeat_s": 0.05})
    release, entered = threading.Event(), threading.Event()
    step = dec._step

    def stuck_step():
        entered.set()
        release.wait(10)
        return step()

    try:
        dec._step = stuck_step
        assert entered.wait(5)
        time.sleep(0.8)  # > 2 x peer_timeout_s
        assert dec.stats()["stalled_s"] > 0.6
        assert dec.problem().startswith("decode messenger thread stuck for ")
        with pytest.raises(MessengerError, match=r"decode messenger thread stuck for \d"):
            dec.submit("r1", list(range(9)), [0, 1])
        dec._step = step
        release.set()
        end = time.monotonic() + 5
        while dec.stats()["stalled_s"] > 0.1 and time.monotonic() < end:
            time.sleep(0.01)
        assert dec.problem() == ""
        time.sleep(0.5)  # the prefill's PONGs are read again (the stall made it look silent)
        assert _serve(pre, dec, "r1", [0, 1]).status is TransferStatus.SUCCESS
    finally:
        release.set()
        dec.close()
        pre.close()

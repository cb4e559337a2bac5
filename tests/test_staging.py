"""The staged GPU-memory path (transfer.staging) on CPU: the "device" copies are host copies
through the same code. Real endpoints: a receiver process over shm and tcp;ofi_rxm for the
byte-exact, counted transfer; in-process endpoints with a receiving thread where the test
inspects the sender's pipeline (order of copies and posts, bounce memory in use)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch

from transfer.fabric import Endpoint, encode_imm
from transfer.staging import BouncePool, Chunk, LandingPool, StagedSender

PAGE = 16 * 1024
KV_PAGES = 96
WAIT_S = 30.0
PROVIDERS = [pytest.param("shm", id="shm"), pytest.param("tcp;ofi_rxm", id="tcp")]


def ep_kwargs(provider: str) -> dict[str, str]:
    return {"domain": "lo"} if provider.startswith("tcp") else {}


def expected_ops(layers: list[int], per_op: int) -> int:
    """What the decoder counts for unstaged writes: one operation per `per_op` pages a layer."""
    return sum(-(-n // per_op) for n in layers)


def _receiver(provider: str, dst_pages: list[int], conn) -> None:
    """Decode side: a landing grant for the request's pages, the count, then host -> "device"."""
    ep = Endpoint(provider, **ep_kwargs(provider))
    kv = torch.zeros(KV_PAGES * PAGE, dtype=torch.uint8)  # the engine's KV buffer (CPU here)
    landing = LandingPool(ep, capacity_bytes=64 * PAGE, block_bytes=8 * PAGE)
    grant = landing.reserve(np.full(len(dst_pages), PAGE, np.uint64))
    ep.arm(5, 9)
    conn.send((ep.name, grant.region.to_dict(), grant.dst_offsets.tolist()))
    want = conn.recv()
    reached = ep.wait_recv(5, want, WAIT_S)
    before = kv.clone()
    landing.deliver(grant, kv, np.array(dst_pages, np.uint64) * np.uint64(PAGE))
    landing.release(grant)
    conn.send({"reached": reached, "count": int(ep.recv_counts[5]), "kv": kv.numpy().tobytes(),
               "untouched_before_deliver": bool(torch.equal(before, torch.zeros_like(kv))),
               "free_blocks": landing.free_blocks, "stale": ep.stale_writes,
               "cuda": torch.cuda.is_initialized()})
    conn.recv()
    landing.close()
    ep.close()


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_staged_transfer_is_byte_exact_and_counted_between_processes(provider):
    """Four layers of scattered KV pages go device -> bounce -> fabric -> landing -> device:
    the decoder counts exactly the operations unstaged writes would make, and its KV buffer
    changes only when delivered, then equals the prefill's pages byte for byte."""
    rng = np.random.default_rng(11)
    layers = [7, 12, 3, 10]
    per_op = 2
    n = sum(layers)
    src_pages = rng.choice(KV_PAGES, n, replace=False)
    dst_pages = rng.choice(KV_PAGES, n, replace=False).tolist()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(provider, dst_pages, child), daemon=True)
    proc.start()
    try:
        name, region, landing_offsets = parent.recv()
        from transfer.fabric import RemoteRegion

        kv = torch.randint(0, 256, (KV_PAGES * PAGE,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(3))
        with Endpoint(provider, **ep_kwargs(provider)) as ep:
            pool = BouncePool(ep, buffers=3, buffer_bytes=5 * PAGE)  # layers split across it
            sender = StagedSender(ep, pool)
            peer = ep.insert_peer(name)
            want = expected_ops(layers, per_op)
            parent.send(want)
            chunks, start = [], 0
            for count in layers:
                sel = slice(start, start + count)
                chunks.append(Chunk(kv, src_pages[sel].astype(np.uint64) * np.uint64(PAGE),
                                    np.full(count, PAGE, np.uint64),
                                    np.array(landing_offsets[sel], np.uint64)))
                start += count
            ops = sender.send(peer, RemoteRegion.from_dict(region), chunks,
                              imm=encode_imm(5, 9), per_op=per_op)
            sender.flush()
            result = parent.recv()
            assert ops == want and pool.in_use_peak <= pool.buffers
            assert ep.errors == []
            sender.close()
            pool.close()
            parent.send("bye")
        proc.join(WAIT_S)
    finally:
        if proc.is_alive():
            proc.kill()
    assert result["reached"] and result["count"] == want and result["stale"] == 0
    assert result["untouched_before_deliver"] and result["free_blocks"] == 8
    got = np.frombuffer(result["kv"], np.uint8).reshape(KV_PAGES, PAGE)
    expect = np.zeros((KV_PAGES, PAGE), np.uint8)
    expect[dst_pages] = kv.numpy().reshape(KV_PAGES, PAGE)[src_pages]
    assert np.array_equal(got, expect)
    assert result["cuda"] is False and not torch.cuda.is_initialized()  # CPU tensors: no CUDA


def _receiver_then_hang(provider: str, conn) -> None:
    """Takes the first operation (the connection is up), then stops making progress."""
    ep = Endpoint(provider, **ep_kwargs(provider))
    landing = LandingPool(ep, capacity_bytes=64 * PAGE, block_bytes=8 * PAGE)
    grant = landing.reserve(np.full(64, PAGE, np.uint64))
    conn.send((ep.name, grant.region.to_dict(), grant.dst_offsets.tolist()))
    conn.send(ep.wait_recv(0, 1, WAIT_S))
    time.sleep(120)


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_stalled_receiver_fails_the_send_within_its_timeout(provider):
    """A decoder that stops draining its queue: the sender's bounce buffers never come free
    (or its queue stays full), and send raises FabricError saying so after its timeout
    instead of hanging."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_then_hang, args=(provider, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(WAIT_S)
        name, region, offsets = parent.recv()
        from transfer.fabric import FabricError, RemoteRegion

        remote = RemoteRegion.from_dict(region)
        offsets = np.array(offsets, np.uint64)
        kv = torch.ones(KV_PAGES * PAGE, dtype=torch.uint8)
        with Endpoint(provider, **ep_kwargs(provider)) as ep:
            pool = BouncePool(ep, buffers=2, buffer_bytes=4 * PAGE)
            sender = StagedSender(ep, pool, timeout=2.0)
            peer = ep.insert_peer(name)
            one = Chunk(kv, np.zeros(1, np.uint64), np.array([PAGE], np.uint64), offsets[:1])
            sender.send(peer, remote, [one], imm=encode_imm(0, 0))
            assert parent.poll(WAIT_S) and parent.recv() is True
            chunks = [Chunk(kv, np.arange(4, dtype=np.uint64) * np.uint64(PAGE),
                            np.full(4, PAGE, np.uint64), offsets[4 * (i % 16):4 * (i % 16) + 4])
                      for i in range(1024)]  # 64 MiB: more than tcp's socket buffers take
            t0 = time.monotonic()
            with pytest.raises(FabricError, match=r"bounce buffer|queue stayed full"):
                sender.send(peer, remote, chunks, imm=encode_imm(0, 0))
                sender.flush()
            assert time.monotonic() - t0 < WAIT_S
            sender.close()
    finally:
        proc.kill()
        proc.join(WAIT_S)


class _Pair:
    """A sender and a receiver endpoint in this process; the receiver's CQ drained by a
    thread (on shm the receiver performs the copies), as the decoder's messenger does."""

    def __init__(self, provider: str) -> None:
        self.tx = Endpoint(provider, **ep_kwargs(provider))
        self.rx = Endpoint(provider, **ep_kwargs(provider))
        self.peer = self.tx.insert_peer(self.rx.name)

    def receive(self, slot: int, gen: int, count: int) -> threading.Thread:
        self.rx.arm(slot, gen)
        t = threading.Thread(target=self.rx.wait_recv, args=(slot, count, WAIT_S))
        t.start()
        return t

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def test_pipeline_copies_ahead_and_bounce_memory_stays_bounded():
    """Ten chunks through a two-buffer pool: each chunk's writes are posted only after its
    copy, the next chunk's copy is issued before the current chunk's writes are posted, never
    more chunks are staged than buffers, and the pool's memory is what it allocated at start
    (the transfer is five times larger)."""
    pair = _Pair("shm")
    try:
        pages, per_chunk = 40, 4
        kv = torch.randint(0, 256, (pages * PAGE,), dtype=torch.uint8)
        landing = LandingPool(pair.rx, capacity_bytes=pages * PAGE, block_bytes=8 * PAGE)
        grant = landing.reserve(np.full(pages, PAGE, np.uint64))
        pool = BouncePool(pair.tx, buffers=2, buffer_bytes=per_chunk * PAGE)
        trace: list[tuple[str, int]] = []
        sender = StagedSender(pair.tx, pool, trace=trace)
        t = pair.receive(2, 4, pages)
        order = np.random.default_rng(2).permutation(pages).astype(np.uint64)
        chunks = [Chunk(kv, order[i:i + per_chunk] * np.uint64(PAGE),
                        np.full(per_chunk, PAGE, np.uint64), grant.dst_offsets[i:i + per_chunk])
                  for i in range(0, pages, per_chunk)]
        assert sender.send(pair.peer, grant.region, chunks, imm=encode_imm(2, 4)) == pages
        sender.flush()
        t.join(WAIT_S)
        assert int(pair.rx.recv_counts[2]) == pages
        nchunks = pages // per_chunk
        where = {e: i for i, e in enumerate(trace)}
        assert sorted(where) == sorted([(k, i) for k in ("copy", "post")
                                        for i in range(nchunks)])
        assert all(where[("copy", i)] < where[("post", i)] for i in range(nchunks))
        assert all(where[("copy", i + 1)] < where[("post", i)] for i in range(nchunks - 1))
        staged = peak = 0
        for kind, _ in trace:
            staged += 1 if kind == "copy" else -1
            peak = max(peak, staged)
        assert peak == 2 and pool.in_use_peak == 2
        assert pool.allocated_bytes == 2 * per_chunk * PAGE == pool.memory.numel()
        out = torch.zeros_like(kv)
        landing.deliver(grant, out, np.arange(pages, dtype=np.uint64) * np.uint64(PAGE))
        assert torch.equal(out.view(pages, PAGE), kv.view(pages, PAGE)[torch.as_tensor(
            order.astype(np.int64))])
        sender.close()
        landing.close()
        pool.close()
    finally:
        pair.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_chunks_larger_than_a_buffer_keep_the_operation_count_and_odd_ranges_arrive(provider):
    """A chunk cut to fit a bounce buffer is cut at multiples of per_op, so the decoder counts
    ceil(n / per_op) operations as for one write_batch; ranges of uneven lengths and offsets
    (head slices) take the generic copy path and arrive byte-exact."""
    pair = _Pair(provider)
    try:
        kv = torch.randint(0, 256, (KV_PAGES * PAGE,), dtype=torch.uint8)
        lengths = np.array([PAGE, 300, 4096, 17, PAGE, PAGE, 1000, 5, 2 * PAGE, 64], np.uint64)
        src = np.array([0, 7 * PAGE + 3, 20 * PAGE, 33, 40 * PAGE, 2 * PAGE, 50 * PAGE + 9,
                        60 * PAGE, 70 * PAGE, 90 * PAGE], np.uint64)
        landing = LandingPool(pair.rx, capacity_bytes=16 * PAGE, block_bytes=2 * PAGE)
        grant = landing.reserve(lengths)
        pool = BouncePool(pair.tx, buffers=2, buffer_bytes=3 * PAGE)
        sender = StagedSender(pair.tx, pool)
        per_op = 3
        want = -(-len(lengths) // per_op)
        t = pair.receive(9, 1, want)
        assert sender.send(pair.peer, grant.region, [Chunk(kv, src, lengths, grant.dst_offsets)],
                           imm=encode_imm(9, 1), per_op=per_op) == want
        sender.flush()
        t.join(WAIT_S)
        assert int(pair.rx.recv_counts[9]) == want
        out = torch.zeros(int(lengths.sum()), dtype=torch.uint8)
        dst = np.zeros(len(lengths), np.uint64)
        np.cumsum(lengths[:-1], out=dst[1:])
        landing.deliver(grant, out, dst)
        expect = torch.cat([kv[int(s):int(s + n)] for s, n in zip(src, lengths, strict=True)])
        assert torch.equal(out, expect)
        with pytest.raises(ValueError, match="bounce buffer"):
            sender.send(pair.peer, grant.region,
                        [Chunk(kv, np.zeros(1, np.uint64), np.array([4 * PAGE], np.uint64),
                               np.zeros(1, np.uint64))], imm=encode_imm(9, 1))
        sender.close()
        landing.close()
        pool.close()
    finally:
        pair.close()


def test_landing_pool_is_bounded_and_reused():
    """Reservations take whole blocks; one that does not fit now waits (None) until an earlier
    grant is released; one that could never fit is a ValueError naming the sizes."""
    with Endpoint("shm") as ep:
        landing = LandingPool(ep, capacity_bytes=8 * PAGE, block_bytes=2 * PAGE)
        assert landing.allocated_bytes == 8 * PAGE and landing.free_blocks == 4
        a = landing.reserve(np.full(5, PAGE, np.uint64))   # 3 blocks (2 + 2 + 1 pages)
        assert a is not None and len(a.blocks) == 3 and landing.free_blocks == 1
        assert len({int(o) for o in a.dst_offsets}) == 5
        assert all(int(o) // (2 * PAGE) in a.blocks for o in a.dst_offsets)
        assert landing.reserve(np.full(3, PAGE, np.uint64)) is None
        landing.release(a)
        b = landing.reserve(np.full(3, PAGE, np.uint64))
        assert b is not None and landing.free_blocks == 2
        with pytest.raises(ValueError, match="needs 9 blocks"):
            landing.reserve(np.full(9, 2 * PAGE, np.uint64))
        with pytest.raises(ValueError, match="exceeds"):
            landing.reserve(np.array([3 * PAGE], np.uint64))
        with pytest.raises(ValueError, match="buffers must be >= 2"):
            BouncePool(ep, buffers=1)
        landing.close()


def test_a_bounce_buffer_written_over_two_endpoints_is_free_once_both_completed():
    """One bounce buffer's writes leave on two endpoints (two NICs: SGLang's backend stripes a
    piece over them, its `Rails` being the pool's carriers). The buffer is registered on both,
    its completions are summed over both, and it comes free only once the write on the
    second endpoint completed too (on shm the receiver performs the copy, so a receiver that
    does not poll holds its write); the bytes on both receivers are the buffer's."""
    from transfer.sglang.rails import Rails

    txs = [Endpoint("shm") for _ in range(2)]
    rxs = [Endpoint("shm") for _ in range(2)]
    carriers = Rails(txs, ["nic0", "nic1"])
    try:
        pool = BouncePool(txs[0], buffers=2, buffer_bytes=2 * PAGE, carriers=carriers)
        twins = [carriers.twin(pool.mr, i) for i in range(2)]
        assert twins[0] is pool.mr and twins[1].addr == pool.mr.addr and twins[1]._ep is txs[1]
        landing = [torch.zeros(PAGE, dtype=torch.uint8) for _ in rxs]
        regions = [rx.register_buffer(m).descriptor() for rx, m in zip(rxs, landing, strict=True)]
        peers = [tx.insert_peer(rx.name) for tx, rx in zip(txs, rxs, strict=True)]
        buf = pool.try_take()
        data = torch.randint(0, 256, (2 * PAGE,), dtype=torch.uint8)
        pool.view(buf).copy_(data)

        def write(i: int, slot: int, tag: int) -> None:  # half i of the buffer on endpoint i
            assert txs[i].write_batch(peers[i], twins[i], regions[i],
                                      np.array([buf * 2 * PAGE + i * PAGE], np.uint64),
                                      np.zeros(1, np.uint64), np.array([PAGE], np.uint64),
                                      imm=encode_imm(slot, 1), tag=tag) == 1

        for i, rx in enumerate(rxs):  # connect both paths first, both receivers polling
            rx.arm(2, 1)
            t = threading.Thread(target=rx.wait_recv, args=(2, 1, WAIT_S))
            t.start()
            write(i, 2, 0)
            t.join(WAIT_S)
            assert txs[i].wait_send(0, 1, WAIT_S)
        for i, rx in enumerate(rxs):
            rx.arm(3, 1)
            write(i, 3, pool.tag_base + buf)
        pool.posted_to(buf, 2)
        assert rxs[0].wait_recv(3, 1, WAIT_S) and txs[0].wait_send(pool.tag_base + buf, 1,
                                                                   WAIT_S)
        for _ in range(20):  # the second receiver does not poll: its write stays pending
            carriers.poll()
            time.sleep(0.005)
        assert carriers.send_done(pool.tag_base + buf) == 1
        assert pool.reclaim(block=False, timeout=0) == [] and pool.in_use() == 1
        assert rxs[1].wait_recv(3, 1, WAIT_S)
        pool.wait_all(WAIT_S)  # polls both endpoints until the buffer's writes completed
        assert pool.in_use() == 0 and pool.has_free
        assert carriers.send_done(pool.tag_base + buf) == 2
        assert torch.equal(landing[0], data[:PAGE]) and torch.equal(landing[1], data[PAGE:])
        pool.close()
        assert all(t.closed for t in twins)
    finally:
        for ep in txs + rxs:
            ep.close()


def test_landed_units_reach_the_device_run_by_run_as_an_index_select_would():
    """`_Copier.landed_to`: units in runs (whole landing blocks) and single ones, in any
    order, come out as `index_select` gives them, one copy per contiguous run."""
    from transfer.staging import _Copier

    units = torch.arange(40 * 8, dtype=torch.uint8).view(40, 8)
    rows = np.array([4, 5, 6, 7, 30, 12, 13, 2, 3], dtype=np.int64)
    got = _Copier(torch.device("cpu")).landed_to(units, rows, torch.device("cpu"))
    assert torch.equal(got, units.index_select(0, torch.from_numpy(rows)))

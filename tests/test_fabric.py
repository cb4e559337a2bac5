"""The libfabric binding (transfer.fabric) between real processes over shm and tcp;ofi_rxm.

Each test starts a target process (multiprocessing, spawn) that opens an endpoint, registers a
KV-shaped buffer and sends its name and region descriptor over a pipe; this process writes
scattered pages into it with immediate data and both sides check counts and bytes. Nothing is
mocked: libfabric moves the bytes, and manual progress means the target must poll to receive.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from transfer.fabric import (
    Endpoint,
    FabricError,
    GpuMemoryError,
    RemoteRegion,
    WriteGroup,
    available_providers,
    decode_imm,
    encode_imm,
    gpu_direct_support,
    shm_leftovers,
)
from transfer.plane.stall import StallWatch

ROOT = Path(__file__).resolve().parent.parent
PROVIDERS = [pytest.param("shm", id="shm"), pytest.param("tcp;ofi_rxm", id="tcp")]
PAGE = 64 * 1024
N_DST_PAGES = 96
SCRATCH = PAGE  # a tail area (after the pages) that stale writes land in
WAIT_S = 20.0


def ep_kwargs(provider: str) -> dict[str, str]:
    """Loopback for tcp (eth0 is listed first by fi_getinfo)."""
    return {"domain": "lo"} if provider.startswith("tcp") else {}


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Remove /dev/shm regions of processes that died during the test (a SIGKILLed shm peer
    leaves ~16 MiB); tests that kill peers also assert their own files are gone."""
    before = set(os.listdir("/dev/shm"))
    yield
    left = [p for p in shm_leftovers() if os.path.basename(p) not in before]
    for p in left:
        with contextlib.suppress(FileNotFoundError):  # its owner's cleanup may race us
            os.unlink(p)


# ------------------------------------------------------------------ target process bodies
def _target_counts(provider: str, arm: list[tuple[int, int, int]], total: int, conn) -> None:
    """Register a torch bf16 KV buffer, arm slots, count until expected, report bytes."""
    import torch

    ep = Endpoint(provider, remote_counter=True, **ep_kwargs(provider))
    # HND page layout [pages, kv, heads, page_size, head_dim] in bf16 = 64 KiB per page
    kv = torch.zeros(N_DST_PAGES, 2, 2, 64, 128, dtype=torch.bfloat16)
    scratch = torch.zeros(SCRATCH, dtype=torch.uint8)
    mr = ep.register_buffer(kv)
    mr_s = ep.register_buffer(scratch)
    for slot, gen, _ in arm:
        ep.arm(slot, gen)
    conn.send((ep.name, mr.descriptor().to_dict(), mr_s.descriptor().to_dict()))
    reached = {slot: ep.wait_recv(slot, want, WAIT_S) for slot, _, want in arm}
    deadline = time.monotonic() + WAIT_S
    while ep.remote_writes < total and time.monotonic() < deadline:
        ep.poll()
    conn.send({
        "reached": reached,
        "counts": {slot: int(ep.recv_counts[slot]) for slot, _, _ in arm},
        "stale": ep.stale_writes,
        "remote_writes": ep.remote_writes,
        "has_counter": ep.has_remote_counter,
        "counter": ep.remote_counter,
        "kv": kv.view(torch.uint8).numpy().tobytes(),
        "errors": ep.errors,
    })
    conn.recv()  # keep the endpoint open until the initiator is done
    ep.close()


def _target_then_hang(provider: str, conn) -> None:
    """Register, let the connection come up, then stop making progress (and get killed)."""
    ep = Endpoint(provider, **ep_kwargs(provider))
    buf = np.zeros(64 << 20, dtype=np.uint8)
    mr = ep.register_buffer(buf)
    conn.send((ep.name, mr.descriptor().to_dict(), os.getpid()))
    # progress until the initiator's first write landed (connection up), then stop
    conn.send("ready" if ep.wait_recv(0, 1, WAIT_S) else "first write never arrived")
    time.sleep(60)


def off(pages) -> np.ndarray:
    return np.asarray(pages, dtype=np.uint64) * PAGE


def _spawn(fn, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=fn, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def _recv(conn, proc, timeout: float = WAIT_S):
    if not conn.poll(timeout):
        proc.kill()
        raise AssertionError(f"target process sent nothing within {timeout}s "
                             f"(exitcode {proc.exitcode})")
    return conn.recv()


# ------------------------------------------------------------------ tests
def test_providers_present():
    provs = available_providers()
    assert "shm" in provs and "tcp;ofi_rxm" in provs, provs


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_scattered_pages_counted_per_slot_and_byte_exact(provider):
    rng = np.random.default_rng(7)
    n_a, n_b, n_stale = 48, 16, 5
    slot_a, gen_a, slot_b, gen_b = 3, 5, 700, 65535
    arm = [(slot_a, gen_a, n_a), (slot_b, gen_b, n_b)]
    total = n_a + n_b + n_stale
    proc, conn = _spawn(_target_counts, provider, arm, total)
    try:
        name, kv_desc, scratch_desc = _recv(conn, proc)
        remote = RemoteRegion.from_dict(kv_desc)
        scratch = RemoteRegion.from_dict(scratch_desc)
        assert remote.length == N_DST_PAGES * PAGE

        with Endpoint(provider, **ep_kwargs(provider)) as ep:
            src = rng.integers(0, 256, size=(64, PAGE), dtype=np.uint8)  # numpy on this side
            mr = ep.register_buffer(src)
            peer = ep.insert_peer(name)
            dst_pages = rng.permutation(N_DST_PAGES)[: n_a + n_b]  # scattered, unique
            src_pages = rng.integers(0, 64, size=n_a + n_b)        # any source page
            lens = np.full(n_a + n_b, PAGE, dtype=np.uint64)
            # transfer A in one batch; transfer B in two batches (counts accumulate)
            ep.write_batch(peer, mr, remote, off(src_pages[:n_a]), off(dst_pages[:n_a]),
                           lens[:n_a], encode_imm(slot_a, gen_a), tag=1)
            for part in (slice(n_a, n_a + 6), slice(n_a + 6, n_a + n_b)):
                ep.write_batch(peer, mr, remote, off(src_pages[part]), off(dst_pages[part]),
                               lens[part], encode_imm(slot_b, gen_b), tag=2)
            # late writes of an older generation of slot A: must land but not be counted
            ep.write_batch(peer, mr, scratch, np.zeros(n_stale, np.uint64),
                           np.arange(n_stale, dtype=np.uint64) * 64,
                           np.full(n_stale, 64, np.uint64), encode_imm(slot_a, gen_a - 1), tag=3)
            assert ep.wait_send(1, n_a, WAIT_S) and ep.wait_send(2, n_b, WAIT_S)
            assert ep.wait_send(3, n_stale, WAIT_S)
            assert ep.wait_idle(WAIT_S) and ep.inflight == 0
            assert list(ep.send_done[1:4]) == [n_a, n_b, n_stale]
            assert ep.errors == []

            rep = _recv(conn, proc)
            conn.send("bye")
        proc.join(WAIT_S)
        assert rep["errors"] == []
        assert rep["reached"] == {slot_a: True, slot_b: True}
        assert rep["counts"] == {slot_a: n_a, slot_b: n_b}
        assert rep["stale"] == n_stale
        assert rep["remote_writes"] == total
        if provider == "shm":  # FI_RMA_EVENT: the remote-write counter fast path moves
            assert rep["has_counter"] and rep["counter"] == total
        else:  # rxm has no FI_RMA_EVENT (docs/libfabric.md): counting relies on CQ data alone
            assert not rep["has_counter"]
        got = np.frombuffer(rep["kv"], dtype=np.uint8).reshape(N_DST_PAGES, PAGE)
        expect = np.zeros_like(got)
        expect[dst_pages] = src[src_pages]
        assert np.array_equal(got, expect)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_dead_peer_is_bounded_and_tcp_reports_provider_error(provider):
    """A peer killed mid-transfer: on tcp the outstanding writes complete with errors carrying
    the provider's message (raised by wait_send as FabricError); shm 1.17 reports nothing, so
    the bounded wait returns False and the caller (messenger) declares the peer dead."""
    proc, conn = _spawn(_target_then_hang, provider)
    try:
        name, desc, pid = _recv(conn, proc)
        remote = RemoteRegion.from_dict(desc)
        with Endpoint(provider, **ep_kwargs(provider)) as ep:
            src = np.ones(64 << 20, dtype=np.uint8)
            mr = ep.register_buffer(src)
            peer = ep.insert_peer(name)
            offs = np.arange(64, dtype=np.uint64) << 20
            ep.write_batch(peer, mr, remote, offs[:1], offs[:1], np.array([1 << 20], np.uint64),
                           encode_imm(0, 0), tag=4)
            assert _recv(conn, proc) == "ready"
            try:
                ep.write_batch(peer, mr, remote, offs, offs, np.full(64, 1 << 20, np.uint64),
                               encode_imm(0, 0), tag=5, timeout=2.0)
            except FabricError as e:  # queue full and never drained: bounded, named
                assert "write_batch" in str(e) and "submitted" in str(e)
            os.kill(pid, signal.SIGKILL)
            proc.join(WAIT_S)
            t0 = time.monotonic()
            if provider == "shm":
                assert ep.wait_send(5, 64, 1.0) is False
                assert ep.inflight > 0
            else:
                with pytest.raises(FabricError) as info:
                    ep.wait_send(5, 64, WAIT_S)
                err = info.value
                assert err.call == "write completion" and err.errno > 0
                assert "provider:" in str(err) and "tag=5" in str(err)
                assert all(t == 5 for t, _, _ in err.errors)
                assert ep.wait_idle(WAIT_S) and ep.inflight == 0
            assert time.monotonic() - t0 < WAIT_S
            ep.remove_peer(peer)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    for p in shm_leftovers([pid]):  # SIGKILL leaves the region behind
        os.unlink(p)
    assert shm_leftovers([pid]) == []


def test_open_errors_carry_call_and_provider_message():
    with pytest.raises(FabricError) as info:
        Endpoint("tcp;ofi_rxm", domain="no-such-nic0")
    msg = str(info.value)
    assert "fi_getinfo" in msg and "No data available" in msg and "no-such-nic0" in msg
    with pytest.raises(FabricError, match="fi_getinfo"):
        Endpoint("no-such-provider")


def test_caller_mistakes_are_value_errors():
    with Endpoint("shm") as ep:
        buf = np.zeros(4 * PAGE, dtype=np.uint8)
        mr = ep.register_buffer(buf)
        peer = ep.insert_peer(ep.name)
        remote = mr.descriptor()
        one = np.array([0], np.uint64)
        page = np.array([PAGE], np.uint64)
        with pytest.raises(ValueError, match="peer 99"):
            ep.write_batch(99, mr, remote, one, one, page, 0, 0)
        with pytest.raises(ValueError, match="destination range"):
            ep.write_batch(peer, mr, remote, one, np.array([4 * PAGE], np.uint64), page, 0, 0)
        with pytest.raises(ValueError, match="source range"):
            ep.write_batch(peer, mr, remote, np.array([3 * PAGE + 1], np.uint64), one, page, 0, 0)
        with pytest.raises(ValueError, match="differ in length"):
            ep.write_batch(peer, mr, remote, one, np.zeros(2, np.uint64), page, 0, 0)
        with pytest.raises(ValueError, match="tag"):
            ep.write_batch(peer, mr, remote, one, one, page, 0, 1 << 16)
        with pytest.raises(ValueError, match="imm"):
            ep.write_batch(peer, mr, remote, one, one, page, 1 << 32, 0)
        with pytest.raises(NotImplementedError, match="host memory"):
            ep.register(mr.addr, 64, iface="cuda")
        with pytest.raises(ValueError, match="iface"):
            ep.register(mr.addr, 64, iface="rocm")
        assert ep.inflight == 0
    with pytest.raises(ValueError, match="closed"):
        ep.poll()


def test_mr_modes_and_names_follow_the_provider():
    with Endpoint("shm") as shm, Endpoint("tcp;ofi_rxm", domain="lo") as tcp:
        assert shm.mr_virt_addr and shm.rma_event and shm.cq_data_size >= 4
        assert shm.name.endswith(b"\x00")  # passed through unchanged
        assert not tcp.rma_event and tcp.cq_data_size >= 4
        for ep in (shm, tcp):
            buf = np.zeros(PAGE, dtype=np.uint8)
            mr = ep.register_buffer(buf)
            d = mr.descriptor()
            assert d.base == (mr.addr if ep.mr_virt_addr else 0) and d.length == PAGE
            assert RemoteRegion.from_dict(d.to_dict()) == d
            assert mr.desc is not None and mr.key == d.key
            mr.close()
            assert mr.closed
    # node/service pick the local address to bind (FI_SOURCE): 127.0.0.1 -> the lo domain
    with Endpoint("tcp;ofi_rxm", node="127.0.0.1") as lo:
        assert lo.domain == "lo"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_peer_names_are_checked_before_the_address_vector(provider):
    """A name of the wrong length/format is refused with a ValueError naming the field (the
    provider would read past it; on tcp;ofi_rxm one failed insert broke later inserts), and a
    valid peer inserted afterwards still receives a counted write."""
    with Endpoint(provider, **ep_kwargs(provider)) as a, \
            Endpoint(provider, **ep_kwargs(provider)) as b:
        good = b.name
        bad = [good[:-1], good + b"\0", good[:3], b"x" * 300, "not bytes", b""]
        if provider == "shm":
            bad += [b"fi_shm://1:0:0", b"fi_shm://1:\x00:0\x00", b"tcp://1:0:0\x00"]
        else:
            bad += [b"\x0a\x00" + good[2:]]  # AF_INET6 family in a 16-byte sockaddr_in
        for name in bad:
            with pytest.raises(ValueError, match="name"):
                a.insert_peer(name)  # type: ignore[arg-type]
        peer = a.insert_peer(good)
        src = np.arange(PAGE, dtype=np.uint8)
        dst = np.zeros(PAGE, dtype=np.uint8)
        mr_a, mr_b = a.register_buffer(src), b.register_buffer(dst)
        b.arm(3, 7)
        got: list[bool] = []
        target = threading.Thread(target=lambda: got.append(b.wait_recv(3, 1, WAIT_S)))
        target.start()  # the target's own polling thread (manual progress)
        zero = np.zeros(1, np.uint64)
        a.write_batch(peer, mr_a, mr_b.descriptor(), zero, zero, np.array([PAGE], np.uint64),
                      encode_imm(3, 7), 0)
        assert a.wait_send(0, 1, WAIT_S)
        target.join(WAIT_S + 5)
        assert got == [True] and int(b.recv_counts[3]) == 1
        assert np.array_equal(dst, src)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_bytes_in_flight_are_capped(provider):
    """write_batch never has more than `max_inflight_bytes` outstanding (the bound on how much
    one poll of a shm target copies), and every page still lands, counted and byte-exact."""
    cap, page, n = 4 * PAGE, 4 * PAGE, 24
    with Endpoint(provider, max_inflight_bytes=cap, **ep_kwargs(provider)) as a, \
            Endpoint(provider, **ep_kwargs(provider)) as b:
        src = np.random.default_rng(3).integers(0, 256, n * page, dtype=np.uint8)
        dst = np.zeros(n * page, dtype=np.uint8)
        mr_a, mr_b = a.register_buffer(src), b.register_buffer(dst)
        peer = a.insert_peer(b.name)
        b.arm(1, 1)
        got: list[bool] = []
        target = threading.Thread(target=lambda: got.append(b.wait_recv(1, n, WAIT_S)))
        target.start()
        order = np.random.default_rng(4).permutation(n).astype(np.uint64)
        offs = np.arange(n, dtype=np.uint64) * np.uint64(page)
        a.write_batch(peer, mr_a, mr_b.descriptor(), offs, order * np.uint64(page),
                      np.full(n, page, np.uint64), encode_imm(1, 1), 2)
        assert 0 < a.inflight_bytes <= cap or a.inflight == 0
        assert a.wait_send(2, n, WAIT_S) and a.inflight_bytes == 0
        target.join(WAIT_S + 5)
        assert got == [True]
        assert np.array_equal(dst.reshape(n, page)[order.astype(np.int64)],
                              src.reshape(n, page))


@pytest.mark.parametrize("news", [False, True], ids=["wait-returns", "news-pipe"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_receive_lanes_count_into_one_slot_table(provider, news):
    """A sender spreading operations over two receive lanes (an owner endpoint and a lane
    counting into the owner's slots from its own C thread): every operation lands once,
    byte-exact, both lanes carry some, the owner's wait_complete sees a slot the LANE
    completed, and a stale generation arriving on the lane is fenced there. With a news pipe
    (as a decode messenger sets its engine's doorbell), the slot's completion is one byte on
    the pipe, written by whichever thread counted the last operation, and wait_complete does
    not return for it."""
    cap, page, n, k = 4 * PAGE, PAGE, 48, 2   # 2 pages per lane in flight: lanes alternate
    nops = n // k
    news_r, news_w = os.pipe()
    os.set_blocking(news_r, False)
    os.set_blocking(news_w, False)
    with Endpoint(provider, max_inflight_bytes=cap, **ep_kwargs(provider)) as a, \
            Endpoint(provider, **ep_kwargs(provider)) as owner, owner.open_lane() as lane:
        src = np.random.default_rng(5).integers(0, 256, n * page, dtype=np.uint8)
        dst = np.zeros(n * page, dtype=np.uint8)
        mr_a = a.register_buffer(src)
        mr_dst = owner.register_buffer(dst)  # once, in the domain the lane shares
        regions = [mr_dst.descriptor(), lane.lane_region(mr_dst).descriptor()]
        peers = [a.insert_peer(owner.name), a.insert_peer(lane.name)]
        lane.start_progress()
        with pytest.raises(ValueError, match="progress thread"):
            lane.poll()
        targets = np.zeros(owner.max_slots, dtype=np.uint32)
        targets[7] = nops
        owner.watch_targets(targets)
        if news:
            owner.set_news_fd(news_w)
        owner.arm(7, 3)
        owner.set_active(True)
        seen: list[int] = []

        def count() -> None:
            deadline = time.monotonic() + WAIT_S
            while int(owner.recv_counts[7]) < nops and time.monotonic() < deadline:
                seen.append(owner.wait_complete(np.zeros(1, np.int64), 0, 0.05))

        target = threading.Thread(target=count)
        target.start()
        order = np.random.default_rng(6).permutation(n).astype(np.uint64)
        offs = np.arange(n, dtype=np.uint64) * np.uint64(page)
        assert a.write_batch(peers, mr_a, regions, offs, order * np.uint64(page),
                             np.full(n, page, np.uint64), encode_imm(7, 3), 2, per_op=k) == nops
        a.write_batch(peers[1:], mr_a, regions[1:], offs[:3], offs[:3], np.full(3, 64, np.uint64),
                      encode_imm(7, 2), 3)  # an older generation, on the lane only
        assert a.wait_send(2, nops, WAIT_S) and a.wait_send(3, 3, WAIT_S)
        target.join(WAIT_S + 5)
        deadline = time.monotonic() + WAIT_S
        while lane.stale_writes < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        owner.set_active(False)
        assert lane.progress_stalled_s < 1.0  # between polls, or inside a short one
        assert lane.stop_progress() and lane.progress_stalled_s == 0.0
        assert int(owner.recv_counts[7]) == nops
        try:
            rung = os.read(news_r, 64)
        except BlockingIOError:
            rung = b""
        owner.set_news_fd(-1)
        os.close(news_r)
        os.close(news_w)
        if news:  # told once, through the pipe only
            assert rung == b"\0" and 1 not in seen, (rung, seen)
        else:
            assert rung == b"" and 1 in seen, (rung, seen)
        assert lane.stale_writes == 3 and owner.stale_writes == 0
        assert owner.remote_writes > 0 and lane.remote_writes - 3 > 0
        assert owner.remote_writes + lane.remote_writes == nops + 3
        lane.poll()  # stopped: callable again
        assert a.errors == [] and owner.errors == [] and lane.errors == []
        expect = np.zeros((n, page), dtype=np.uint8)
        expect[order.astype(np.int64)] = src.reshape(n, page)
        expect[:3, :64] = src.reshape(n, page)[:3, :64]  # the stale writes land all the same
        assert np.array_equal(dst.reshape(n, page), expect)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_lanes_share_one_domain_and_one_registration(provider):
    """A decoder's receive lanes are endpoints of the owner's fabric/domain: the KV buffer is
    registered once (same MR, same key on every lane), each lane still has its own address
    and CQ, and the domain outlives whichever of them closes first."""
    with Endpoint(provider, **ep_kwargs(provider)) as owner:
        buf = np.zeros(4 * PAGE, dtype=np.uint8)
        mr = owner.register_buffer(buf)
        lanes = [owner.open_lane(), owner.open_lane()]
        other = Endpoint(provider, **ep_kwargs(provider))
        try:
            assert {lane.domain_handle for lane in lanes} == {owner.domain_handle}
            assert other.domain_handle != owner.domain_handle
            assert all(lane.lane_region(mr) is mr for lane in lanes)  # no FI_MR_ENDPOINT here
            assert len({owner.name, *(lane.name for lane in lanes)}) == 3
            assert all(lane.max_slots == owner.max_slots for lane in lanes)
            with pytest.raises(ValueError, match="another domain"):
                other.lane_region(mr)
            with pytest.raises(ValueError, match="provider"):
                Endpoint("sockets" if provider == "shm" else "shm", same_domain_as=owner)
            # one write through each lane, counted in the owner's slot, from another domain
            src = np.arange(PAGE, dtype=np.uint8)
            mr_src = other.register_buffer(src)
            owner.arm(3, 1)
            owner.set_active(True)
            peers = [other.insert_peer(lane.name) for lane in lanes]
            for lane in lanes:
                lane.start_progress()  # as the decoder runs them: each drained by its thread
            for i, (lane, peer) in enumerate(zip(lanes, peers, strict=True)):
                off = np.array([i * PAGE], np.uint64)
                other.write_batch(peer, mr_src, lane.lane_region(mr).descriptor(),
                                  np.zeros(1, np.uint64), off, np.array([PAGE], np.uint64),
                                  encode_imm(3, 1), 0)
            assert other.wait_send(0, 2, WAIT_S)
            deadline = time.monotonic() + WAIT_S
            while int(owner.recv_counts[3]) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert int(owner.recv_counts[3]) == 2
            assert [lane.remote_writes for lane in lanes] == [1, 1]
            assert np.array_equal(buf[:2 * PAGE].reshape(2, PAGE), np.stack([src, src]))
            lanes[0].close()  # a lane closing first leaves the shared registration working
            assert not mr.closed and lanes[1].lane_region(mr).descriptor() == mr.descriptor()
        finally:
            for ep in (*lanes, other):
                ep.close()


def test_binding_c_builds_without_warnings_and_cdef_comes_from_the_header():
    """transfer/csrc/*.c compile under -Wall -Wextra -Werror; every function pd.h declares
    for cffi is in the built module (one declaration list, read from the header)."""
    spec = importlib.util.spec_from_file_location("fb", ROOT / "transfer" / "_fabric_build.py")
    fb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fb)
    sources = fb.c_sources()
    assert len(sources) >= 6 and all(s.startswith("transfer/csrc/") for s in sources)
    for src in sources:
        r = subprocess.run(["cc", "-fsyntax-only", "-std=gnu11", "-D_GNU_SOURCE", *fb.WARNINGS,
                            "-Werror", "-I", str(ROOT / fb.CSRC), str(ROOT / src)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stderr == "", (src, r.stderr)
    import re

    from transfer import _fabric
    cdef = fb.cdef_text()
    names = re.findall(r"\b(pd_\w+)\(", cdef)
    assert len(names) > 40 and all(hasattr(_fabric.lib, n) for n in names)
    assert "pd_set_yield" not in cdef  # dead code removed
    consts = re.findall(r"#define (PD_\w+) \.\.\.", cdef)
    assert "PD_HMEM_CUDA" in consts and all(hasattr(_fabric.lib, c) for c in consts)


def test_gpu_memory_direct_is_refused_with_the_reason_on_this_libfabric():
    """Debian's libfabric 1.17 has no CUDA: shm lists FI_HMEM but a CUDA registration answers
    -FI_ENOSYS, tcp;ofi_rxm has no FI_HMEM at all. Both refusals name transfer.gpu_memory and
    the cause, before any CUDA library is loaded (none exists here)."""
    with Endpoint("shm") as plain:
        assert not plain.hmem and plain.offers_hmem
        with pytest.raises(GpuMemoryError, match="hmem=True"):
            plain.register(4096, 4096, iface="cuda")
    with Endpoint("shm", hmem=True) as ep, Endpoint("tcp;ofi_rxm", domain="lo") as tcp:
        assert ep.hmem and ep.offers_hmem and not tcp.offers_hmem
        ok, why = ep.cuda_registration()
        assert not ok and "Function not implemented" in why
        assert ep.cuda_registration() == (ok, why)  # asked once per domain
        with pytest.raises(GpuMemoryError) as info:
            ep.register(4096, 1 << 20, iface="cuda", device=0)
        msg = str(info.value)
        assert "transfer.gpu_memory=direct" in msg and "-FI_ENOSYS" in msg
        assert "transfer.gpu_memory=staged" in msg and info.value.errno == 38
        assert isinstance(info.value, NotImplementedError)
        assert not tcp.cuda_registration()[0] and "FI_HMEM" in tcp.cuda_registration()[1]
    with pytest.raises(GpuMemoryError, match=r"transfer\.gpu_memory=direct.*FI_HMEM"):
        Endpoint("tcp;ofi_rxm", domain="lo", hmem=True)
    assert gpu_direct_support("shm")[0] is False
    ok, why = gpu_direct_support("tcp;ofi_rxm", domain="lo")
    assert not ok and "FI_HMEM" in why
    # the pointer check loads the CUDA driver only when asked; none is installed here
    code = ("import sys; from transfer.fabric import check_cuda_pointer, GpuMemoryError\n"
            "try:\n    check_cuda_pointer(4096, 4096, 0)\n"
            "except GpuMemoryError as e:\n    print(e)\n"
            "print('torch' in sys.modules, 'libcuda' in open('/proc/self/maps').read())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    if not Path("/proc/driver/nvidia").exists():
        assert "cannot load the CUDA driver" in r.stdout and "transfer.gpu_memory" in r.stdout
        assert r.stdout.strip().endswith("False False")


def test_arm_takes_the_endpoint_lock():
    """arm() re-arms a slot only between two CQ drains: it waits for a poll holding the lock
    (the SGLang backend arms from the scheduler thread while its writer thread polls)."""
    with Endpoint("shm") as ep:
        ep.recv_counts[5] = 9
        done = threading.Event()
        t = threading.Thread(target=lambda: (ep.arm(5, 42), done.set()), daemon=True)
        with ep._lock:  # stands in for a poll/wait in progress on another thread
            t.start()
            assert not done.wait(0.2)
            assert int(ep.recv_counts[5]) == 9
        t.join(WAIT_S)
        assert done.is_set() and int(ep.recv_gen[5]) == 42 and int(ep.recv_counts[5]) == 0
        with pytest.raises(ValueError, match="slot"):
            ep.arm(ep.max_slots, 0)


def test_wait_change_returns_when_another_thread_writes_a_word():
    """The prefill messenger waits for the engine's progress word (or a command doorbell) in
    C: it returns once the word moves, and on its timeout otherwise."""
    with Endpoint("shm") as ep:
        word, bell = np.zeros(1, np.int64), np.zeros(1, np.int64)
        assert not ep.wait_change(word, 0, bell, 0, timeout=0.05)
        assert ep.wait_change(word, 5, timeout=0.05)  # already differs: at once
        for target in (word, bell):
            t = threading.Timer(0.05, lambda target=target: target.__setitem__(0, 7))
            t.start()
            assert ep.wait_change(word, int(word[0]), bell, int(bell[0]), timeout=WAIT_S)
            t.join()
        assert int(word[0]) == 7 and int(bell[0]) == 7
        with pytest.raises(ValueError, match="int64"):
            ep.wait_change(np.zeros(1, np.int32), 0)


def test_a_kicked_wait_for_the_engine_ignores_a_word_change_without_a_kick():
    """Where the engine kicks when it announces layers, the progress word moving without a
    kick (a pass beginning) does not end the wait: returning for it took the engine's GIL
    once per pass while write completions kept the wait polling. The kick, or a command (the
    bell), does; without kicks (a GPU stream writes the word) the change alone does."""
    from transfer.fabric import kick

    with Endpoint("shm") as ep:
        word, bell = np.ones(1, np.int64), np.zeros(1, np.int64)  # moved since seen (0)
        kick_word = np.zeros(1, np.uint32)
        ep.set_kick(kick_word, WAIT_S, change_only=True)
        assert not ep.wait_change(word, 0, bell, 0, timeout=0.05)
        t = threading.Timer(0.02, lambda: kick(kick_word))
        t.start()
        assert ep.wait_change(word, 0, bell, 0, timeout=WAIT_S)
        t.join()
        bell[0] = 1
        assert ep.wait_change(word, 1, bell, 0, timeout=WAIT_S)
        ep.set_kick(None)
        assert ep.wait_change(word, 0, bell, 1, timeout=WAIT_S)


def test_a_kicked_wait_for_the_engine_also_ends_on_its_control_socket_and_pipe():
    """A prefill messenger whose engine kicks waits for the engine with the control socket's
    readiness fd and the command pipe watched (set_ctl_fd), so its sleep can outlast the
    timers' period: a message on the socket or a byte on the pipe ends it, where nothing
    else would before the timeout (WAIT_S here)."""
    import zmq

    from transfer.fabric import kick

    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    r, w = os.pipe()
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        os.set_blocking(r, False)
        with Endpoint("shm") as ep:
            word, bell = np.zeros(1, np.int64), np.zeros(1, np.int64)
            kick_word = np.zeros(1, np.uint32)
            ep.set_kick(kick_word, WAIT_S, change_only=True)
            ep.set_wake_fd(r)
            ep.set_ctl_fd(server.getsockopt(zmq.FD))
            assert not server.getsockopt(zmq.EVENTS) & zmq.POLLIN  # the edge is armed
            t = threading.Timer(0.05, lambda: client.send(b"REQUEST"))
            t.start()
            assert not ep.wait_change(word, 0, bell, 0, timeout=WAIT_S)  # not a change...
            t.join()
            assert ep.fd_wakes == 1  # ...but the socket's fd, long before the timeout
            assert server.recv_multipart(flags=zmq.NOBLOCK)[1] == b"REQUEST"
            assert not server.getsockopt(zmq.EVENTS) & zmq.POLLIN
            # the engine's announcement: the word moves, a kick and a pipe byte follow
            t = threading.Timer(0.05, lambda: (word.__setitem__(0, 1), kick(kick_word),
                                               os.write(w, b"\0")))
            t.start()
            assert ep.wait_change(word, 0, bell, 0, timeout=WAIT_S)
            t.join()
            assert ep.fd_wakes == 2
            with pytest.raises(BlockingIOError):  # the sleep took the pipe's byte
                os.read(r, 1)
            ep.set_ctl_fd(-1)
            ep.set_wake_fd(-1)
            ep.set_kick(None)
    finally:
        client.close(linger=0)
        server.close(linger=0)
        ctx.term()
        os.close(r)
        os.close(w)


def test_imm_encoding_and_descriptor_validation():
    for slot, gen in [(0, 0), (1, 2), (65535, 65535), (700, 1)]:
        imm = encode_imm(slot, gen)
        assert 0 <= imm < 1 << 32 and decode_imm(imm) == (slot, gen)
    with pytest.raises(ValueError, match="slot"):
        encode_imm(1 << 16, 0)
    with pytest.raises(ValueError, match="gen"):
        encode_imm(0, -1)
    with pytest.raises(ValueError, match="'key'"):
        RemoteRegion.from_dict({"base": 0, "length": 1})
    with pytest.raises(ValueError, match=r"RemoteRegion\.length"):
        RemoteRegion.from_dict({"base": 0, "key": 1, "length": -1})


def test_missing_binding_names_the_system_package(tmp_path):
    """An install where the native module was not built (no libfabric-dev at install time):
    the package copy below has every Python file but no compiled `_fabric`."""
    pkg = tmp_path / "transfer"
    pkg.mkdir()
    for f in (ROOT / "transfer").glob("*.py"):
        shutil.copy(f, pkg / f.name)
    shutil.copytree(ROOT / "transfer" / "fabric", pkg / "fabric",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # the editable install's finder would map `transfer` back to the checkout: drop it so the
    # copy on PYTHONPATH is what a plain (non-editable) install without the .so looks like
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "import transfer.fabric\n"  # the plain value types need no libfabric
        "from transfer.fabric import RemoteRegion, encode_imm, shm_leftovers\n"
        "from transfer.fabric import Endpoint\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode != 0
    assert str(pkg) in r.stderr  # the copy was imported, not the checkout
    assert "FabricUnavailableError" in r.stderr and "libfabric-dev" in r.stderr


def test_install_skips_binding_without_headers():
    """setup.py decides from the header search; pointed at a dir without rdma/fabric.h it builds
    no extension and says so instead of failing the install."""
    env = dict(os.environ, PDTOOL_FABRIC_INCLUDE="/nonexistent-include")
    r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "libfabric-dev" in r.stdout and "skipping" in r.stdout
    r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "skipping" not in r.stdout


def test_every_failed_write_is_reported_beyond_64():
    """100 writes of 100 tags fail (the peer closed after a connection existed) before the
    errors are read: each one must come back, once. The native ring kept the newest 64 and
    dropped the rest, so their senders waited forever for operations that had ended."""
    a, b = Endpoint("tcp;ofi_rxm", node="127.0.0.1"), Endpoint("tcp;ofi_rxm", node="127.0.0.1")
    src, dst = np.ones(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
    ma, region = a.register_buffer(src), b.register_buffer(dst).descriptor()
    peer = a.insert_peer(b.name)
    one = np.zeros(1, np.uint64)
    stop = threading.Event()
    pump = threading.Thread(target=lambda: [b.poll() for _ in iter(stop.is_set, True)])
    pump.start()
    try:
        a.write_batch(peer, ma, region, one, one, one + 64, imm=0, tag=0)
        assert a.wait_send(0, 1, timeout=30)  # connected and delivered
    finally:
        stop.set()
        pump.join()
    b.close()
    for tag in range(1, 101):
        a.write_batch(peer, ma, region, one, one, one + 64, imm=0, tag=tag, timeout=5)
    assert a.wait_idle(timeout=30)
    errors = a.errors
    failed = sorted(t for t, _, _ in errors)
    # each failed once; the first writes after the close may still have been accepted by the
    # kernel's socket buffer and completed: every other tag is reported, far beyond 64
    assert len(failed) == len(set(failed)) and set(failed) <= set(range(1, 101))
    assert len(failed) > 64, len(failed)
    assert all(a.wait_send(t, 1, timeout=1) for t in range(1, 101) if t not in failed)
    a.close()


def test_a_kick_word_maps_only_from_a_proc_fd_path_of_its_size(tmp_path):
    # the path comes from a peer's HELLO: only a /proc/<pid>/fd/<fd> of a kick word's size
    from transfer.fabric import kick
    from transfer.kick import PAGE, KickWord, PeerKick

    word = KickWord()
    peer = PeerKick(word.path)
    kick(peer.word)
    kick(peer.word)
    assert int(word.word[0]) == 2  # the same memory, through another mapping
    peer.close()
    word.close()
    with pytest.raises(ValueError, match="not a /proc"):
        PeerKick("/etc/passwd")
    other = tmp_path / "small"
    other.write_bytes(b"x" * (PAGE - 1))
    fd = os.open(other, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="kick word"):
            PeerKick(f"/proc/{os.getpid()}/fd/{fd}")
    finally:
        os.close(fd)


def test_a_kick_word_unmaps_once_the_endpoints_sleeping_on_it_closed():
    # a decode messenger's teardown closes its endpoints, then its kick word: the endpoint
    # kept the word's array (a view of the mapping) past its close, so unmapping raised
    # BufferError and every decode worker logged a traceback at shutdown, its memfd left open
    from transfer.kick import KickWord

    word = KickWord()
    ep = Endpoint("shm")
    ep.set_kick(word.word, 0.005)
    ep.close()
    fd = word._fd
    word.close()
    assert word._mm.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    # a view someone still holds (a leaked endpoint's) does not make the close fail: the fd
    # closes now and the page goes with the view
    word = KickWord()
    view, fd = word.word, word._fd
    word.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert int(view[0]) == 0


def test_tcp_idle_sleeps_wait_on_the_cq_fd_and_a_wake_pipe():
    # tcp's CQ has a wait fd: an idle sleep without a kick word waits on it (bytes arriving
    # end it; a blind sleep stalled the stream, the receiver's polls move it) and on a wake
    # pipe (the engine's commands), whose pending bytes it takes; shm's CQ has none
    with Endpoint("shm") as ep:
        assert not ep.has_wait_fd
    with Endpoint("tcp;ofi_rxm", domain="lo", idle_spins=1, idle_sleep_s=0.01,
                  idle_max_sleep_s=0.01) as ep:
        assert ep.has_wait_fd
        r, w = os.pipe()
        try:
            os.set_blocking(r, False)
            ep.set_wake_fd(r)
            os.write(w, b"\0\0")  # two pending wake-ups: the first sleep takes both
            bell = np.zeros(1, np.int64)
            assert ep.wait_complete(bell, 0, timeout=0.01) == 0  # nothing completed
            assert ep.fd_wakes == 1  # the first sleep ended on the pipe, the rest timed out
            with pytest.raises(BlockingIOError):
                os.read(r, 1)
            ep.set_wake_fd(-1)
        finally:
            os.close(r)
            os.close(w)


def test_a_dead_process_region_with_this_pid_does_not_block_the_shm_endpoint():
    # shm names an endpoint's region after the pid; once pids wrap, a region a SIGKILLed
    # process left behind carries a new process's pid and its endpoint failed to enable
    # (EBUSY): the first shm endpoint of a process removes such files first
    code = (
        "import os\n"
        "stale = f'/dev/shm/{os.getpid()}:0:0'\n"
        "open(stale, 'wb').write(b'x' * 64)\n"
        "from transfer.fabric import Endpoint\n"
        "ep = Endpoint('shm')\n"
        "ep.close()\n"
        "print('opened', os.path.exists(stale))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["opened", "False"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_write_groups_cover_several_registrations_in_one_call(provider):
    """One write_groups call carries groups for two registrations on each side (a step's
    layer buffers) under two tags: each lands byte-exact, each tag counts its own operations
    and the decoder's slot counts all of them. A group whose range is wrong names its index;
    the groups before it were submitted whole and land."""
    n = 6
    rng = np.random.default_rng(7)
    with Endpoint(provider, **ep_kwargs(provider)) as a, \
            Endpoint(provider, **ep_kwargs(provider)) as b:
        src = [rng.integers(0, 256, n * PAGE, dtype=np.uint8) for _ in range(2)]
        dst = [np.zeros(n * PAGE, dtype=np.uint8) for _ in range(2)]
        mr_a = [a.register_buffer(s) for s in src]
        mr_b = [b.register_buffer(d) for d in dst]
        peer = a.insert_peer(b.name)
        b.arm(2, 1)
        offs = np.arange(n, dtype=np.uint64) * np.uint64(PAGE)
        order = rng.permutation(n).astype(np.uint64) * np.uint64(PAGE)
        pages = np.full(n, PAGE, np.uint64)
        groups = [WriteGroup(peer, mr_a[i], mr_b[i].descriptor(), offs, order, pages,
                             encode_imm(2, 1), tag=i, per_op=3 if i else 1) for i in range(2)]
        got: list[bool] = []
        target = threading.Thread(target=lambda: got.append(b.wait_recv(2, n + 2, WAIT_S)))
        target.start()
        assert a.write_groups(groups) == [n, 2]
        assert a.wait_send(0, n, WAIT_S) and a.wait_send(1, 2, WAIT_S)
        target.join(WAIT_S + 5)
        assert got == [True] and int(b.recv_counts[2]) == n + 2
        for s, d in zip(src, dst, strict=True):
            assert np.array_equal(d.reshape(n, PAGE)[(order // np.uint64(PAGE)).astype(int)],
                                  s.reshape(n, PAGE))
        beyond = WriteGroup(peer, mr_a[1], mr_b[1].descriptor(), offs[:1],
                            np.array([n * PAGE], np.uint64), pages[:1], encode_imm(2, 1), 1)
        dst[0][:] = 0
        got.clear()
        target = threading.Thread(target=lambda: got.append(b.wait_recv(2, 2 * n + 2, WAIT_S)))
        target.start()
        with pytest.raises(ValueError, match="destination range") as err:
            a.write_groups([groups[0], beyond])
        assert err.value.group == 1 and err.value.submitted == 0
        assert a.wait_send(0, 2 * n, WAIT_S)  # group 0 went whole
        target.join(WAIT_S + 5)
        assert got == [True] and np.array_equal(
            dst[0].reshape(n, PAGE)[(order // np.uint64(PAGE)).astype(int)],
            src[0].reshape(n, PAGE))


def _target_then_count(provider: str, poll: bool, conn) -> None:
    """A decode-like target: register pages, arm slot 0; count 4 writes when `poll`, else
    never poll (a process about to die with its queue full)."""
    ep = Endpoint(provider, remote_counter=True, **ep_kwargs(provider))
    buf = np.zeros((N_DST_PAGES, PAGE), dtype=np.uint8)
    mr = ep.register_buffer(buf)
    ep.arm(0, 1)
    conn.send((ep.name, mr.descriptor().to_dict()))
    if poll:
        conn.send(bool(ep.wait_recv(0, 4, WAIT_S)))
    conn.recv()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_peer_that_replaces_a_dead_one_is_reached(provider):
    """A decode process dies with writes queued to it; the writer removes it and inserts its
    restarted successor. The new one must get the writes: on shm, reusing the removed peer's
    AV index kept its connection state, and the first write to the new process timed out
    ('queue stayed full'; on real SGLang servers the restarted decode crashed in its progress)."""
    with Endpoint(provider, **ep_kwargs(provider)) as ep:
        src = np.ones((4, PAGE), dtype=np.uint8)
        mr = ep.register_buffer(src)
        lens, offs = np.full(4, PAGE, dtype=np.uint64), off(range(4))
        dead, conn = _spawn(_target_then_count, provider, False)
        try:
            name, desc = _recv(conn, dead)
            first = ep.insert_peer(name)
            with contextlib.suppress(FabricError):  # it never polls: its queue fills
                for _ in range(64):
                    ep.write_batch(first, mr, RemoteRegion.from_dict(desc), offs, offs, lens,
                                   encode_imm(0, 1), tag=1, timeout=0.2)
        finally:
            dead.kill()
            dead.join()
        ep.remove_peer(first)
        proc, conn = _spawn(_target_then_count, provider, True)
        try:
            name, desc = _recv(conn, proc)
            peer = ep.insert_peer(name)
            ep.write_batch(peer, mr, RemoteRegion.from_dict(desc), offs, offs, lens,
                           encode_imm(0, 1), tag=2)
            assert _recv(conn, proc) is True
            assert ep.wait_send(2, 1, WAIT_S) and ep.errors == []
            assert ep.kept_peers == (1 if provider == "shm" else 0)
            conn.send("bye")
        finally:
            proc.join(WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _target_that_stops(provider: str, conn) -> None:
    """A decode-like target that counts 4 writes, then stops polling (hung, about to die)."""
    ep = Endpoint(provider, remote_counter=True, **ep_kwargs(provider))
    buf = np.zeros((N_DST_PAGES, PAGE), dtype=np.uint8)
    mr = ep.register_buffer(buf)
    ep.arm(0, 1)
    conn.send((ep.name, mr.descriptor().to_dict()))
    conn.send(bool(ep.wait_recv(0, 4, WAIT_S)))
    conn.recv()


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_shm_dead_peer_stalls_others_until_reset(provider):
    """A peer dies with writes in flight to it. On tcp the provider fails those writes and the
    other peers are served. On shm nothing completes for ANY peer after them (shm retires a
    sender's writes in order), until the prefill planes' StallWatch resets the endpoint: every
    write in flight is cancelled and reported once on its tag, the peers keep their fi_addrs,
    and writes to the live peer complete."""
    with Endpoint(provider, **ep_kwargs(provider)) as ep:
        src = np.ones((16, PAGE), dtype=np.uint8)
        mr = ep.register_buffer(src)
        lens, offs = np.full(4, PAGE, dtype=np.uint64), off(range(4))
        dying, dconn = _spawn(_target_that_stops, provider)
        live, lconn = _spawn(_target_then_count, provider, True)
        try:
            dname, ddesc = _recv(dconn, dying)
            lname, ldesc = _recv(lconn, live)
            dead, peer = ep.insert_peer(dname), ep.insert_peer(lname)
            dregion, lregion = RemoteRegion.from_dict(ddesc), RemoteRegion.from_dict(ldesc)
            ep.write_batch(dead, mr, dregion, offs, offs, lens, encode_imm(0, 1), tag=1)
            assert _recv(dconn, dying) is True and ep.wait_send(1, 4, WAIT_S)
            # it no longer polls: these wait for it, then it dies
            ep.write_batch(dead, mr, dregion, offs, offs, lens, encode_imm(0, 1), tag=2)
            dying.kill()
            dying.join()
            # on shm its queue fills: the dead peer's writes hold every completion (3 s is
            # the time the test waits for that to show; tcp is given the usual WAIT_S)
            wait = 3.0 if provider == "shm" else WAIT_S
            try:
                ep.write_batch(peer, mr, lregion, offs, offs, lens, encode_imm(0, 1), tag=3,
                               timeout=wait)
                served = ep.wait_send(3, 4, wait)
            except FabricError:
                served = False
            assert served == (provider != "shm")
            watch = StallWatch([ep], after_s=0.5)
            assert watch.check(time.monotonic()) == 0  # first sight: the clock starts
            time.sleep(0.6)
            assert watch.check(time.monotonic()) == (provider == "shm")  # tcp: not watched
            if provider == "shm":
                cancelled = [e for e in ep.errors if e[1] == 125]
                assert {t for t, _, _ in cancelled} <= {2, 3} and \
                    sum(t == 2 for t, _, _ in cancelled) == 4 - int(ep.send_done[2])
                assert ep.inflight == 0 and ep.resets == 1
                ep.write_batch(peer, mr, lregion, offs, offs, lens, encode_imm(0, 1), tag=4)
                assert ep.wait_send(4, 4, WAIT_S)
            assert _recv(lconn, live) is True
            lconn.send("bye")
        finally:
            for proc in (dying, live):
                if proc.is_alive():
                    proc.kill()
                proc.join()


def _fi_version(major: int, minor: int) -> int:
    return (major << 16) | minor


def test_device_memory_domains_ask_for_the_api_that_lets_efa_take_dma_bufs():
    """EFA accepts FI_MR_DMABUF only at API >= 1.20 and answers -FI_EBADFLAGS below, which
    failed every KV registration while the binding asked for 1.18. With FI_HMEM the binding now
    asks for the highest version both its headers and the library know (1.x: at most 1.22);
    dma-bufs are tried only at >= 1.20, and EBADFLAGS falls back to registering the address."""
    from transfer.fabric.native import lib

    assert lib.pd_api_version(0) == _fi_version(1, 17)
    want = min(lib.pd_header_version(), lib.pd_library_version(), _fi_version(1, 22))
    assert lib.pd_api_version(1) == max(want, _fi_version(1, 17))
    assert not lib.pd_dmabuf_allowed(_fi_version(1, 19))
    assert bool(lib.pd_dmabuf_allowed(_fi_version(1, 20))) == bool(lib.pd_have_dmabuf())
    for err in (lib.PD_EBADFLAGS, lib.PD_ENOSYS, lib.PD_EOPNOTSUPP, lib.PD_EINVAL):
        assert lib.pd_dmabuf_falls_back(-err), err
    assert not lib.pd_dmabuf_falls_back(-lib.PD_EIO)  # a broken buffer is an error, not a way

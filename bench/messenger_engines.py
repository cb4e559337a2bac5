"""Processes for the messenger benchmarks: a miniature prefill engine, decode clients, and a
raw-binding pair, each in a forked process of its own (the parent only orchestrates, so it
never holds a messenger thread or a ZeroMQ context across a fork).

The prefill engine does what an engine does for the messenger and nothing else: the lead polls
assembled requests, binds each to source pages, runs passes (`begin_pass`, one `layer_done`
per layer, optionally sleeping `compute_s` per pass as a stand-in for the forward) and
`finish`es, releasing what is `done()`. It waits on the messenger's doorbell, not a sleep, so
the time a request takes is the messenger's. With `step_profile` it times the messenger
thread's `_step` and its per-request loop `_check_requests` (wrapped at the class, the
messenger code itself untouched) and reports them by the number of requests bound, which is
how the benchmark sees the cost of a step grow with the requests in flight.

KV buffers are one layer buffer per layer of `pages` pages of `page_bytes` bytes each
(HND `[pages, 1, 1, 1, page_bytes]` uint8, in huge-page host memory like an engine's cache):
a "one-page request" is one page per layer, `page_size` 1 token per page.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WAIT_S = 120.0


@dataclass(frozen=True)
class Setup:
    """What both sides of a messenger pair agree on."""

    provider: str = "shm"
    page_bytes: int = 4096
    layers: int = 1
    src_pages: int = 4096
    dst_pages: int = 4096
    writes_per_op: int = 0   # DecodeConfig.writes_per_op (0: the provider's iov limit)
    lanes: int = 0           # DecodeConfig.lanes (0: 2 on shm, else 1)
    max_inflight: int = 1024
    compute_s: float = 0.0   # prefill engine: sleep this long per pass (a stand-in forward)
    requests_per_pass: int = 0  # 0: every bound request in one pass
    step_profile: bool = False
    secret: bytes = field(default=b"", repr=False)

    def domain(self) -> str | None:
        return "lo" if self.provider.startswith("tcp") else None


def kv_buffers(s: Setup, pages: int, fill: int) -> list[Any]:
    import torch

    from transfer.hostmem import host_buffer

    out = []
    for _ in range(s.layers):
        b = host_buffer((pages, 1, 1, 1, s.page_bytes), torch.uint8)
        b.fill_(fill)
        out.append(b)
    return out


def _specs() -> tuple[Any, Any]:
    from transfer.routes import ShardSpec

    return ShardSpec(1, 1), ShardSpec(1, 1)


# ------------------------------------------------------------------ prefill engine
class StepProfile:
    """Time of `PrefillMessenger._step` and `_check_requests` by requests bound (log2 bins)."""

    def __init__(self) -> None:
        self.bins: dict[int, list[float]] = {}  # bin -> [steps, step s, checks, check s]

    def install(self, cls: Any) -> None:
        step, check = cls._step, cls._check_requests
        prof = self

        def timed_step(m: Any) -> bool:
            t0 = time.perf_counter()
            busy = step(m)
            row = prof._row(len(m._reqs) if busy else 0)
            row[0] += 1
            row[1] += time.perf_counter() - t0
            return busy

        def timed_check(m: Any) -> None:
            t0 = time.perf_counter()
            check(m)
            row = prof._row(len(m._reqs))
            row[2] += 1
            row[3] += time.perf_counter() - t0

        cls._step, cls._check_requests = timed_step, timed_check

    def _row(self, bound: int) -> list[float]:
        key = 0 if bound == 0 else 1 << (bound.bit_length() - 1)
        return self.bins.setdefault(key, [0, 0.0, 0, 0.0])

    def report(self) -> dict[int, dict[str, float]]:
        return {k: {"steps": int(v[0]), "step_us": 1e6 * v[1] / max(1, v[0]),
                    "checks": int(v[2]), "check_us": 1e6 * v[3] / max(1, v[2])}
                for k, v in sorted(self.bins.items())}


def prefill_engine(conn: Any, s: Setup, stop: Any) -> None:
    """Child process: the miniature prefill engine (module docstring); sends its address,
    runs until `stop` is set, then sends its report."""
    try:
        from transfer.messenger.common import PrefillConfig
        from transfer.messenger.prefill import PrefillMessenger

        prof = StepProfile()
        if s.step_profile:
            prof.install(PrefillMessenger)
        src, dst = _specs()
        kv = kv_buffers(s, s.src_pages, 7)
        cfg = PrefillConfig(secret=s.secret, spec=src, peer_spec=dst, provider=s.provider,
                            domain=s.domain(), timeout_s=WAIT_S, max_requests=4096)
        m = PrefillMessenger(cfg, kv, "HND")
        conn.send(m.address)
        bound: list[Any] = []
        cursor = 0
        served = 0
        while not stop.is_set():
            for req in m.poll_requests():
                k = req.num_pages
                pages = (np.arange(cursor, cursor + k) % s.src_pages).astype(np.int64)
                cursor = (cursor + k) % s.src_pages
                m.bind(req, pages)
                bound.append(req)
            if bound:
                n = s.requests_per_pass or len(bound)
                now, bound = bound[:n], bound[n:]
                m.begin_pass([(r.rid, 0, r.num_tokens - 1) for r in now])
                if s.compute_s:
                    time.sleep(s.compute_s)
                for layer in range(s.layers):
                    m.layer_done(layer)
                for r in now:
                    m.finish(r.rid, [])
            for rid in m.done():
                m.release(rid)
                served += 1
            if not bound:
                m.news.wait(0.005)
        report = {"served": served, "steps": prof.report() if s.step_profile else {},
                  "process_cpu_s": time.process_time()}
        m.close()
        conn.send(report)
    except Exception:
        conn.send(("error", traceback.format_exc(limit=6)))


# ------------------------------------------------------------------ decode client
def _decoder(s: Setup, endpoints: list[str]) -> Any:
    from transfer.messenger.common import DecodeConfig
    from transfer.messenger.decode import DecodeMessenger

    src, dst = _specs()
    kv = kv_buffers(s, s.dst_pages, 0)
    cfg = DecodeConfig(secret=s.secret, spec=dst, peer_spec=src, provider=s.provider,
                       domain=s.domain(), prefill_endpoints=tuple((e,) for e in endpoints),
                       max_inflight=s.max_inflight, timeout_s=WAIT_S,
                       writes_per_op=s.writes_per_op, lanes=s.lanes)
    return DecodeMessenger(cfg, kv, "HND"), kv


def _wait_all(m: Any, rids: set[str], deadline: float) -> dict[str, float]:
    """Wait on the doorbell until every rid is ready; returns rid -> perf_counter when seen."""
    seen: dict[str, float] = {}
    while len(seen) < len(rids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(rids) - len(seen)} of {len(rids)} requests not ready")
        bad = m.failed() & rids
        if bad:
            rid = next(iter(bad))
            raise RuntimeError(f"transfer {rid} failed: {m.status(rid).reason}")
        now = time.perf_counter()
        for rid in m.ready() & rids:
            if rid not in seen:
                seen[rid] = now
                m.release(rid)
        if len(seen) < len(rids):
            m.news.wait(0.01)
    return seen


def decode_client(conn: Any, s: Setup, endpoints: list[str], waves: list[tuple[int, int]],
                  go: Any = None, tag: str = "d") -> None:
    """Child process: for each (requests, pages) wave submit that many requests of that many
    pages per layer at once (round robin over the prefill endpoints) and time each from its
    submit to its count reached (`ready()`). One untimed warm-up request first. Waits on `go`
    (if given) before the first timed wave, so several clients start together."""
    try:
        m, _kv = _decoder(s, endpoints)
        rng = np.random.default_rng(os.getpid())
        out: list[dict[str, Any]] = []
        seq = 0

        def wave(n: int, pages: int) -> dict[str, Any]:
            nonlocal seq
            rids, t0 = {}, {}
            start = time.perf_counter()
            for i in range(n):
                rid = f"{tag}{seq}"
                seq += 1
                dst = rng.choice(s.dst_pages, size=pages, replace=pages > s.dst_pages)
                t0[rid] = time.perf_counter()
                m.submit(rid, np.arange(pages + 1, dtype=np.uint32), dst, peer=i % len(endpoints))
                rids[rid] = pages
            seen = _wait_all(m, set(rids), time.monotonic() + WAIT_S)
            end = max(seen.values())
            return {"requests": n, "pages": pages, "seconds": end - start,
                    "latency_s": [seen[r] - t0[r] for r in rids]}

        wave(1, 1)  # connections, HELLO, first touches
        if go is not None:
            go.wait(WAIT_S)
        for n, pages in waves:
            out.append(wave(n, pages))
        m.close()
        conn.send(out)
    except Exception:
        conn.send(("error", traceback.format_exc(limit=6)))


def serial_latency(conn: Any, s: Setup, endpoints: list[str], count: int) -> None:
    """Child process: `count` one-page requests one after another; each one's submit -> ready."""
    try:
        m, _kv = _decoder(s, endpoints)
        lat = []
        for i in range(count + 20):  # 20 warm-up requests, not kept
            rid = f"l{i}"
            dst = np.array([i % s.dst_pages])
            t0 = time.perf_counter()
            m.submit(rid, np.arange(2, dtype=np.uint32), dst, peer=0)
            seen = _wait_all(m, {rid}, time.monotonic() + WAIT_S)
            if i >= 20:
                lat.append(seen[rid] - t0)
        m.close()
        conn.send(lat)
    except Exception:
        conn.send(("error", traceback.format_exc(limit=6)))


# ------------------------------------------------------------------ raw binding pair
def _raw_endpoint(conn: Any, provider: str, nbytes: int) -> tuple[Any, Any, int, Any]:
    """Open an endpoint, register `nbytes`, swap (name, region) with the peer via the parent."""
    from transfer.fabric import Endpoint, RemoteRegion

    ep = Endpoint(provider, domain="lo" if provider.startswith("tcp") else None)
    buf = np.zeros(nbytes, dtype=np.uint8)
    mr = ep.register_buffer(buf)
    conn.send((ep.name, mr.descriptor().to_dict()))
    peer_name, peer_desc = conn.recv()
    ep._bench_buf = buf  # type: ignore[attr-defined]  # alive as long as the endpoint
    return ep, mr, ep.insert_peer(peer_name), RemoteRegion.from_dict(peer_desc)


def raw_side(conn: Any, provider: str, nbytes: int) -> None:
    """Child process: one side of a raw-binding pair (transfer.fabric, no messenger), driven
    by commands over `conn`, every write `fi_writemsg` with 32-bit immediate data
    (fi_writedata) counted by the other side in C:
      ("ping", (iters, size)): write `size` bytes, wait for the answer; reply the round trips;
      ("pong", (iters, size)): answer each counted write with one write back;
      ("blast", (n, size, per_op)): n writes of `size` bytes, `per_op` to an operation, in one
        `write_batch`; reply the monotonic time just before it and the operations issued;
      ("count", n): wait until n operations were counted; reply the monotonic time then."""
    try:
        from transfer.fabric import encode_imm

        ep, mr, peer, remote = _raw_endpoint(conn, provider, nbytes)
        zero = np.zeros(1, dtype=np.uint64)
        while True:
            cmd, arg = conn.recv()
            if cmd == "close":
                break
            if cmd in ("ping", "pong"):
                iters, size = arg
                ep.arm(1, 1)
                conn.send("armed")
                conn.recv()  # both sides armed: go
                ln = np.array([size], dtype=np.uint64)
                rtt = []
                for i in range(iters):
                    t0 = time.perf_counter()
                    if cmd == "ping":
                        ep.write_batch(peer, mr, remote, zero, zero, ln, encode_imm(1, 1), 2)
                    if not ep.wait_recv(1, i + 1, WAIT_S):
                        raise TimeoutError(f"write {i} of the ping-pong never arrived")
                    if cmd == "pong":
                        ep.write_batch(peer, mr, remote, zero, zero, ln, encode_imm(1, 1), 2)
                    rtt.append(time.perf_counter() - t0)
                ep.wait_idle(WAIT_S)
                conn.send(rtt if cmd == "ping" else "done")
            elif cmd == "blast":
                n, size, per_op = arg
                offs = (np.arange(n, dtype=np.uint64) * np.uint64(size)) % np.uint64(
                    max(size, nbytes - nbytes % size))
                ln = np.full(n, size, dtype=np.uint64)
                ep.send_done[3] = 0
                t0 = time.monotonic()
                ops = ep.write_batch(peer, mr, remote, offs, offs, ln, encode_imm(2, 1), 3,
                                     per_op=per_op, timeout=WAIT_S)
                ep.wait_send(3, ops, WAIT_S)
                conn.send((t0, ops))
            elif cmd == "count":
                ep.arm(2, 1)
                conn.send("armed")
                if not ep.wait_recv(2, arg, WAIT_S):
                    raise TimeoutError(f"counted {int(ep.recv_counts[2])}/{arg} operations")
                conn.send(time.monotonic())
        ep.close()
        conn.send("closed")
    except Exception:
        conn.send(("error", traceback.format_exc(limit=6)))


class RawPair:
    """Two `raw_side` processes that know each other."""

    def __init__(self, provider: str, nbytes: int) -> None:
        self.a, self.b = Child(raw_side, provider, nbytes), Child(raw_side, provider, nbytes)
        ha, hb = self.a.get("raw endpoint a"), self.b.get("raw endpoint b")
        self.a.send(hb)
        self.b.send(ha)

    def ping_pong(self, iters: int, size: int) -> list[float]:
        self.b.send(("pong", (iters, size)))
        self.a.send(("ping", (iters, size)))
        self.a.get("armed")
        self.b.get("armed")
        self.b.send("go")
        self.a.send("go")
        rtt = self.a.get("ping-pong")
        self.b.get("pong done")
        return rtt

    def rate(self, n: int, size: int, per_op: int = 1) -> tuple[float, int]:
        """(seconds from the first submission to the last operation counted, operations)."""
        ops = -(-n // per_op)
        self.b.send(("count", ops))
        self.b.get("armed")
        self.a.send(("blast", (n, size, per_op)))
        t0, issued = self.a.get("blast")
        t1 = self.b.get("count")
        return t1 - t0, issued

    def close(self) -> None:
        for c in (self.a, self.b):
            with contextlib.suppress(Exception):
                c.send(("close", None))
                c.get("close", 10)
            c.reap()
        remove_shm_leftovers([c.proc.pid for c in (self.a, self.b) if c.proc.pid])


# ------------------------------------------------------------------ plumbing
def _quiet(fn: Callable[..., None], *args: Any) -> None:
    """Run a child's body with the messenger's warnings off: a benchmark's decode client that
    is done closes while its prefill runs on, and the prefill then logs it as a silent peer."""
    import logging

    logging.getLogger("transfer.messenger").setLevel(logging.ERROR)
    fn(*args)


class Child:
    """A forked child process running `fn(conn, *args)`; `get` raises the child's traceback."""

    def __init__(self, fn: Callable[..., None], *args: Any) -> None:
        # imported once in the parent (nothing opened), so every forked child starts with them
        import torch  # noqa: F401

        import transfer.messenger.decode
        import transfer.messenger.prefill  # noqa: F401

        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_quiet, args=(fn, child, *args), daemon=True)
        self.proc.start()
        child.close()

    def get(self, what: str, timeout: float = WAIT_S) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{what}: nothing in {timeout:.0f} s "
                               f"(alive={self.proc.is_alive()})")
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise RuntimeError(f"{what}: the child failed:\n{msg[1]}")
        return msg

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def reap(self) -> None:
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def event() -> Any:
    return mp.get_context("fork").Event()


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def remove_shm_leftovers(pids: list[int]) -> None:
    """libfabric's shm provider leaves a file per process in /dev/shm when one is killed."""
    with contextlib.suppress(ImportError):
        from transfer.fabric import shm_leftovers

        for path in shm_leftovers(pids):
            with contextlib.suppress(OSError):
                os.unlink(path)

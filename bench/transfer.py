"""Page-transfer benchmark: GB/s moving scattered KV pages between two processes.

What it measures. Each round moves `--gib` GiB (default 1) of pages of one size (64 KiB and
1 MiB) from a source buffer in this process to random, scattered page slots of a destination
buffer in a second process (multiprocessing, spawn), and reports GB/s (1e9 B/s) with its ratio to
an in-process copy of the same pages measured in the same run. Systems, interleaved round by
round so background load hits all of them alike:

* `copy`        in-process numpy copy of the same pages (the baseline; best of a per-page
                 loop and a vectorised gather/scatter);
* `copy2`       the same pages copied by two threads (one memmove per page, the GIL released):
                 the real limit of a 2-core box, and what the messenger's two shm receive
                 lanes compete with; the table's ratios are against it when it ran;
* `fabric`      the raw binding (transfer.fabric): one `write_batch` C call for all pages with
                 32-bit immediate data, pages grouped by the provider's iov limit into one
                 operation each (4 on both), the target counting CQ data per slot in C
                 (`wait_recv`); on `shm` and `tcp;ofi_rxm` (loopback);
* `messenger`   transfer.messenger's own bench hook when that module provides one (see
                 `run_messenger`); the full protocol with counting, in its default setting
                 (on shm two receive lanes, so two decoder threads copy; huge-page KV buffers,
                 as numpy gives every other system here);
* `nixl`        NIXL (pip `nixl-cu12`), UCX backend, DRAM, one WRITE transfer of all page
                 descriptors with a notification, no progress threads (fastest on 2 cores);
* `mooncake`    Mooncake transfer engine (pip `mooncake-transfer-engine-non-cuda`), TCP,
                 P2P handshake, `batch_transfer_sync_write`.

Timing: from just before the first submission to when the target has seen all pages (its
completion count / notification, stamped with CLOCK_MONOTONIC, which both processes share) and
the initiator's local completions are in. Each round measures every system once, in a fixed
order (a raw binding right before the messenger on the same provider); a ratio is the median
over `--rounds` rounds of each round's figure over its baseline of the same round, and GB/s is
the median of the rounds. (Until 2026-12-03 each cell kept its best round, so a ratio compared
two different phases of a VM whose speed drifts by 30-50 % within minutes.) The table also
prints CPU seconds per GiB (copy; fabric initiator and target): on a shared 2-core box wall-clock
GB/s mostly says how much CPU the processes got, while CPU s/GiB says what a transfer costs.

Usage (from the repository root; both sides busy-poll, so keep other load off the cores):
    python bench/transfer.py               # table
    python bench/transfer.py --json        # one JSON object {system: {"provider/page": GB/s}}
    python bench/transfer.py --quick       # small sizes, a smoke run
    python bench/transfer.py --systems copy,fabric

Targets (checked in the table and the JSON's "targets"): messenger on shm >= 0.8x the
two-thread copy at 64 KiB and >= 0.9x at 1 MiB, its CPU s/GiB (prefill + decode) <= 1.2x the
copy's; on tcp;ofi_rxm at least the raw binding's GB/s and 3x Mooncake-TCP's.

Seen on the 2-core dev box (2026-11-30 17:21 UTC, `--rounds 3`, load average 1.2; GB/s at 64 KiB
/ 1 MiB, best of 3 rounds, the method of then): copy 6.06 / 7.29, fabric shm 5.31 / 5.86, fabric
tcp 4.27 / 4.66, messenger shm 6.92 / 7.59 (1.14x / 1.04x the copy), messenger tcp 3.78 / 4.08
(2.9x / 2.6x Mooncake), NIXL-UCX 4.79 / 4.86, Mooncake-TCP 1.31 / 1.58. Pages go 4 to an RMA
operation (the providers' iov limit): before that the raw binding on tcp at 64 KiB ran 2.5 GB/s.
Wall clock swings by 20-30% between runs on a shared box; CPU s/GiB is steadier: copy 0.18 /
0.16, fabric shm target 0.20 / 0.18 (the target does the CMA copy), messenger shm decode 0.23 /
0.19 (both lanes together), prefill 0.04 / 0.06. The messenger beats the single-threaded copy on
shm because its two lanes copy on two cores at the same CPU cost per GiB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `transfer` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
WAIT_S = 120.0
FABRIC_PROVIDERS = ("shm", "tcp;ofi_rxm")
ALL_SYSTEMS = ("copy", "copy2", "fabric", "messenger", "nixl", "mooncake")


@dataclass(frozen=True)
class Workload:
    """Pages of one size: `n` writes, src page i -> dst page dst[i] (scattered, repeats passes)."""

    page: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    region: int  # bytes of each side's buffer

    @property
    def n(self) -> int:
        return len(self.dst_pages)

    @property
    def nbytes(self) -> int:
        return self.n * self.page

    def src_off(self) -> np.ndarray:
        return self.src_pages.astype(np.uint64) * np.uint64(self.page)

    def dst_off(self) -> np.ndarray:
        return self.dst_pages.astype(np.uint64) * np.uint64(self.page)

    def lengths(self) -> np.ndarray:
        return np.full(self.n, self.page, dtype=np.uint64)


def make_workload(page: int, total: int, region: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    per_region = region // page
    passes = -(-total // region)
    dst = np.concatenate([rng.permutation(per_region) for _ in range(passes)])
    src = np.concatenate([rng.permutation(per_region) for _ in range(passes)])
    n = total // page
    return Workload(page, src[:n], dst[:n], region)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ------------------------------------------------------------------ copy baseline
def run_copy(src: np.ndarray, dst: np.ndarray, w: Workload) -> tuple[float, float]:
    """Best of a per-page numpy loop and a vectorised gather/scatter: (seconds, CPU seconds)."""
    s2 = src.reshape(-1, w.page)
    d2 = dst.reshape(-1, w.page)
    c0, t0 = time.process_time(), time.perf_counter()
    for s, d in zip(w.src_pages.tolist(), w.dst_pages.tolist(), strict=True):
        d2[d] = s2[s]
    loop = (time.perf_counter() - t0, time.process_time() - c0)
    # vectorised in bounded chunks (the gather makes a temporary; keep it cache-friendly)
    chunk = max(1, (32 * MIB) // w.page)
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, w.n, chunk):
        d2[w.dst_pages[i : i + chunk]] = s2[w.src_pages[i : i + chunk]]
    vec = (time.perf_counter() - t0, time.process_time() - c0)
    return min(loop, vec)


def run_copy_threads(src: np.ndarray, dst: np.ndarray, w: Workload,
                     threads: int = 2) -> tuple[float, float]:
    """The same pages copied by `threads` threads (each half of the pages, one `memmove` per
    page: ctypes releases the GIL for the call, so both cores copy): (seconds, CPU seconds of
    the whole process). On a 2-core box this, not one thread's copy, is what a transfer that
    uses both cores can reach: the messenger's two receive lanes copy on two cores."""
    import ctypes
    import threading

    move = ctypes.memmove
    sb, db, page = src.ctypes.data, dst.ctypes.data, w.page
    parts = [(w.src_pages[i::threads].tolist(), w.dst_pages[i::threads].tolist())
             for i in range(threads)]
    start = threading.Barrier(threads + 1)

    def work(s_pages: list[int], d_pages: list[int]) -> None:
        start.wait()
        for s, d in zip(s_pages, d_pages, strict=True):
            move(db + d * page, sb + s * page, page)

    pool = [threading.Thread(target=work, args=part) for part in parts]
    for t in pool:
        t.start()
    c0, t0 = time.process_time(), time.perf_counter()
    start.wait()
    for t in pool:
        t.join()
    return time.perf_counter() - t0, time.process_time() - c0


# ------------------------------------------------------------------ peer plumbing
def _spawn(fn: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=fn, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def _recv(conn: Any, proc: Any, what: str, timeout: float = WAIT_S) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"{what}: target sent nothing in {timeout}s (alive={proc.is_alive()})")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"{what}: target failed: {msg[1]}")
    return msg


def _serve(conn: Any, handler: Any) -> None:
    """Target loop: answer (cmd, *args) messages until 'close'; errors go back as data."""
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "close":
                handler.close()
                conn.send("closed")
                return
            conn.send(getattr(handler, cmd)(*args))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=4)))


class Peer:
    """Initiator-side handle of a target process."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.proc, self.conn = _spawn(target, *args)

    def call(self, cmd: str, *args: Any, timeout: float = WAIT_S) -> Any:
        self.conn.send((cmd, *args))
        return _recv(self.conn, self.proc, cmd, timeout)

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, *args))

    def result(self, what: str, timeout: float = WAIT_S) -> Any:
        return _recv(self.conn, self.proc, what, timeout)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close", timeout=10)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# ------------------------------------------------------------------ raw fabric binding
def _fabric_kwargs(provider: str) -> dict[str, str]:
    return {"domain": "lo"} if provider.startswith("tcp") else {}


class _FabricTarget:
    def __init__(self, provider: str, region: int) -> None:
        from transfer.fabric import Endpoint

        self.ep = Endpoint(provider, **_fabric_kwargs(provider))
        self.buf = np.ones(region, dtype=np.uint8)
        self.mr = self.ep.register_buffer(self.buf)
        self.gen = 0

    def hello(self) -> tuple[bytes, dict[str, int]]:
        return self.ep.name, self.mr.descriptor().to_dict()

    def arm(self, slot: int) -> int:
        self.gen = (self.gen + 1) & 0xFFFF
        self.ep.arm(slot, self.gen)
        return self.gen

    def wait(self, slot: int, n: int) -> tuple[float, float]:
        c0 = time.process_time()
        if not self.ep.wait_recv(slot, n, WAIT_S):
            raise TimeoutError(f"counted {self.ep.recv_counts[slot]}/{n} writes")
        return time.monotonic(), time.process_time() - c0

    def close(self) -> None:
        self.ep.close()


def _fabric_target(provider: str, region: int, conn: Any) -> None:
    _serve(conn, _FabricTarget(provider, region))


class FabricRunner:
    """The raw binding: one write_batch call, target counts CQ data in C."""

    SLOT = 1

    def __init__(self, provider: str, src: np.ndarray, region: int) -> None:
        from transfer.fabric import Endpoint, RemoteRegion, encode_imm

        self.encode_imm = encode_imm
        self.peer = Peer(_fabric_target, provider, region)
        name, desc = self.peer.call("hello")
        self.ep = Endpoint(provider, **_fabric_kwargs(provider))
        self.mr = self.ep.register_buffer(src)
        self.remote = RemoteRegion.from_dict(desc)
        self.addr = self.ep.insert_peer(name)
        self.tag = 0

    def run(self, w: Workload) -> float:
        gen = self.peer.call("arm", self.SLOT)
        self.tag = (self.tag + 1) % 1024
        self.ep.send_done[self.tag] = 0
        src, dst, ln = w.src_off(), w.dst_off(), w.lengths()
        # as many pages per operation as the provider takes (the messenger's default too)
        k = self.ep.iov_limit
        nops = -(-w.n // k)
        self.peer.send("wait", self.SLOT, nops)
        c0 = time.process_time()
        t0 = time.monotonic()
        self.ep.write_batch(self.addr, self.mr, self.remote, src, dst, ln,
                            self.encode_imm(self.SLOT, gen), self.tag, per_op=k, timeout=WAIT_S)
        if not self.ep.wait_send(self.tag, nops, WAIT_S):
            raise TimeoutError("local completions did not arrive")
        t_local = time.monotonic()
        cpu_local = time.process_time() - c0
        t_remote, cpu_remote = self.peer.result("wait")
        # CPU seconds per GiB on each side: what the transfer costs independent of how much of
        # a shared machine it got (both sides busy-poll but yield when idle)
        self.cpu_per_gib = (cpu_local * GIB / w.nbytes, cpu_remote * GIB / w.nbytes)
        return max(t_local, t_remote) - t0

    def close(self) -> None:
        self.peer.close()
        self.ep.close()


# ------------------------------------------------------------------ NIXL (UCX, DRAM)
def _nixl_agent(name: str) -> Any:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    # no progress/listen threads: on 2 cores a third spinning thread halves throughput
    # (docs/libfabric.md)
    cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                            backends=["UCX"])
    return nixl_agent(name, cfg)


class _NixlTarget:
    def __init__(self, region: int) -> None:
        self.agent = _nixl_agent("target")
        self.buf = np.ones(region, dtype=np.uint8)
        self.reg = self.agent.register_memory([(int(self.buf.ctypes.data), region, 0, "")],
                                              "DRAM")

    def hello(self, peer_meta: bytes) -> tuple[bytes, int]:
        self.agent.add_remote_agent(peer_meta)
        return self.agent.get_agent_metadata(), int(self.buf.ctypes.data)

    def wait(self, tag: bytes) -> float:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for msgs in self.agent.get_new_notifs().values():
                if tag in msgs:
                    return time.monotonic()
        raise TimeoutError("no NIXL notification")

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


def _nixl_target(region: int, conn: Any) -> None:
    _serve(conn, _NixlTarget(region))


class NixlRunner:
    def __init__(self, src: np.ndarray, region: int) -> None:
        self.agent = _nixl_agent("initiator")
        self.src = src
        self.reg = self.agent.register_memory([(int(src.ctypes.data), src.nbytes, 0, "")],
                                              "DRAM")
        self.peer = Peer(_nixl_target, region)
        meta, self.dst_base = self.peer.call("hello", self.agent.get_agent_metadata())
        self.remote = self.agent.add_remote_agent(meta)
        self.round = 0

    def run(self, w: Workload) -> float:
        self.round += 1
        tag = f"r{self.round}".encode()
        base = int(self.src.ctypes.data)
        ln = w.lengths().astype(np.int64)
        local = np.stack([base + w.src_off().astype(np.int64), ln, np.zeros_like(ln)], axis=1)
        remote = np.stack([self.dst_base + w.dst_off().astype(np.int64), ln, np.zeros_like(ln)],
                          axis=1)
        ld = self.agent.get_xfer_descs(local, "DRAM")
        rd = self.agent.get_xfer_descs(remote, "DRAM")
        h = self.agent.initialize_xfer("WRITE", ld, rd, self.remote, tag)
        self.peer.send("wait", tag)
        t0 = time.monotonic()
        state = self.agent.transfer(h)
        deadline = t0 + WAIT_S
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            state = self.agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        t_local = time.monotonic()
        t_remote = self.peer.result("wait")
        self.agent.release_xfer_handle(h)
        return max(t_local, t_remote) - t0

    def close(self) -> None:
        self.peer.close()
        self.agent.deregister_memory(self.reg)


# ------------------------------------------------------------------ Mooncake (TCP)
def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    ret = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if ret != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize returned {ret}")
    return te


class _MooncakeTarget:
    def __init__(self, region: int) -> None:
        self.te = _mooncake_engine()
        self.buf = np.ones(region, dtype=np.uint8)
        ret = self.te.register_memory(int(self.buf.ctypes.data), region)
        if ret != 0:
            raise RuntimeError(f"register_memory returned {ret}")

    def hello(self) -> tuple[str, int]:
        return f"127.0.0.1:{self.te.get_rpc_port()}", int(self.buf.ctypes.data)

    def close(self) -> None:
        self.te.unregister_memory(int(self.buf.ctypes.data))


def _mooncake_target(region: int, conn: Any) -> None:
    _serve(conn, _MooncakeTarget(region))


class MooncakeRunner:
    """`batch_transfer_sync_write` returns once the target acknowledged every write."""

    def __init__(self, src: np.ndarray, region: int, batch: int) -> None:
        self.batch = batch
        self.te = _mooncake_engine()
        self.src = src
        if self.te.register_memory(int(src.ctypes.data), src.nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        self.peer = Peer(_mooncake_target, region)
        self.session, self.dst_base = self.peer.call("hello")

    def run(self, w: Workload) -> float:
        base = int(self.src.ctypes.data)
        srcs = (base + w.src_off().astype(np.int64)).tolist()
        dsts = (self.dst_base + w.dst_off().astype(np.int64)).tolist()
        lens = w.lengths().astype(np.int64).tolist()
        t0 = time.monotonic()
        for i in range(0, w.n, self.batch):
            j = i + self.batch
            ret = self.te.batch_transfer_sync_write(self.session, srcs[i:j], dsts[i:j], lens[i:j])
            if ret != 0:
                raise RuntimeError(f"batch_transfer_sync_write returned {ret}")
        return time.monotonic() - t0

    def close(self) -> None:
        self.peer.close()
        self.te.unregister_memory(int(self.src.ctypes.data))


# ------------------------------------------------------------------ messenger hook
class MessengerRunner:
    """The full messenger protocol via `transfer.testing.loopback.measure_transfer`.

    That function (the messenger's own, so the protocol is exercised exactly as in production:
    REQUEST over the signed control plane, per-layer progress, imm-counted writes, SUCCESS when
    the decoder's count is reached) starts its own prefill and decode processes per call and
    returns GB/s on the decoder's clock (first submit to last SUCCESS), so process start-up is
    not timed; a first wave of the same size is run and not timed, as the other runners'
    processes are warm from the warm-up round when they are timed. Pages go where the decoder's
    allocator puts them, not to `Workload.dst_pages`, but within a KV buffer of the same
    `--region-mib` per side as the other systems (pages cycle over it), so every system touches
    the same amount of memory. CPU s/GiB: prefill (initiator) and decode (target) process, all
    threads, as the messenger's processes measured them.
    """

    def __init__(self, provider: str, region: int) -> None:
        from transfer.testing.loopback import measure_transfer

        self.provider = provider
        self.region = region
        self.measure = measure_transfer

    def run(self, w: Workload) -> float:
        # one untimed wave first in the same processes: the other runners are warm too
        out = self.measure(self.provider, w.page, w.nbytes, waves=1, warm_waves=1,
                           region_bytes=self.region)
        if not out["ok"]:
            raise RuntimeError(f"messenger transfer did not succeed: {out}")
        cpu = out.get("cpu_per_gib", {})
        self.cpu_per_gib = (sum(cpu.get("prefill", {}).values()),
                            sum(cpu.get("decode", {}).values()))
        return out["bytes"] / (out["gbps"] * 1e9)

    def close(self) -> None:
        pass


def run_messenger(provider: str, src: np.ndarray, region: int) -> Any:
    """Runner for the messenger, or raise why it is unavailable (recorded, never faked)."""
    del src  # the messenger allocates its own KV caches (of `region` bytes) in its processes
    if importlib.util.find_spec("transfer.messenger") is None:
        raise ModuleNotFoundError("transfer.messenger is not present")
    return MessengerRunner(provider, region)


# ------------------------------------------------------------------ driver
@dataclass
class Results:
    """Every round's figure per system and cell, kept in round order: a figure is compared
    with its baseline of the SAME round (measured seconds apart), and the run reports the
    median over rounds of those paired ratios. This VM's speed drifts by 30-50 % within
    minutes, so best-of-N per system compared two different phases of the machine."""

    rounds: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # GB/s per round
    cpu_rounds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def add(self, system: str, cell: str, value: float) -> None:
        self.rounds.setdefault(system, {}).setdefault(cell, []).append(value)

    def add_cpu(self, name: str, per_gib: tuple[float, float]) -> None:
        self.cpu_rounds.setdefault(name, []).append(per_gib)

    @property
    def gbps(self) -> dict[str, dict[str, float]]:
        """Median GB/s over the rounds, per system and cell."""
        return {s: {c: statistics.median(v) for c, v in row.items()}
                for s, row in self.rounds.items()}

    @property
    def cpu(self) -> dict[str, tuple[float, float]]:
        """Median CPU s/GiB over the rounds (initiator, target), per system and cell."""
        return {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
                for k, v in self.cpu_rounds.items()}

    def ratio(self, a: tuple[str, str], b: tuple[str, str]) -> float | None:
        """Median over rounds of a / b, each round's a against the same round's b; None when
        either was not measured. A system that failed mid-run has its first rounds only, so
        the lists pair by round index up to the shorter."""
        return _paired_median(self.rounds.get(a[0], {}).get(a[1]),
                              self.rounds.get(b[0], {}).get(b[1]))

    def cpu_ratio(self, a: str, b: str) -> float | None:
        """Median over rounds of a's CPU s/GiB (both sides) / b's initiator's, paired."""
        return _paired_median([sum(x) for x in self.cpu_rounds.get(a, ())],
                              [y[0] for y in self.cpu_rounds.get(b, ())])


def _paired_median(xs: list[float] | None, ys: list[float] | None) -> float | None:
    """Median of x / y over the rounds both lists have; None when nothing pairs."""
    ratios = [x / y for x, y in zip(xs or (), ys or (), strict=False) if y > 0]
    return statistics.median(ratios) if ratios else None


def _cell(provider: str, page: int) -> str:
    size = f"{page // MIB}MiB" if page >= MIB else f"{page // KIB}KiB"
    return f"{provider}/{size}"


def _open_runners(systems: list[str], src: np.ndarray, region: int, res: Results,
                  args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """(system, provider) -> runner; systems that cannot start are recorded with the reason."""
    makers: list[tuple[str, str, Callable[[], Any]]] = []
    for prov in FABRIC_PROVIDERS:
        if "fabric" in systems:
            makers.append(("fabric", prov, lambda p=prov: FabricRunner(p, src, region)))
        if "messenger" in systems:
            makers.append(("messenger", prov, lambda p=prov: run_messenger(p, src, region)))
    if "nixl" in systems:
        makers.append(("nixl", "ucx", lambda: NixlRunner(src, region)))
    if "mooncake" in systems:
        makers.append(("mooncake", "tcp", lambda: MooncakeRunner(src, region, args.mooncake_batch)))
    runners: dict[tuple[str, str], Any] = {}
    for system, prov, make in makers:
        try:
            runners[(system, prov)] = make()
        except Exception as exc:  # report precisely, never fake a number
            res.skipped[f"{system}/{prov}"] = f"{type(exc).__name__}: {exc}"
    return runners


def _measure(runners: dict[tuple[str, str], Any], key: tuple[str, str], w: Workload,
             res: Results, record: bool = True) -> None:
    """One cell; a failing system is dropped from the run with its error recorded."""
    system, prov = key
    try:
        seconds = runners[key].run(w)
    except Exception as exc:
        res.skipped[f"{system}/{prov}"] = f"{type(exc).__name__}: {exc}"
        runners.pop(key).close()
        return
    if record:
        res.add(system, _cell(prov, w.page), gbps(w.nbytes, seconds))
        cpu = getattr(runners[key], "cpu_per_gib", None)
        if cpu is not None:
            res.add_cpu(f"{system}/{_cell(prov, w.page)}", cpu)


def run(args: argparse.Namespace) -> Results:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(ALL_SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {list(ALL_SYSTEMS)}")
    region = args.region_mib * MIB
    total = int(args.gib * GIB)
    pages = [int(p) * KIB for p in args.page_kib.split(",")]
    src = np.random.default_rng(0).integers(0, 256, size=region, dtype=np.uint8)
    dst = np.ones(region, dtype=np.uint8)
    res = Results()
    runners = _open_runners(systems, src, region, res, args)
    try:
        # warm-up, discarded: connections, registration caches, first touches
        for page in pages:
            w = make_workload(page, min(total, region), region, seed=page)
            run_copy(src, dst, w)
            run_copy_threads(src, dst, w)
            for key in list(runners):
                _measure(runners, key, w, res, record=False)
        for r in range(args.rounds):
            for page in pages:
                w = make_workload(page, total, region, seed=1000 * r + page)
                if "copy" in systems:
                    secs, cpu = run_copy(src, dst, w)
                    res.add("copy", _cell("memcpy", page), gbps(w.nbytes, secs))
                    res.add_cpu(f"copy/{_cell('memcpy', page)}", (cpu * GIB / w.nbytes, 0.0))
                if "copy2" in systems:
                    secs, cpu = run_copy_threads(src, dst, w)
                    res.add("copy2", _cell("memcpy", page), gbps(w.nbytes, secs))
                    res.add_cpu(f"copy2/{_cell('memcpy', page)}", (cpu * GIB / w.nbytes, 0.0))
                for key in list(runners):
                    _measure(runners, key, w, res)
                    if args.verbose:
                        print(f"round {r} {key} {page // KIB} KiB done", file=sys.stderr)
    finally:
        for runner in runners.values():
            runner.close()
    return res


def report(res: Results, pages: list[int]) -> str:
    """The table: median GB/s per system and cell over the rounds, with the median of its
    per-round ratios to the two-thread copy (`copy2`, the 2-core box's real limit) where that
    ran, else to the one-thread copy; CPU s/GiB; the issue's targets checked on what was
    measured; what could not run and why."""
    base_sys = "copy2" if "copy2" in res.rounds else "copy"
    lines = [f"GB/s: median of the rounds; ratio: median of each round's ratio to {base_sys} "
             f"({'two' if base_sys == 'copy2' else 'one'}-thread copy of the same pages) "
             f"of the same round",
             f"{'system':<22}" + "".join(f"{_size(p):>22}" for p in pages)]
    gbps = res.gbps
    for system, row in gbps.items():
        provs = sorted({cell.split("/")[0] for cell in row})
        for prov in provs:
            cells = []
            for p in pages:
                cell = f"{prov}/{_size(p)}"
                v = row.get(cell)
                r = res.ratio((system, cell), (base_sys, f"memcpy/{_size(p)}"))
                if v is None:
                    cells.append(f"{'-':>22}")
                elif r is not None:
                    cells.append(f"{v:>9.2f} GB/s {r:>5.2f}x")
                else:
                    cells.append(f"{v:>12.2f} GB/s")
            lines.append(f"{system + '/' + prov:<22}" + "".join(f"{c:>22}" for c in cells))
    for name, (ini, tgt) in res.cpu.items():
        if name.startswith(("copy/", "copy2/")):
            lines.append(f"cpu s/GiB {name}: {ini:.3f}")
        else:
            lines.append(f"cpu s/GiB {name}: initiator {ini:.3f}, target {tgt:.3f}")
    lines += [f"target {t['what']}: {t['value']:.2f} (want {t['want']}) "
              f"{'met' if t['met'] else 'NOT met'}" for t in targets(res, pages)]
    for name, why in res.skipped.items():
        lines.append(f"not measured: {name}: {why}")
    return "\n".join(lines)


#: issue 16: messenger on shm against the two-thread copy (GB/s ratio per page size), its CPU
#: s/GiB (both processes) against the copy's, and on tcp against the raw binding and Mooncake
SHM_TARGETS = {64 * KIB: 0.8, MIB: 0.9}
CPU_TARGET = 1.2
MOONCAKE_TARGET = 3.0


def targets(res: Results, pages: list[int]) -> list[dict[str, Any]]:
    """Each target the measured cells allow checking: what, the median of the per-round
    ratios, the bound."""
    out: list[dict[str, Any]] = []
    for p in pages:
        size = _size(p)
        r = res.ratio(("messenger", f"shm/{size}"), ("copy2", f"memcpy/{size}"))
        if r is not None and p in SHM_TARGETS:
            out.append({"what": f"messenger shm {size} / two-thread copy", "value": r,
                        "want": f">= {SHM_TARGETS[p]}", "met": r >= SHM_TARGETS[p]})
        r = res.cpu_ratio(f"messenger/shm/{size}", f"copy2/memcpy/{size}")
        if r is not None:
            out.append({"what": f"messenger shm {size} CPU s/GiB / two-thread copy's",
                        "value": r, "want": f"<= {CPU_TARGET}", "met": r <= CPU_TARGET})
        r = res.ratio(("messenger", f"tcp;ofi_rxm/{size}"), ("fabric", f"tcp;ofi_rxm/{size}"))
        if r is not None:
            out.append({"what": f"messenger tcp;ofi_rxm {size} / raw binding", "value": r,
                        "want": ">= 1.0", "met": r >= 1.0})
        r = res.ratio(("messenger", f"tcp;ofi_rxm/{size}"), ("mooncake", f"tcp/{size}"))
        if r is not None:
            out.append({"what": f"messenger tcp;ofi_rxm {size} / Mooncake-TCP", "value": r,
                        "want": f">= {MOONCAKE_TARGET}", "met": r >= MOONCAKE_TARGET})
    return out


def _size(page: int) -> str:
    return f"{page // MIB}MiB" if page >= MIB else f"{page // KIB}KiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    ap.add_argument("--gib", type=float, default=1.0, help="GiB moved per cell per round")
    ap.add_argument("--region-mib", type=int, default=256, help="buffer size on each side")
    ap.add_argument("--page-kib", default="64,1024", help="page sizes in KiB")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds; each ratio is the median of the rounds' ratios")
    ap.add_argument("--mooncake-batch", type=int, default=1024,
                    help="writes per batch_transfer_sync_write (its TCP lane queue is bounded)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.gib, args.region_mib, args.rounds = 1 / 16, 32, 1
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout
    if args.json:
        # stdout carries exactly one JSON object: libraries' (and children's) chatter -> stderr
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            res = run(args)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    else:
        res = run(args)
    pages = [int(p) * KIB for p in args.page_kib.split(",")]
    if args.json:
        out: dict[str, Any] = {s: {k: round(v, 3) for k, v in row.items()}
                               for s, row in res.gbps.items()}
        out["cpu_s_per_gib"] = {k: [round(x, 4) for x in v] for k, v in res.cpu.items()}
        out["rounds"] = {s: {c: [round(x, 3) for x in v] for c, v in row.items()}
                         for s, row in res.rounds.items()}
        out["targets"] = targets(res, pages)
        if res.skipped:
            out["not_measured"] = res.skipped
        print(json.dumps(out, sort_keys=True))
    else:
        moved = args.gib
        print(f"{moved:g} GiB per cell, {args.rounds} interleaved round(s); pid {os.getpid()}")
        print(report(res, pages))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run a prefill group and a decode group as real processes on this machine, through the full
messenger protocol, and report what each side saw. Used by the tests and by bench/transfer.py.

Each prefill rank process runs a miniature engine: the lead polls requests and "broadcasts" them
to the other ranks (a multiprocessing queue stands in for the engine's TP broadcast), every rank
binds the request to deterministic source pages, runs chunked passes (`begin_pass`, one
`layer_done` per layer) and `finish`es with deterministic aux rows. Its KV cache holds
deterministic data (a seeded global tensor per layer, each rank keeping its heads), so each
decode rank can check its pages byte for byte. Decode rank processes submit the prompts, wait for
every transfer to settle, verify pages and aux rows, and report counts.

`Scenario.faults` makes a prefill instance misbehave after layer 0 of its first pass:
  * "kill": SIGKILL itself (a dead peer);
  * "stall": stop bumping the progress counter until the decoder has failed the transfer, then
    finish the pass (no write may be issued after the abort);
  * "hold": wait until the decoder has counted writes before finishing the pass (layer
    streaming: completions of layer 0 arrive before the last layer is written); the first
    chunk must complete an operation (`chunk_pages` >= `writes_per_op`, or the whole prompt),
    since a partial one waits for the layer's next chunk.
A fault may name another point (the randomized fault suite uses them):
  * "kill@before": SIGKILL on receiving the first request, before binding it;
  * "kill@layer:K" / "stall@layer:K": after layer K of the first pass;
  * "kill@last": after the last layer of the first pass that completes a prompt (its last KV
    write was issued), before the metadata (aux rows) is staged;
  * "kill@meta": right after staging the metadata, while its copy to the decoder is issued.
`decode_kill_at` kills decode rank 0 "submit" (right after submitting) or "writes" (once it
has counted writes). `control_faults` arms the control-plane fault hook (transfer.wire.channel
`ControlFaults`) in the decode processes ("decode") or a prefill instance ("prefill<i>").
`track` makes the decoder time each request's failure (detection and pages-free) and report
its messenger's `stats()` once idle, and the prefill report its own.
Processes are always reaped (and their /dev/shm files removed) when `run` returns.

The control plane's secret is the caller's (`run(s, secret=...)`) or a fresh random one per run:
the harness carries none of its own.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import queue
import signal
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..fabric import shm_leftovers
from ..hostmem import host_buffer
from ..routes import ShardSpec, pages_for
from ..wire.channel import FAULTS_ENV
from ..wire.secret import check_secret, generate_secret


@dataclass(frozen=True)
class Scenario:
    provider: str = "shm"
    layout: str = "HND"
    num_kv_heads: int = 4
    prefill_tp: int = 2
    decode_tp: int = 2
    prefill_instances: int = 1
    kv_parts: int = 2
    page_size: int = 4
    head_dim: int = 8
    num_layers: int = 3
    dtype: str = "bfloat16"
    src_pages: int = 64
    dst_pages: int = 64
    prompts: tuple[int, ...] = (17, 33, 5)
    peers: tuple[int, ...] = ()           # prefill instance per prompt (default: 0)
    followups: tuple[int, ...] = ()       # second wave, same destination pages reused
    followup_peers: tuple[int, ...] = ()
    waves: int = 1                        # repeat the first wave (benchmark)
    warmup: bool = False                  # one untimed 1-page request first (connections)
    chunk_pages: int = 2
    max_inflight: int = 64                # decoder transfer slots (fewer queue the rest)
    writes_per_op: int = 0                # DecodeConfig.writes_per_op (0: provider's iov limit)
    lanes: int = 0                        # DecodeConfig.lanes (0: 2 on shm, else 1)
    prefill_inflight_bytes: int = 64 << 20  # PrefillConfig.inflight_bytes
    split_kv: bool = False                # K and V in separate buffers (buffers_per_layer=2)
    aux_row_bytes: tuple[int, ...] = (48,)
    faults: tuple[tuple[int, str], ...] = ()  # (prefill instance, "kill"|"stall"|"hold")
    decode_kill: bool = False             # decode rank 0 SIGKILLs itself once writes arrive
    decode_kill_at: str = ""              # "submit" | "writes" (decode_kill: "writes")
    control_faults: tuple[tuple[str, str], ...] = ()  # ("decode"|"prefill<i>", hook spec)
    track: bool = False                   # per-request failure timing + messenger stats
    linger_s: float = 0.0                 # keep the prefill running this long after decode
    bind_delay_s: float = 0.0             # the engine queues each request this long, then binds
    refuse: bool = False                  # the engine refuses every request (m.refuse)
    timeout_s: float = 20.0
    heartbeat_s: float = 0.2
    peer_timeout_s: float = 5.0           # fault tests shorten it
    busy_sleep_s: float = 0.0002
    prefill_busy_sleep_s: float | None = None  # default: busy_sleep_s
    verify: bool = True
    wrap_pages: bool = False              # page ids cycle over the buffers (benchmark only)
    run_timeout_s: float = 60.0
    engine_poll_s: float = 0.005          # the mini engines' longest wait for the messenger's news


@dataclass
class Outcome:
    decode: list[dict[str, Any]] = field(default_factory=list)
    prefill: list[dict[str, Any]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # every rank process of the run


# --------------------------------------------------------------------------- deterministic data
def _torch_dtype(name: str) -> Any:
    import torch
    return getattr(torch, name)


def _global_layer(s: Scenario, layer: int) -> Any:
    """[src_pages, parts, heads, page, dim] for one layer buffer (HND, all heads)."""
    import torch
    g = torch.Generator().manual_seed(1000 + layer)
    shape = (s.src_pages, s.kv_parts, s.num_kv_heads, s.page_size, s.head_dim)
    if _torch_dtype(s.dtype).is_floating_point:
        return torch.randn(shape, generator=g).to(_torch_dtype(s.dtype))
    return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).to(_torch_dtype(s.dtype))


def _local(s: Scenario, full: Any, spec: ShardSpec, rank: int) -> Any:
    hs = spec.heads_of(rank)
    t = full[:, :, hs.start:hs.stop].contiguous()
    return t if s.layout == "HND" else t.permute(0, 3, 2, 1, 4).contiguous()


def _split(s: Scenario, t: Any) -> list[Any]:
    """The layer's buffers as views: the fused tensor, or its K and V parts."""
    if not s.split_kv:
        return [t]
    dim = 1 if s.layout == "HND" else 3
    return [t.narrow(dim, j, 1) for j in range(t.shape[dim])]


def _requests(s: Scenario) -> list[tuple[str, int, int, int]]:
    """(rid, num_tokens, prefill instance, wave) in submission order."""
    out = [("warmup", s.page_size + 1, 0, -1)] if s.warmup else []
    for w in range(s.waves):
        for i, n in enumerate(s.prompts):
            out.append((f"w{w}-r{i}", n, s.peers[i] if s.peers else 0, w))
    for i, n in enumerate(s.followups):
        out.append((f"f-r{i}", n, s.followup_peers[i] if s.followup_peers else 0, s.waves))
    return out


def _page_ids(s: Scenario, total: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic page ids per request; every wave reuses the same ids."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(total)
    reqs = _requests(s)
    if s.wrap_pages:  # a bounded region reused, like bench/transfer.py's --region-mib
        need = sum(pages_for(n, s.page_size) for _, n, _, _ in reqs)
        perm = np.concatenate([perm] + [rng.permutation(total) for _ in range(need // total)])
    out, cursor, wave = {}, 0, -1
    for rid, n, _peer, w in reqs:
        if w != wave:
            cursor, wave = 0, w
        k = pages_for(n, s.page_size)
        if cursor + k > len(perm):
            raise ValueError(f"scenario: {total} pages cannot hold wave {w}")
        out[rid] = perm[cursor:cursor + k]
        cursor += k
    return out


def _aux_row(s: Scenario, rid: str, i: int) -> bytes:
    rng = np.random.default_rng(zlib.crc32(f"{rid}/{i}".encode()))
    return rng.integers(0, 256, s.aux_row_bytes[i], dtype=np.uint8).tobytes()


def _tokens(rid: str, n: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(rid.encode())).integers(0, 50000, n, dtype=np.uint32)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by thread name (the
    Python name, else the kernel's: the messenger's C lane threads are "pdtool-lane").

    Load-independent cost accounting for the benchmark: on a shared 2-core box wall clock says
    how much CPU the processes got, these say what the transfer cost and which thread spent it.
    """
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm, fields = f.read().split(" (", 1)[1].rsplit(")", 1)
        except (OSError, IndexError, ValueError):
            continue
        name = names.get(int(tid), comm)
        ticks = int(fields.split()[11]) + int(fields.split()[12])  # utime, stime
        out[name] = out.get(name, 0.0) + ticks / tick
    return out


def _cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(v - a.get(k, 0.0), 4) for k, v in b.items()}


# --------------------------------------------------------------------------- prefill process
def _forked_torch() -> Any:
    """torch in a rank process forked from the test process. A parent that already ran a
    parallel torch op owns an OpenMP thread pool the fork did not copy, and the child's first
    parallel op waits for those threads forever (libgomp is not fork-safe: a test that ran the
    reference model before this harness hung every rank). With one intra-op thread torch runs
    each op inline and never enters OpenMP; the ranks share two cores anyway."""
    import torch
    torch.set_num_threads(1)
    return torch


def _prefill_main(s: Scenario, secret: bytes, inst: int, rank: int, conn: Any,
                  bcast: list[Any], ev: dict[str, Any]) -> None:
    torch = _forked_torch()

    from ..messenger.common import PrefillConfig
    from ..messenger.prefill import PrefillMessenger

    src, dst = ShardSpec(s.num_kv_heads, s.prefill_tp), ShardSpec(s.num_kv_heads, s.decode_tp)
    # in huge-page host memory, as an engine's KV cache would be (transfer.hostmem)
    kv = [host_buffer(tuple(b.shape), b.dtype).copy_(b) for layer in range(s.num_layers)
          for b in _split(s, _local(s, _global_layer(s, layer), src, rank))]
    aux = [torch.zeros((64, rb), dtype=torch.uint8) for rb in s.aux_row_bytes]
    cfg = PrefillConfig(secret=secret, spec=src, peer_spec=dst, rank=rank, provider=s.provider,
                        buffers_per_layer=2 if s.split_kv else 1,
                        timeout_s=s.timeout_s, heartbeat_s=s.heartbeat_s,
                        peer_timeout_s=s.peer_timeout_s, inflight_bytes=s.prefill_inflight_bytes,
                        busy_sleep_s=s.busy_sleep_s if s.prefill_busy_sleep_s is None
                        else s.prefill_busy_sleep_s)
    fault = dict(s.faults).get(inst, "")
    kind, _, point = fault.partition("@")
    point = point or ("layer:0" if kind else "")
    cf = dict(s.control_faults).get(f"prefill{inst}")
    if cf:
        os.environ[FAULTS_ENV] = cf
    m = PrefillMessenger(cfg, kv, s.layout, aux)
    conn.send(m.address)
    pages = _page_ids(s, s.src_pages, 1)
    active: list[list[Any]] = []   # [req, next token]
    held: list[tuple[float, Any]] = []  # (bind time, req): the engine's queue (bind_delay_s)
    results: dict[str, Any] = {}
    first_pass, report = True, {"inst": inst, "rank": rank, "pid": os.getpid()}
    bound_at: dict[str, float] = {}
    t_start = time.monotonic()
    cpu0: dict[str, float] | None = None   # per-thread CPU when the first timed request came
    cpu1: dict[str, float] = {}            # ... and when the last result came
    try:
        while not ev["stop"].is_set():
            if rank == 0:
                new = m.poll_requests()
                for q in bcast:
                    for r in new:
                        q.put(r)
            else:
                new = []
                with contextlib.suppress(queue.Empty):
                    while True:
                        new.append(bcast[0].get_nowait())
            if new and kind == "kill" and point == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            if s.refuse:
                for req in new:
                    m.refuse(req, "refused: the engine cannot hold this request")
                new = []
            now = time.monotonic()
            held += [(now + s.bind_delay_s, req) for req in new]
            new = [req for due, req in held if due <= now]
            held = [(due, req) for due, req in held if due > now]
            for req in new:
                if cpu0 is None and req.rid != "warmup":
                    cpu0 = thread_cpu()
                bound_at[req.rid] = time.monotonic()
                m.bind(req, pages[req.rid])
                active.append([req, 0])
                if req.num_pages == 0:
                    m.finish(req.rid, [_aux_row(s, req.rid, i) for i in range(len(aux))])
            chunks = []
            for a in active:
                req, lo = a
                todo = req.num_tokens - 1
                if lo < todo:
                    hi = min(todo, lo + s.chunk_pages * s.page_size)
                    chunks.append((req.rid, lo, hi))
                    a[1] = hi
            if chunks:
                m.begin_pass(chunks)
                for layer in range(s.num_layers):
                    m.layer_done(layer)
                    if first_pass and kind and point == f"layer:{layer}":
                        _fault(s, m, kind, ev, report)
                first_pass = False
                last = [rid for rid, _lo, hi in chunks
                        if hi == next(a for a in active if a[0].rid == rid)[0].num_tokens - 1]
                if last and kind == "kill" and point == "last":
                    time.sleep(0.2)  # the last layer's writes go out
                    os.kill(os.getpid(), signal.SIGKILL)
                for rid in last:
                    m.finish(rid, [_aux_row(s, rid, i) for i in range(len(aux))])
                if last and kind == "kill" and point == "meta":
                    time.sleep(0.001)
                    os.kill(os.getpid(), signal.SIGKILL)
            active = [a for a in active if a[1] < a[0].num_tokens - 1]
            for rid in m.done():
                r = m.result(rid)
                results[rid] = {"ok": r.ok, "reason": r.reason, "writes": r.writes,
                                "seconds": time.monotonic() - bound_at.get(rid, t_start)}
                m.release(rid)
                cpu1 = thread_cpu()
            # an aborted request may be settled before its last chunk: stop computing it
            active = [a for a in active if a[0].rid not in results]
            if not chunks and not new:
                m.news.wait(s.engine_poll_s)  # as an engine waits: woken by a REQUEST or a result
        if s.track:
            report["stats"] = m.stats()
            report["control_log"] = _control_log()
        time.sleep(0.05)
        for rid in m.done():
            r = m.result(rid)
            results[rid] = {"ok": r.ok, "reason": r.reason, "writes": r.writes}
        report.update(results=results, writes_issued=m.writes_issued, ops_issued=m.ops_issued,
                      cpu=_cpu_delta(cpu0 or {}, cpu1) if cpu0 else {})
    finally:
        m.close()
    conn.send(report)


def _fault(s: Scenario, m: Any, fault: str, ev: dict[str, Any], report: dict[str, Any]) -> None:
    if fault == "kill":
        time.sleep(0.3)  # let layer 0's writes go out
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stall":
        report["released"] = ev["decoder_failed"].wait(60)
        report["writes_at_abort"] = m.writes_issued
        time.sleep(0.3)  # the messenger thread sees the rest of the layers (and must not send)
    elif fault == "hold":
        report["held"] = ev["decoder_saw_writes"].wait(30)
        time.sleep(0.2)  # the batch whose first write the decoder saw has surely returned
        report["writes_while_held"] = m.writes_issued
        if s.decode_kill:  # stay mid-pass until the dead decoder's lease has run out
            time.sleep(2 * s.peer_timeout_s + 0.5)


# --------------------------------------------------------------------------- decode process
def _decode_main(s: Scenario, secret: bytes, rank: int, endpoints: tuple[tuple[str, ...], ...],
                 conn: Any, ev: dict[str, Any]) -> None:
    torch = _forked_torch()

    from ..messenger.common import DecodeConfig, TransferStatus
    from ..messenger.decode import DecodeMessenger

    src, dst = ShardSpec(s.num_kv_heads, s.prefill_tp), ShardSpec(s.num_kv_heads, s.decode_tp)
    parts = 1 if s.split_kv else s.kv_parts
    heads = dst.heads_per_rank
    shape = ((s.dst_pages, parts, heads, s.page_size, s.head_dim) if s.layout == "HND"
             else (s.dst_pages, s.page_size, heads, parts, s.head_dim))
    kv = [host_buffer(shape, _torch_dtype(s.dtype))
          for _ in range(s.num_layers * (2 if s.split_kv else 1))]
    aux = [torch.zeros((64, rb), dtype=torch.uint8) for rb in s.aux_row_bytes]
    cfg = DecodeConfig(secret=secret, spec=dst, peer_spec=src, rank=rank, provider=s.provider,
                       buffers_per_layer=2 if s.split_kv else 1,
                       prefill_endpoints=endpoints, max_inflight=s.max_inflight,
                       timeout_s=s.timeout_s,
                       heartbeat_s=s.heartbeat_s, peer_timeout_s=s.peer_timeout_s,
                       busy_sleep_s=s.busy_sleep_s, quarantine_grace_s=2.0,
                       writes_per_op=s.writes_per_op, lanes=s.lanes)
    cf = dict(s.control_faults).get("decode")
    if cf:
        os.environ[FAULTS_ENV] = cf
    kill_at = s.decode_kill_at or ("writes" if s.decode_kill else "")
    m = DecodeMessenger(cfg, kv, s.layout, aux)
    dpages, spages = _page_ids(s, s.dst_pages, 2), _page_ids(s, s.src_pages, 1)
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "requests": {}, "waves": []}
    final = (TransferStatus.SUCCESS, TransferStatus.FAILED)
    reqs = _requests(s)
    try:
        for wave in sorted({w for *_, w in reqs}):
            batch = [r for r in reqs if r[3] == wave]
            t0, cpu0 = time.perf_counter(), thread_cpu()
            submitted = time.monotonic()
            for rid, n, peer, _w in batch:
                m.submit(rid, _tokens(rid, n), dpages[rid], peer=peer)
            if kill_at == "submit" and rank == 0:
                time.sleep(0.02)  # the REQUEST is on its way, nothing written yet
                os.kill(os.getpid(), signal.SIGKILL)
            pending = {r[0]: r for r in batch}
            detected: dict[str, float] = {}
            deadline = time.monotonic() + s.run_timeout_s
            watch = not ev["decoder_saw_writes"].is_set()
            while pending and time.monotonic() < deadline:
                # cheap while timing: per-request status only until writes were first seen
                settled = m.ready() | m.failed()
                for rid, (_rid, _n, peer, _w) in list(pending.items()):
                    if not watch and not s.track and rid not in settled:
                        continue
                    st = m.status(rid)
                    if st.status is TransferStatus.ABORTING and rid not in detected:
                        detected[rid] = time.monotonic() - submitted
                    if watch and st.received and not ev["decoder_saw_writes"].is_set():
                        watch = False
                        report["seen"] = {"rid": rid, "received": st.received,
                                          "expected": st.expected}
                        ev["decoder_saw_writes"].set()
                        if kill_at == "writes" and rank == 0:
                            os.kill(os.getpid(), signal.SIGKILL)
                    if st.status not in final:
                        continue
                    # settled: check it, then release it at once (its slot serves the next)
                    del pending[rid]
                    info = {"status": st.status.value, "reason": st.reason,
                            "received": st.received, "expected": st.expected, "peer": peer,
                            "pages": len(dpages[rid])}
                    if s.track:
                        info["settled_s"] = time.monotonic() - submitted
                        info["detected_s"] = detected.get(rid, info["settled_s"])
                    if st.status is TransferStatus.SUCCESS and s.verify:
                        info.update(_verify(s, m, kv, dst, rank, rid, dpages[rid], spages[rid]))
                    report["requests"][rid] = info
                    m.release(rid)
                    if st.status is TransferStatus.FAILED:
                        ev["decoder_failed"].set()
                if pending:
                    m.news.wait(s.engine_poll_s)  # woken when a transfer settles
            if wave >= 0:
                report["waves"].append({"seconds": time.perf_counter() - t0,
                                        "pages": sum(len(dpages[r[0]]) for r in batch),
                                        "cpu": _cpu_delta(cpu0, thread_cpu())})
            for rid in pending:
                st = m.status(rid)
                report["requests"][rid] = {"status": st.status.value, "reason": st.reason,
                                           "received": st.received, "expected": st.expected}
        report["stale_writes"] = m.stale_writes
        report["writes_per_op"] = m.writes_per_op
        report["lane_writes"] = m.lane_writes
        if s.track:  # released slots go back on the messenger thread: let it catch up
            end = time.monotonic() + 5
            while time.monotonic() < end and m.stats()["slots_free"] < cfg.max_inflight:
                time.sleep(0.01)
            report["stats"] = m.stats()
            report["control_log"] = _control_log()
    finally:
        m.close()
    conn.send(report)


def _control_log() -> list[tuple[str, str, str]]:
    from ..wire.channel import env_faults

    f = env_faults()
    return list(f.log) if f is not None else []


def _verify(s: Scenario, m: Any, kv: list[Any], dst: ShardSpec, rank: int, rid: str,
            dpages: np.ndarray, spages: np.ndarray) -> dict[str, Any]:
    import torch

    bad = []
    per = 2 if s.split_kv else 1
    for i, buf in enumerate(kv):
        layer = i // per
        want = _split(s, _local(s, _global_layer(s, layer)[torch.as_tensor(spages)], dst,
                                rank))[i % per]
        got = buf[torch.as_tensor(dpages)]
        if not torch.equal(got.view(torch.uint8) if got.dtype != torch.uint8 else got,
                           want.view(torch.uint8) if want.dtype != torch.uint8 else want):
            bad.append(layer)
    aux_ok = all(bytes(m.aux(rid, i)) == _aux_row(s, rid, i) for i in range(len(s.aux_row_bytes)))
    return {"bad_layers": bad, "aux_ok": aux_ok}


# --------------------------------------------------------------------------- orchestration
def run(s: Scenario, secret: bytes | None = None) -> Outcome:
    """Start every process, wait for the decode reports, stop and reap everything. `secret`:
    the control plane's key (at least 32 random bytes); by default a fresh one for this run."""
    import torch  # noqa: F401  (once here, so the forked rank processes start at once)

    secret = generate_secret() if secret is None else check_secret(secret)

    ctx = mp.get_context("fork")
    ev = {k: ctx.Event() for k in ("stop", "decoder_saw_writes", "decoder_failed")}
    procs: list[Any] = []
    pconns: list[Any] = []
    out = Outcome()
    try:
        endpoints = []
        for inst in range(s.prefill_instances):
            bcast = [ctx.Queue() for _ in range(s.prefill_tp - 1)]
            group_conns = []
            for rank in range(s.prefill_tp):
                a, b = ctx.Pipe()
                my_q = bcast if rank == 0 else [bcast[rank - 1]]
                p = ctx.Process(target=_prefill_main,
                                args=(s, secret, inst, rank, b, my_q, ev),
                                daemon=True)
                p.start()
                b.close()  # so a killed child shows up as EOF here
                procs.append(p)
                group_conns.append(a)
            endpoints.append(tuple(_recv(c, 30, "prefill address") for c in group_conns))
            pconns += group_conns
        dconns = []
        for rank in range(s.decode_tp):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_decode_main,
                            args=(s, secret, rank, tuple(endpoints), b, ev),
                            daemon=True)
            p.start()
            b.close()
            procs.append(p)
            dconns.append(a)
        for c in dconns:
            with contextlib.suppress(EOFError):  # a decode rank killed by a fault
                out.decode.append(_recv(c, s.run_timeout_s + 10, "decode report"))
        time.sleep(s.linger_s)
        ev["stop"].set()
        for c in pconns:
            with contextlib.suppress(EOFError, TimeoutError, OSError):
                out.prefill.append(_recv(c, 10, "prefill report"))
    finally:
        ev["stop"].set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        out.pids = [p.pid for p in procs if p.pid]
        _remove_shm(out.pids)
    return out


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} within {timeout:.0f} s")
    return conn.recv()


def _remove_shm(pids: list[int]) -> None:
    """libfabric's shm provider leaves a file per process in /dev/shm when killed."""
    for path in shm_leftovers(pids):
        with contextlib.suppress(OSError):
            os.unlink(path)


def measure_transfer(provider: str = "shm", page_bytes: int = 1 << 16,
                     total_bytes: int = 1 << 30, *, requests: int = 16, waves: int = 3,
                     num_layers: int = 1, busy_sleep_s: float = 0.0,
                     prefill_busy_sleep_s: float = 0.0,
                     region_bytes: int | None = None, warm_waves: int = 0) -> dict[str, Any]:
    """Move `total_bytes` of `page_bytes` pages from a prefill process to a decode process
    through the full messenger protocol, `waves` times; returns the best wave's GB/s (decoder
    clock: first submit to last SUCCESS) with the per-wave figures. For bench/transfer.py.

    `region_bytes`: size of each side's KV buffer; by default every page has its own slot
    (`total_bytes` per side); smaller, pages cycle over it (scattered, as bench/transfer.py's
    `--region-mib` does for the other systems), which keeps runs comparable.
    `warm_waves`: that many waves of the same size run first and are not reported, so the
    figures are of processes and connections already warm, as the other systems' runners
    are after their warm-up round (on tcp the first wave of a fresh pair of processes ran
    3.9-4.4 GB/s and the later ones 4.1-5.0, 2026-12-03); their prefill CPU is still counted
    in the prefill's average."""
    pages = max(1, total_bytes // (page_bytes * num_layers))
    per_req = max(1, math.ceil(pages / requests))
    total = per_req * requests
    buf_pages = total if region_bytes is None else max(1, min(total, region_bytes // page_bytes))
    s = Scenario(provider=provider, num_kv_heads=1, prefill_tp=1, decode_tp=1, kv_parts=1,
                 page_size=1, head_dim=page_bytes, dtype="uint8", num_layers=num_layers,
                 src_pages=buf_pages, dst_pages=buf_pages, wrap_pages=buf_pages < total,
                 prompts=(per_req + 1,) * requests, chunk_pages=per_req, aux_row_bytes=(),
                 waves=warm_waves + waves, warmup=True, busy_sleep_s=busy_sleep_s,
                 prefill_busy_sleep_s=prefill_busy_sleep_s, verify=False,
                 timeout_s=120.0, run_timeout_s=300.0)
    out = run(s)
    rep = out.decode[0]
    ok = all(r["status"] == "success" for r in rep["requests"].values())
    moved = per_req * requests * page_bytes * num_layers
    timed = rep["waves"][warm_waves:]
    rates = [moved / w["seconds"] / 1e9 for w in timed]
    best = max(range(len(rates)), key=rates.__getitem__)
    gib = moved / (1 << 30)
    pre = out.prefill[0].get("cpu", {}) if out.prefill else {}
    # CPU seconds per GiB by thread: decode for the best wave; prefill over every wave
    cpu = {"decode": {k: round(v / gib, 4) for k, v in timed[best]["cpu"].items()},
           "prefill": {k: round(v / (gib * (warm_waves + waves)), 4) for k, v in pre.items()}}
    return {"provider": provider, "page_bytes": page_bytes, "bytes": moved, "ok": ok,
            "gbps": rates[best], "waves_gbps": rates, "cpu_per_gib": cpu}


def scenario(**kw: Any) -> Scenario:
    return replace(Scenario(), **kw)

"""KV pages in CUDA memory between two processes on one GPU over shm, on the staged path.

Two steps of gpu/check.py; on CPU (`cpu=True`) the same code runs on CPU tensors (the "device"
copies are host copies), which is how CI checks it without a GPU.

  pointer_checks (`check_direct_refused`): an Endpoint with FI_HMEM registering CUDA memory
     fails with the message naming transfer.gpu_memory and the cause (Debian's libfabric has no
     CUDA); the CUDA pointer check accepts a cudaMalloc tensor and each fused K/V half of it,
     refuses pinned host, managed, past-the-end and expandable-segments memory; whether the
     driver hands out a dma-buf for device memory.
  staged_transfer (`run`): baselines first, device->device and device->host->device through
     pinned memory for the same bytes; then a decode process arms a slot and reserves landing
     memory, a prefill process on the same GPU sends its KV pages layer by layer through
     bounce buffers (StagedSender), and the decoder counts the operations, copies
     host->device and checks every byte against the prefill's pages (regenerated from the
     same seed). GB/s from the send's start to the pages being in the decoder's GPU memory.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

WAIT_S = 120.0


def kv_tensor(device: str, nbytes: int, seed: int) -> Any:
    """The prefill's KV buffer: deterministic bytes, so the decoder can regenerate them."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Which pages go where: a random subset of the prefill's pages to random decoder pages,
    grouped by layer (layers x pages_per_layer pages of page_bytes)."""
    rng = np.random.default_rng(args.seed)
    total = args.layers * args.pages
    n = total * 3 // 4
    return {"src": rng.choice(total, n, replace=False).tolist(),
            "dst": rng.choice(total, n, replace=False).tolist()}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def decode_proc(args: argparse.Namespace, conn: Any) -> None:
    import torch

    from transfer.fabric import Endpoint
    from transfer.staging import LandingPool

    dev = args.device
    p = plan(args)
    nbytes = args.layers * args.pages * args.page_bytes
    kv = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    ep = Endpoint("shm", max_slots=64)
    n = len(p["dst"])
    lengths = np.full(n, args.page_bytes, np.uint64)
    pages_per_block = max(1, args.block_bytes // args.page_bytes)
    landing = LandingPool(ep, capacity_bytes=-(-n // pages_per_block) * args.block_bytes,
                          block_bytes=args.block_bytes, device=dev)
    expect_src = kv_tensor(dev, nbytes, args.seed).view(-1, args.page_bytes)
    expect = expect_src[torch.as_tensor(p["src"], device=dev)]
    conn.send(ep.name)
    results = []
    for it in range(args.iterations):
        grant = landing.reserve(lengths)
        ep.arm(1, it + 1)
        kv.zero_()
        _sync(dev)
        conn.send((grant.region.to_dict(), grant.dst_offsets.tolist()))
        want, t0 = conn.recv()
        reached = ep.wait_recv(1, want, WAIT_S)
        t_counted = time.monotonic()
        landing.deliver(grant, kv, np.array(p["dst"], np.uint64) * np.uint64(args.page_bytes))
        t1 = time.monotonic()
        landing.release(grant)
        got = kv.view(-1, args.page_bytes)[torch.as_tensor(p["dst"], device=dev)]
        results.append({"reached": bool(reached), "count": int(ep.recv_counts[1]),
                        "want": want, "exact": bool(torch.equal(got, expect)),
                        "seconds": t1 - t0, "counted_s": t_counted - t0,
                        "deliver_s": t1 - t_counted, "stale": ep.stale_writes})
    conn.send(results)
    conn.recv()
    landing.close()
    ep.close()


def prefill_proc(args: argparse.Namespace, conn: Any) -> None:
    from transfer.fabric import Endpoint, RemoteRegion, encode_imm
    from transfer.staging import BouncePool, Chunk, StagedSender

    dev = args.device
    p = plan(args)
    nbytes = args.layers * args.pages * args.page_bytes
    kv = kv_tensor(dev, nbytes, args.seed)
    _sync(dev)
    ep = Endpoint("shm", max_slots=64)
    pool = BouncePool(ep, buffers=args.buffers, buffer_bytes=args.buffer_bytes, device=dev)
    sender = StagedSender(ep, pool, timeout=WAIT_S)
    peer = ep.insert_peer(conn.recv())
    src = np.array(p["src"], np.int64)
    layer_of = src // args.pages
    for _ in range(args.iterations):
        region, offsets = conn.recv()
        offsets = np.array(offsets, np.uint64)
        chunks = []
        for layer in range(args.layers):  # one chunk per layer, as a forward pass finishes them
            sel = np.flatnonzero(layer_of == layer)
            chunks.append(Chunk(kv, src[sel].astype(np.uint64) * np.uint64(args.page_bytes),
                                np.full(len(sel), args.page_bytes, np.uint64), offsets[sel]))
        want = sum(-(-len(c.lengths) // args.per_op) for c in chunks)
        t0 = time.monotonic()
        conn.send((want, t0))
        ops = sender.send(peer, RemoteRegion.from_dict(region), chunks, imm=encode_imm(1, _ + 1),
                          per_op=args.per_op)
        sender.flush()
        assert ops == want, (ops, want)
    conn.send({"peak_buffers": pool.in_use_peak, "pool_bytes": pool.allocated_bytes,
               "errors": ep.errors})
    conn.recv()
    sender.close()
    pool.close()
    ep.close()


def baselines(args: argparse.Namespace, nbytes: int) -> dict[str, float]:
    """GB/s of a device->device copy and a device->host->device copy of `nbytes`."""
    import torch

    dev = args.device
    a = kv_tensor(dev, nbytes, 1)
    b = torch.empty_like(a)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.startswith("cuda"))

    def best(fn: Any) -> float:
        times = []
        for _ in range(max(args.iterations, 3)):
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            times.append(time.perf_counter() - t)
        return nbytes / min(times) / 1e9

    d2d = best(lambda: b.copy_(a))
    d2h2d = best(lambda: (host.copy_(a), b.copy_(host)))
    assert torch.equal(a, b)
    return {"d2d_gbs": round(d2d, 2), "d2h2d_gbs": round(d2h2d, 2)}


def _pointer_answer(addr: int, length: int, device: int) -> str:
    """The CUDA pointer check's answer: "accepted" or its message."""
    from transfer.fabric import GpuMemoryError, check_cuda_pointer

    try:
        check_cuda_pointer(addr, length, device)
        return "accepted"
    except GpuMemoryError as exc:
        return str(exc)


def _managed_answer() -> str:
    """The pointer check on cudaMallocManaged memory (torch allocates none: the runtime's own
    call through ctypes), or why it was not tried."""
    import ctypes

    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return "not tried: no libcudart.so.* loadable"
    ptr = ctypes.c_void_p()
    if rt.cudaMallocManaged(ctypes.byref(ptr), ctypes.c_size_t(1 << 20), ctypes.c_uint(1)):
        return "not tried: cudaMallocManaged failed"
    try:
        return _pointer_answer(ptr.value, 1 << 20, 0)
    finally:
        rt.cudaFree(ptr)


def check_direct_refused(device: str) -> dict[str, Any]:
    """transfer.gpu_memory=direct on this libfabric, and the CUDA pointer check: what
    registration would accept and refuse on this node."""
    import torch

    from transfer.fabric import (
        Endpoint,
        GpuMemoryError,
        build_features,
        cuda_dmabuf_support,
        gpu_direct_support,
    )

    out: dict[str, Any] = {"build_features": build_features()}
    buf = torch.zeros(2, 1 << 20, dtype=torch.uint8, device=device)  # fused K/V halves
    with Endpoint("shm", hmem=True) as ep:
        out["offers_hmem"] = ep.offers_hmem
        try:
            ep.register(buf.data_ptr(), buf.numel(), iface="cuda",
                        device=buf.device.index or 0)
            out["direct_refused"] = False
        except GpuMemoryError as exc:
            out["direct_refused"] = "transfer.gpu_memory" in str(exc)
            out["direct_message"] = str(exc)
    out["gpu_direct_support"] = list(gpu_direct_support("shm"))
    if not device.startswith("cuda"):
        msg = _pointer_answer(buf.data_ptr(), buf.numel(), 0)  # no CUDA driver here
        out["host_pointer_refused"] = msg != "accepted" and "transfer.gpu_memory" in msg
        out["pointer_message"] = msg
        return out
    half = buf[1]
    out["accepted"] = {k: _pointer_answer(*a) == "accepted" for k, a in {
        "device": (buf.data_ptr(), buf.numel(), 0),
        "k_half": (buf[0].data_ptr(), half.numel(), 0),
        "v_half": (half.data_ptr(), half.numel(), 0)}.items()}
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    answers = {"pinned_host": _pointer_answer(pinned.data_ptr(), pinned.numel(), 0),
               "managed": _managed_answer(),
               "past_the_end": _pointer_answer(buf.data_ptr(), buf.numel() + (2 << 20), 0),
               "expandable_segments": expandable_segments_refused()}
    out["refused"] = {k: v != "accepted" for k, v in answers.items()
                      if not v.startswith("not tried")}
    out["refusal_messages"] = answers
    dmabuf, why = cuda_dmabuf_support(buf.data_ptr(), buf.numel())
    out["driver_dmabuf"] = dmabuf or why  # True: FI_MR_DMABUF is what mr.c asks for
    return out


def expandable_segments_refused() -> str:
    """The pointer check on a tensor from PyTorch's expandable segments (CUDA VMM), in a
    process of its own (the allocator setting is read once per process): the message."""
    import subprocess

    code = ("import torch\nfrom transfer.fabric import check_cuda_pointer, GpuMemoryError\n"
            "t = torch.zeros(64 << 20, dtype=torch.uint8, device='cuda:0')\n"
            "try:\n    check_cuda_pointer(t.data_ptr(), t.numel(), 0)\n    print('ACCEPTED')\n"
            "except GpuMemoryError as e:\n    print(e)\n")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    return (r.stdout + r.stderr).strip()[-600:]


def run(cpu: bool) -> dict[str, Any]:
    """The staged transfer between two processes (gpu/check.py's step): its summary, `ok`
    only when every run reached its count, byte-exact, with no stale write and no error."""
    args = argparse.Namespace(
        cpu=cpu, device="cpu" if cpu else "cuda:0", layers=8 if cpu else 32,
        pages=64 if cpu else 256, page_bytes=32 << 10 if cpu else 128 << 10, per_op=4,
        buffers=4, buffer_bytes=4 << 20 if cpu else 16 << 20,
        block_bytes=4 << 20 if cpu else 16 << 20, iterations=3, seed=7)
    import torch

    summary: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    moved = len(plan(args)["src"]) * args.page_bytes
    summary["baseline"] = baselines(args, moved)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=decode_proc, args=(args, pipes[0][1])),
             ctx.Process(target=prefill_proc, args=(args, pipes[1][1]))]
    for p in procs:
        p.start()
    dec, pre = pipes[0][0], pipes[1][0]

    def recv(conn: Any) -> Any:
        """The next message; RuntimeError as soon as either process died."""
        deadline = time.monotonic() + WAIT_S
        while not conn.poll(0.2):
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"a transfer process exited with {dead[0]}")
            if time.monotonic() > deadline:
                raise RuntimeError("no answer from the transfer processes")
        return conn.recv()

    try:
        pre.send(recv(dec))                  # the decoder's fabric name
        for _ in range(args.iterations):
            pre.send(recv(dec))              # landing region + offsets
            dec.send(recv(pre))              # expected operations + start time
        runs = recv(dec)
        sender = recv(pre)
        for c in (dec, pre):
            c.send("done")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    gbs = [moved / r["seconds"] / 1e9 for r in runs]
    summary["staged"] = {
        "bytes": moved, "runs": runs, "gbs_best": round(max(gbs), 2),
        "gbs_median": round(statistics.median(gbs), 2), **sender,
        "buffers": args.buffers, "buffer_bytes": args.buffer_bytes,
    }
    summary["ok"] = bool(all(r["reached"] and r["exact"] and r["count"] == r["want"]
                             and r["stale"] == 0 for r in runs) and not sender["errors"])
    return summary
